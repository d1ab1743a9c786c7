"""MaxText's own train step through cmtune (the `maxtext` tier: Python 3.12 and maxtext[tpu]==0.2.5, as
`make test-maxtext` installs them; elsewhere these skip saying so)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from collective_matmul import Decomposition
from collective_matmul.wire import StepMeasurement
from collective_matmul.wire.bundle import Bundle
from tests.cli import cmtune, flat, says

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


FSDP_SPEC = "examples/maxtext_step.py:tiny_fsdp_maxtext_step"
DENSE = [*PROJECTIONS, "decoder/logits_dense"]


def _problems(devices: str, spec: str = SPEC) -> dict:
    run = cmtune("problems", "--step", spec, "--devices", devices, "--json", env=ENV, timeout=900)
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
    assert set(forward) == set(DENSE), sorted(forward)
    assert forward["decoder/layers_0/mlp/wi_0"]["collective"] == "allgather_matmul"
    assert forward["decoder/layers_0/mlp/wo"]["collective"] == "matmul_reduce_scatter"
    assert all(p["axis"] == "tensor_sequence" for p in found["problems"])
    slots = {(p["role"], p["slot"]) for p in found["problems"]}
    assert ("decoder/layers_1/mlp/wo", "grad_weight") in slots and ("decoder/layers_1/mlp/wo", "grad_input") in slots
    # the logits' weight (vocab over tensor_sequence) is gathered, not the activation: a weight ring of its own
    assert not found["skipped"] and forward["decoder/logits_dense"]["collective"] == "weight_allgather_matmul_n"
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
    assert len(_listed(on_tpu)[0]) == 3 * len(DENSE) + 4  # three slots each, and the groups' input gradients


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


@pytest.fixture(scope="module")
def fsdp_on_cpu() -> dict:
    """``cmtune problems --json`` of the tiny decoder under MaxText's default sharding (FSDP) on 8 CPU devices."""
    return _problems("virtual:8", FSDP_SPEC)


def test_maxtexts_default_fsdp_sharding_lists_every_dense_layers_weight_rings(fsdp_on_cpu):
    """ici_fsdp_parallelism=-1 (MaxText's default): every dense layer's weight is gathered over fsdp, so each is a
    weight-gathered problem (on K where embed is its input axis, on N where it is its output axis) with its input
    gradient and its weight gradient reduce-scattered; nothing is skipped."""
    found = fsdp_on_cpu
    forward = {p["role"]: p["problem"]["collective"] for p in found["problems"] if p["slot"] == "forward"}
    assert set(forward) == set(DENSE), sorted(forward)
    assert {r: c for r, c in forward.items() if c == "weight_allgather_matmul_n"}.keys() == {
        f"decoder/layers_{layer}/{proj}" for layer in (0, 1) for proj in ("mlp/wo", "self_attention/out")}
    by_slot = {(p["role"], p["slot"]): p["problem"]["collective"] for p in found["problems"]}
    assert all(by_slot[(role, "grad_weight")] == "reduce_scatter_grad_weight" for role in DENSE)
    assert by_slot[("decoder/layers_0/mlp/wo", "grad_input")] == "weight_allgather_matmul_k"
    assert all(p["axis"] == "fsdp" for p in found["problems"]) and not found["skipped"], found["skipped"]
    assert len(found["problems"]) == 3 * len(DENSE)


def test_maxtexts_fsdp_step_compiled_for_a_tpu_slice_lists_what_cpu_devices_list(fsdp_on_cpu):
    """The FSDP decoder's mesh on a v5p 2x2x2 slice's devices: the same weight rings as on 8 CPU devices."""
    on_tpu = _problems("tpu:v5p:2x2x2", FSDP_SPEC)
    assert on_tpu["mesh"]["fsdp"] == 8
    assert _listed(on_tpu) == _listed(fsdp_on_cpu)


