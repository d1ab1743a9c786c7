"""`cmtune submit`'s hardware defaults, alone (the command against a service: tests/service/test_api.py)."""

from __future__ import annotations

import pytest

from cmtune.submit import HardwareOptions, step_hardware, study_hardware
from collective_matmul.planning.problem import Hardware
from collective_matmul.wire import HardwareIn

POOL = HardwareIn(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", device_count=8)


def test_with_no_option_a_study_is_on_the_workers_hardware_else_on_cpus_defaults():
    assert study_hardware(HardwareOptions(), 4, POOL) == POOL
    assert study_hardware(HardwareOptions(), 4) == HardwareIn(platform="cpu", device_kind="cpu", device_count=4,
                                                              process_count=1)


@pytest.mark.parametrize("options, expected", [
    (HardwareOptions(platform="cpu"), dict(platform="cpu", device_kind="cpu", device_count=4, process_count=1)),
    (HardwareOptions(device_count=16), dict(platform="cpu", device_kind="cpu", device_count=16, process_count=1)),
    (HardwareOptions(platform="tpu", device_kind="TPU v5", device_count=8, process_count=2),
     dict(platform="tpu", device_kind="TPU v5", device_count=8, process_count=2)),
])
def test_an_option_given_replaces_the_workers_hardware_and_takes_cpus_defaults_for_the_rest(options, expected):
    assert options.given
    assert study_hardware(options, 4, POOL) == HardwareIn(**expected)


def test_a_steps_hardware_is_its_ring_here_with_the_options_over_it():
    ring = Hardware(platform="cpu", device_kind="cpu", device_count=4, process_count=1, slice_devices=8)
    assert step_hardware(HardwareOptions(), ring) == HardwareIn.of(ring)
    given = step_hardware(HardwareOptions(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", device_count=16,
                                          process_count=2), ring)
    assert given == HardwareIn(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", device_count=4, process_count=2,
                               slice_devices=16)
