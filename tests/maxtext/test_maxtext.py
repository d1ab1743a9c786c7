"""MaxText's own train step through cmtune (the `maxtext` tier: Python 3.12 and maxtext[tpu]==0.2.5, as
`make test-maxtext` installs them; elsewhere these skip saying so)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from collective_matmul.wire import StepMeasurement
from collective_matmul.wire.bundle import Bundle
from tests.cli import cmtune, flat

pytestmark = [
    pytest.mark.maxtext,
    pytest.mark.skipif(importlib.util.find_spec("maxtext") is None,
                       reason="MaxText is not installed: it needs Python 3.12; `make test-maxtext` builds "
                              ".venv-maxtext with maxtext[tpu]==0.2.5 (pyenv install 3.12 where there is none)"),
]
SPEC = "examples/maxtext_step.py:tiny_maxtext_step"
PROJECTIONS = [f"decoder/layers_{layer}/{proj}" for layer in (0, 1)
               for proj in ("self_attention/query", "self_attention/key", "self_attention/value", "self_attention/out",
                            "mlp/wi_0", "mlp/wi_1", "mlp/wo")]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _problems(devices: str) -> dict:
    run = cmtune("problems", "--step", SPEC, "--devices", devices, "--json", env=ENV, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(run.stdout[run.stdout.index("{"):])


@pytest.fixture(scope="module")
def on_cpu() -> dict:
    """``cmtune problems --json`` of the tiny decoder on 8 CPU devices."""
    return _problems("virtual:8")


def test_maxtexts_step_lists_its_collective_matmuls_by_module_path_on_cpu_devices(on_cpu):
    """The tiny decoder (2 layers, ici_tensor_sequence_parallelism=8) under MaxText's own mesh and axis rules:
    every projection of both layers is a problem with its three slots, named by its module path."""
    found = on_cpu
    forward = {p["role"]: p["problem"] for p in found["problems"] if p["slot"] == "forward"}
    assert set(forward) == set(PROJECTIONS), sorted(forward)
    assert forward["decoder/layers_0/mlp/wi_0"]["collective"] == "allgather_matmul"
    assert forward["decoder/layers_0/mlp/wo"]["collective"] == "matmul_reduce_scatter"
    assert all(p["axis"] == "tensor_sequence" for p in found["problems"])
    slots = {(p["role"], p["slot"]) for p in found["problems"]}
    assert ("decoder/layers_1/mlp/wo", "grad_weight") in slots and ("decoder/layers_1/mlp/wo", "grad_input") in slots
    assert [s["role"] for s in found["skipped"]] == ["decoder/logits_dense"]  # its weight is gathered (FSDP-like)
    assert ["decoder/layers_0/mlp/wi_0", "decoder/layers_0/mlp/wi_1"] in found["groups"]
    assert not any("linears.py" in p["role"] for p in found["problems"])


def _listed(found: dict) -> tuple[set, list, list]:
    problems = {(p["role"], p["slot"], p["problem"]["collective"], p["problem"]["m"], p["problem"]["k"],
                 p["problem"]["n"], p["axis"]) for p in found["problems"]}
    return problems, sorted((s["role"], s["reason"]) for s in found["skipped"]), sorted(map(sorted, found["groups"]))


def test_maxtexts_step_compiled_for_a_tpu_slice_lists_what_cpu_devices_list(on_cpu):
    """The same spec, its mesh built on a v5e 2x4 slice's devices (abstract arguments, XLA's TPU compiler): the same
    problems, skips and groups as on 8 CPU devices."""
    on_tpu = _problems("tpu:v5e:2x4")
    assert on_tpu["mesh"]["tensor_sequence"] == 8
    assert _listed(on_tpu) == _listed(on_cpu)
    assert len(_listed(on_tpu)[0]) == 3 * len(PROJECTIONS) + 4  # three slots each, and the groups' input gradients


def test_a_tiny_maxtext_model_tuned_then_verified_through_the_drop_in(tmp_path):
    """Tuned on 8 CPU devices, then MaxText's step verified with every DenseGeneral through cmtune's drop-in: every
    variant's loss and updated state equal the step as written, and the report lists every dense layer."""
    bundle, out = tmp_path / "tuned.json", tmp_path / "step.json"
    run = cmtune("tune", "--step", SPEC, "--devices", "virtual:8", "--trials", "2", "--repeats", "2",
                 "--out", str(bundle), env=ENV, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert {c.hardware.key for c in Bundle.load(bundle).configs} == {"cpu:cpu:8:1"}
    run = cmtune("verify", "--step", SPEC, "--devices", "virtual:8", "--bundle", str(bundle), "--repeats", "2",
                 "--warmup", "1", "--json", str(out), env=ENV, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = StepMeasurement.model_validate_json(out.read_text())
    assert result.mesh["tensor_sequence"] == 8 and len(result.mesh) == 12  # MaxText's own mesh, every axis
    assert [v.name for v in result.variants][:3] == ["as-written", "baseline", "tuned"]
    assert {v.status for v in result.variants} == {"ok"}, [(v.name, v.message) for v in result.variants]
    text = flat(run.stdout)
    assert "19 applied, 0 fell back" in text  # 14 projections, the logits and the 4 groups' input gradients
    for role in (*PROJECTIONS, "decoder/logits_dense"):
        assert role in text, role
    assert "(exact)" in text  # the tuned configs were found for the step's own problems


def test_the_drop_in_hook_says_when_maxtext_moved_it(monkeypatch):
    """`dense_layers` replaces ``linears._compute_dot_general_nnx``: a MaxText without it is told, not silently
    left as written."""
    from maxtext.layers import linears

    from collective_matmul.client import maxtext as cm_maxtext

    monkeypatch.delattr(linears, "_compute_dot_general_nnx")
    with pytest.raises(RuntimeError, match="no maxtext.layers.linears._compute_dot_general_nnx"):
        with cm_maxtext.dense_layers(object()):
            pass