def test_maxtexts_fsdp_with_tensor_parallelism_lists_every_layers_weight_ring_over_fsdp():
    """ici_fsdp_parallelism=4 with ici_tensor_parallelism=2: every weight is gathered over fsdp, each a ring of one
    tensor shard's product: the row layers (wo, out) with their K over tensor, the column layers with their N over
    it, where XLA also gathers the activation's features over tensor (its gather stays XLA's); nothing skipped."""
    found = _problems("virtual:8", "examples/maxtext_step.py:tiny_fsdp_tp_maxtext_step")
    rows = {f"decoder/layers_{layer}/{proj}" for layer in (0, 1) for proj in ("mlp/wo", "self_attention/out")}
    forward = {p["role"]: p["problem"] for p in found["problems"] if p["slot"] == "forward"}
    assert forward.keys() == set(DENSE) and all(p["axis"] == "fsdp" for p in found["problems"])
    assert {r for r, p in forward.items() if p["collective"] == "weight_allgather_matmul_n"} == rows
    assert forward["decoder/layers_0/mlp/wo"]["k"] == 512 // 2 and forward["decoder/layers_0/mlp/wo"]["axis_size"] == 4
    assert forward["decoder/layers_0/mlp/wi_0"]["n"] == 512 // 2  # mlp over tensor: one shard's columns
    assert len(found["problems"]) == 3 * len(DENSE) and not found["skipped"], found["skipped"]


# a ring for each of FSDP's collectives, so that the drop-in runs one for every tuned problem
RINGS = {"weight_allgather_matmul_k": "ring-uni-c1-u1-in", "weight_allgather_matmul_n": "ring-uni-c1-u1-dus",
         "reduce_scatter_grad_weight": "ring-uni-c1-full-in"}


def test_maxtexts_fsdp_step_tuned_then_verified_through_the_drop_in(tmp_path):
    """Tuned on 8 CPU devices under FSDP, then (each tuned problem's config set to a ring, so that every slot runs
    one whatever two trials found) verified with every DenseGeneral's weight on a ring: every variant equals the
    step as written, every dense layer is applied and its configs are the bundle's own."""
    bundle, out = tmp_path / "tuned.json", tmp_path / "step.json"
    run = cmtune("tune", "--step", FSDP_SPEC, "--devices", "virtual:8", "--trials", "2", "--repeats", "2",
                 "--out", str(bundle), env=ENV, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    tuned = Bundle.load(bundle)
    assert {c.problem.collective for c in tuned.configs} == set(RINGS)
    rings = Bundle()
    for config in tuned.configs:
        rings.add(config.model_copy(update={"decomposition": Decomposition.from_id(RINGS[config.problem.collective])}))
    rings.save(bundle)
    run = cmtune("verify", "--step", FSDP_SPEC, "--devices", "virtual:8", "--bundle", str(bundle), "--repeats", "2",
                 "--warmup", "1", "--json", str(out), env=ENV, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = StepMeasurement.model_validate_json(out.read_text())
    assert result.mesh["fsdp"] == 8
    assert {v.status for v in result.variants} == {"ok"}, [(v.name, v.message) for v in result.variants]
    text = flat(run.stdout)
    assert f"{len(DENSE)} applied, 0 fell back" in text
    assert all(says(run, f"{ring} (exact)") for ring in RINGS.values())  # the rings found for the step's problems


def test_maxtexts_fsdp_with_tensor_parallelism_through_the_drop_in_equals_the_step_as_written(tmp_path):
    """FSDP x tensor parallelism verified through the drop-in (no bundle: the cost model's configs): every dense
    layer runs as a weight ring over fsdp of one tensor shard's product, under the problem discovery lists for it
    (the column layers' input resharded before the ring, where XLA gathers it); every variant equals the step as
    written."""
    out = tmp_path / "step.json"
    run = cmtune("verify", "--step", "examples/maxtext_step.py:tiny_fsdp_tp_maxtext_step", "--devices", "virtual:8",
                 "--repeats", "2", "--warmup", "1", "--json", str(out), env=ENV, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = StepMeasurement.model_validate_json(out.read_text())
    assert (result.mesh["fsdp"], result.mesh["tensor"]) == (4, 2)
    assert {v.status for v in result.variants} == {"ok"}, [(v.name, v.message) for v in result.variants]
    assert f"{len(DENSE)} applied, 0 fell back" in flat(run.stdout)
    # looked up under the keys discovery lists (wi_0's and wo's of the listing test)
    assert says(run, "weight_allgather_matmul_k:1024x256x256:float32:4")
    assert says(run, "weight_allgather_matmul_n:1024x256x256:float32:4")


def test_the_drop_in_hook_says_when_maxtext_moved_it(monkeypatch):
    """`dense_layers` replaces ``linears._compute_dot_general_nnx``: a MaxText without it is told, not silently
    left as written."""
    from maxtext.layers import linears

    from collective_matmul.client import maxtext as cm_maxtext

    monkeypatch.delattr(linears, "_compute_dot_general_nnx")
    with pytest.raises(RuntimeError, match="no maxtext.layers.linears._compute_dot_general_nnx"):
        with cm_maxtext.dense_layers(object()):
            pass
