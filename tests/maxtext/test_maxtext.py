"""MaxText's own train step through cmtune (the `maxtext` tier: Python 3.12 and maxtext[tpu]==0.2.5, as
`make test-maxtext` installs them; elsewhere these skip saying so)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.cli import cmtune

pytestmark = [
    pytest.mark.maxtext,
    pytest.mark.skipif(importlib.util.find_spec("maxtext") is None,
                       reason="MaxText is not installed: it needs Python 3.12; `make test-maxtext` builds "
                              ".venv-maxtext with maxtext[tpu]==0.2.5 (pyenv install 3.12 where there is none)"),
]
SPEC = "examples/maxtext_step.py:tiny_maxtext_step"


def _problems(devices: str, cache: str | None = None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = cmtune("problems", "--step", SPEC, "--devices", devices, "--json", env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(run.stdout[run.stdout.index("{"):])


def test_maxtexts_step_lists_its_collective_matmuls_by_module_path_on_cpu_devices():
    """The tiny decoder (2 layers, ici_tensor_sequence_parallelism=8) under MaxText's own mesh and axis rules:
    every projection of both layers is a problem with its three slots, named by its module path."""
    found = _problems("virtual:8")
    forward = {p["role"]: p["problem"] for p in found["problems"] if p["slot"] == "forward"}
    for layer in (0, 1):
        for proj in ("self_attention/query", "self_attention/key", "self_attention/value", "self_attention/out",
                     "mlp/wi_0", "mlp/wi_1", "mlp/wo"):
            assert f"decoder/layers_{layer}/{proj}" in forward, sorted(forward)
    assert forward["decoder/layers_0/mlp/wi_0"]["collective"] == "allgather_matmul"
    assert forward["decoder/layers_0/mlp/wo"]["collective"] == "matmul_reduce_scatter"
    assert all(p["axis"] == "tensor_sequence" for p in found["problems"])
    slots = {(p["role"], p["slot"]) for p in found["problems"]}
    assert ("decoder/layers_1/mlp/wo", "grad_weight") in slots and ("decoder/layers_1/mlp/wo", "grad_input") in slots
    assert [s["role"] for s in found["skipped"]] == ["decoder/logits_dense"]  # its weight is gathered (FSDP-like)
    assert ["decoder/layers_0/mlp/wi_0", "decoder/layers_0/mlp/wi_1"] in found["groups"]
    assert not any("linears.py" in p["role"] for p in found["problems"])
