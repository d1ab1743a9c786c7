"""examples/fsdp_step.py: a plain-JAX FSDP step's collective matmuls are found, tuned and run through `Tuned`.

Discovery lists each weight's forward, input-gradient and weight-gradient problems (the weight gathered, and
its gradient reduce-scattered, which XLA's CPU backend writes as an all-reduce and slices); the step through
the drop-in, every product a ring, computes the loss and the updated weights of the step as written; `cmtune
tune --step` and `verify --step` run it.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from collective_matmul import Bundle, Decomposition, Tuned
from collective_matmul.planning.models import ring_hardware, slot_problems
from collective_matmul.planning.problem import Software
from collective_matmul.programs.discovery import discover
from collective_matmul.wire.bundle import TunedConfig
from examples import fsdp_step
from tests.cli import cmtune, flat, says

D = Decomposition.from_id
RINGS = {  # a ring for every product (accumulate as each collective's ring takes it)
    "weight_allgather_matmul_k": D("ring-bi-c2-full-in"),
    "weight_allgather_matmul_n": D("ring-uni-c1-u1-dus"),
    "reduce_scatter_grad_weight": D("ring-uni-c2-full-in"),
}


def found(spec) -> set[tuple[str, str, str]]:
    step, args, mesh = spec()
    return {(p.role, p.slot, p.problem.key) for p in discover(step, args, mesh).problems}


def test_discovery_lists_each_weights_three_products():
    assert found(fsdp_step.tiny_fsdp_step) == {
        ("mlp_up", "forward", "weight_allgather_matmul_k:256x128x256:float32:8"),
        ("mlp_up", "grad_weight", "reduce_scatter_grad_weight:256x128x256:float32:8"),  # x is no parameter: no dx
        ("mlp_down", "forward", "weight_allgather_matmul_k:256x256x128:float32:8"),
        ("mlp_down", "grad_input", "weight_allgather_matmul_n:256x128x256:float32:8"),
        ("mlp_down", "grad_weight", "reduce_scatter_grad_weight:256x256x128:float32:8"),
    }
    # FSDP x tensor parallelism: each ring over fsdp, of one model shard's product
    assert found(fsdp_step.fsdp_tp_step) == {
        ("mlp_up", "forward", "weight_allgather_matmul_k:256x128x128:float32:4"),
        ("mlp_up", "grad_weight", "reduce_scatter_grad_weight:256x128x128:float32:4"),
        ("mlp_down", "forward", "weight_allgather_matmul_n:256x128x128:float32:4"),
        ("mlp_down", "grad_input", "weight_allgather_matmul_k:256x128x128:float32:4"),
        ("mlp_down", "grad_weight", "reduce_scatter_grad_weight:256x128x128:float32:4"),
    }


def ring_bundle(spec, keep: bool = False, processes: int = 1) -> Bundle:
    """Every problem of the step's products on its rings' hardware (a ring over ``processes`` processes), a ring;
    ``keep``: the weight kept for dx."""
    step, args, mesh = spec()
    bundle = Bundle()
    hardware = ring_hardware(mesh, "fsdp").model_copy(update={"process_count": processes})
    for problem in discover(step, args, mesh).problems:
        if problem.slot != "forward":  # a forward's three slots are added with it
            continue
        for slot_problem in slot_problems(problem.problem.collective, m=problem.problem.m, k=problem.problem.k,
                                          n=problem.problem.n, dtype="float32",
                                          axis_size=problem.problem.axis_size).values():
            ring = RINGS[slot_problem.collective]
            ring = ring.model_copy(update={"fuse": keep}) if slot_problem.collective.startswith("reduce") else ring
            bundle.add(TunedConfig(problem=slot_problem, hardware=hardware, decomposition=ring, time_s=1.0,
                                   baseline_s=1.1, speedup=1.1, software=Software.detect()))
    return bundle


@pytest.mark.parametrize("spec, keep", [(fsdp_step.tiny_fsdp_step, False), (fsdp_step.tiny_fsdp_step, True),
                                        (fsdp_step.fsdp_tp_step, False)])
def test_the_step_through_the_drop_in_equals_the_step_as_written(spec, keep, tmp_path):
    path = tmp_path / "rings.json"
    ring_bundle(spec, keep).save(path)
    tuned = Tuned(bundle=path)
    written, args, _ = spec()
    through, _, _ = spec(tuned)
    (want_params, want_loss), (got_params, got_loss) = written(*args), through(*args)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for name in want_params:
        np.testing.assert_allclose(np.asarray(got_params[name]), np.asarray(want_params[name]), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    configs = {site.role: site.configs for site in tuned.report()}
    assert set(configs) == {"mlp_up", "mlp_down"} and all(c.forward.method == "ring" for c in configs.values())
    assert all(c.grad_weight.fuse == keep for c in configs.values())
    text = jax.jit(lambda *a: through(*a)).lower(*args).compile().as_text()
    assert "collective-permute" in text


def test_tune_and_verify_the_step(tmp_path):
    out, measured = tmp_path / "tuned.json", tmp_path / "step.json"
    spec = "examples/fsdp_step.py:tiny_fsdp_step"
    run = cmtune("tune", "--step", spec, "--devices", "virtual:8", "--trials", "2", "--repeats", "2", "--out",
                 str(out), timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert {c.problem.collective for c in Bundle.load(out).configs} == set(RINGS)
    ring_bundle(fsdp_step.tiny_fsdp_step).save(out)  # rings everywhere, so the drop-in runs them
    run = cmtune("verify", "--step", spec, "--devices", "virtual:8", "--bundle", str(out), "--repeats", "2",
                 "--warmup", "1", "--json", str(measured), timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 applied, 0 fell back" in flat(run.stdout)
    result = json.loads(measured.read_text())
    assert {v["status"] for v in result["variants"]} == {"ok"}  # equal to the step as written, then timed
    assert [v["name"] for v in result["variants"]][:3] == ["as-written", "baseline", "tuned"]


@pytest.mark.slow  # a step search of the FSDP step on two processes (about a minute)
def test_the_step_search_on_two_processes_decides_among_the_weight_rings(tmp_path):
    """`verify --step --decide` of the FSDP step on two processes of four devices (a ring of 8 spans both, over
    gloo): every variant equals the step as written, the search's rounds change an FSDP role's configs, and the
    decision is written (overrides, for the roles' own problems, only where it changed a role)."""
    path, out = tmp_path / "rings.json", tmp_path / "step.json"
    ring_bundle(fsdp_step.tiny_fsdp_step, processes=2).save(path)  # the rings of the two processes' hardware
    run = cmtune("verify", "--step", "examples/fsdp_step.py:tiny_fsdp_step", "--devices", "processes:2x4",
                 "--bundle", str(path), "--decide", "--search-rounds", "2", "--round-variants", "2", "--repeats",
                 "2", "--warmup", "1", "--json", str(out), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = flat(run.stdout)
    assert "2 applied, 0 fell back" in text and "round 2 (mlp_" in text
    assert says(run, "r2-mlp_")  # round 2's variants change an FSDP role's configs (named after it)
    assert says(run, "ring-bi-c2-full-in (exact)")  # the rings found for the two processes' ring, not the baseline
    result = json.loads(out.read_text())
    assert result["hardware"]["process_count"] == 2
    assert {v["status"] for v in result["variants"]} == {"ok"}, [(v["name"], v["message"]) for v in result["variants"]]
    assert len(result["variants"]) > 3  # the seeds and the search's changes beside as-written, baseline, tuned
    saved = [o for o in Bundle.load(path).overrides if o.model == "tiny_fsdp_step"]
    # decided, then written: as many overrides as it says (none where the tuned configs won)
    assert "decision: " in text and says(run, f"wrote {len(saved)} per-role override(s) of 'tiny_fsdp_step'")
    assert all(o.role in {"mlp_up", "mlp_down"} and o.problems is not None for o in saved)
