"""Meshes of any devices and the TPU topologies of compile-only runs, without libtpu (the tpu_aot tier compiles)."""

from __future__ import annotations

import sys

import jax
import pytest

from cmtune.workers.cluster import DeviceSpec, is_compile_only
from collective_matmul.programs.topology import TopologyError, compile_only, mesh_of, tpu_devices


def test_without_libtpu_a_topology_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # an import of it fails, as where it is not installed
    with pytest.raises(TopologyError, match=r"needs libtpu: pip install 'cmtune\[tpu\]'"):
        tpu_devices("v5p:2x2x1")


def test_devices_of_this_host_run_and_make_meshes():
    devices = jax.devices()
    assert not compile_only(devices)
    mesh = mesh_of(devices, (2, 4), ("data", "model"))
    assert mesh.shape == {"data": 2, "model": 4}
    with pytest.raises(ValueError, match="needs 16 devices, got 8"):
        mesh_of(devices, (4, 4), ("data", "model"))


@pytest.mark.parametrize("text, topology", [("tpu:v5p:2x2x1", "v5p:2x2x1"), ("tpu:v4:4x4x4", "v4:4x4x4"),
                                            ("tpu:v5e:2x2", "v5e:2x2")])
def test_a_tpu_device_spec_names_a_topology_and_only_compiles(text, topology):
    spec = DeviceSpec.parse(text)
    assert spec.kind == "tpu" and spec.topology == topology and is_compile_only(text) and not spec.needs_group


@pytest.mark.parametrize("text", ["tpu:", "tpu:v5p", "tpu:v5p:2x", "tpu:V5P:2x2"])
def test_a_malformed_topology_is_refused_with_what_to_give(text):
    with pytest.raises(ValueError, match="expected tpu:TOPOLOGY"):
        DeviceSpec.parse(text)


@pytest.mark.parametrize("text, card, hosts, per_host, label", [
    ("gpu:h100:8", "h100", 1, 8, "gpu:h100:1x8"), ("gpu:b200:2x8", "b200", 2, 8, "gpu:b200:2x8"),
    ("gpu:my-h100_nvl.2:4", "my-h100_nvl.2", 1, 4, "gpu:my-h100_nvl.2:1x4")])
def test_a_gpu_device_spec_names_a_card_and_a_node_and_only_compiles(text, card, hosts, per_host, label):
    spec = DeviceSpec.parse(text)
    assert (spec.kind, spec.topology, spec.count, spec.local, spec.label) == ("gpu", card, hosts, per_host, label)
    assert spec.compile_only and not spec.needs_group and spec.total == hosts * per_host


@pytest.mark.parametrize("text", ["gpu:", "gpu:h100", "gpu:h100:0", "gpu:h100:0x8", "gpu:H100:8", "gpu:h100:2x"])
def test_a_malformed_gpu_node_is_refused_with_what_to_give(text):
    with pytest.raises(ValueError, match="expected gpu:CARD:D or gpu:CARD:HxD"):
        DeviceSpec.parse(text)


def test_compiled_devices_of_a_spec_that_runs_is_refused():
    with pytest.raises(ValueError, match="not a compile-only device spec"):
        DeviceSpec.parse("virtual:8").compiled_devices()


@pytest.mark.parametrize("text, platform, local", [("processes:2x4", "cpu", 4), ("processes:2x4@cpu", "cpu", 4),
                                                   ("processes:2x4@gpu", "gpu", 4), ("processes:2x4@cuda", "gpu", 4)])
def test_a_process_group_names_its_platform_in_one_grammar(text, platform, local):
    spec = DeviceSpec.parse(text)
    assert (spec.kind, spec.count, spec.local, spec.platform) == ("processes", 2, local, platform)


@pytest.mark.parametrize("text, message", [("processes:2x4@tpu", "runs on cpu or cuda or gpu devices"),
                                           ("processes:2@gpu", "give the devices of each process")])
def test_a_group_on_an_unknown_platform_or_without_its_devices_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        DeviceSpec.parse(text)


def test_a_group_keeps_the_measurements_xla_flags_and_gives_each_gpu_process_its_own_gpus():
    from cmtune.workers.cluster import child_env

    parent = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=true",
              "PATH": "/bin"}
    cpu = child_env(parent, coordinator="127.0.0.1:1", num_processes=2, process_id=1, local_devices=4)
    assert cpu["JAX_PLATFORMS"] == "cpu" and cpu["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=true"
    assert "CUDA_VISIBLE_DEVICES" not in cpu and cpu["CMTUNE_PROCESS_ID"] == "1"
    gpu = child_env(parent, coordinator="127.0.0.1:1", num_processes=2, process_id=1, local_devices=4,
                    platform="gpu")
    assert gpu["JAX_PLATFORMS"] == "cuda" and gpu["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert "XLA_FLAGS" not in child_env({}, coordinator="c", num_processes=1, process_id=0, local_devices=1)


def test_a_gpu_worker_runs_with_the_overlap_flags_and_a_users_own_value_wins():
    from collective_matmul.planning.xla_options import missing_overlap_flags, with_overlap_flags

    flags = with_overlap_flags("--xla_gpu_experimental_parallel_collective_overlap_limit=4", "gpu")
    assert flags.split() == ["--xla_gpu_experimental_parallel_collective_overlap_limit=4",
                             "--xla_gpu_enable_latency_hiding_scheduler=true"]
    assert missing_overlap_flags(flags, "cuda") == [] and with_overlap_flags("", "cpu") == ""
    assert missing_overlap_flags("", "gpu") == ["--xla_gpu_enable_latency_hiding_scheduler=true",
                                                "--xla_gpu_experimental_parallel_collective_overlap_limit=2"]
