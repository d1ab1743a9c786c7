"""Meshes of any devices and the TPU topologies of compile-only runs, without libtpu (the tpu_aot tier compiles)."""

from __future__ import annotations

import sys

import jax
import pytest

from cmtune.workers.cluster import DeviceSpec
from collective_matmul.topology import TopologyError, compile_only, mesh_of, tpu_devices


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
    assert spec.kind == "tpu" and spec.topology == topology and spec.compile_only and not spec.needs_group


@pytest.mark.parametrize("text", ["tpu:", "tpu:v5p", "tpu:v5p:2x", "tpu:V5P:2x2"])
def test_a_malformed_topology_is_refused_with_what_to_give(text):
    with pytest.raises(ValueError, match="expected tpu:TOPOLOGY"):
        DeviceSpec.parse(text)
