"""A user's own step: the spec contract, the check of a step against the step as written, and
`cmtune problems|tune|verify --step` on step files written for nothing but their spec function."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

import collective_matmul.ops.ring as ring
from cmtune.workers.overrides import save_overrides
from cmtune.workers.userstep import (
    Built,
    CompiledWith,
    SpecError,
    SpecRef,
    pair_outputs,
    step_variants,
    user_step_session,
)
from collective_matmul import Bundle, Decomposition, Hardware, OpConfigs, Tuned
from collective_matmul.planning.models import slot_problems
from collective_matmul.planning.problem import Software
from collective_matmul.wire import MeasurementProtocol, StepMeasurement
from collective_matmul.wire.bundle import RoleOverride, TunedConfig
from tests.cli import cmtune, flat, says
from tests.steps import gspmd_mlp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
D = Decomposition.from_id
RING_HW = Hardware(platform="cpu", device_kind="cpu", device_count=4, process_count=1, slice_devices=8)  # of 2x4
STEPS = ROOT / "tests" / "steps"




def test_a_spec_names_a_file_or_a_module_and_a_function():
    assert SpecRef.parse("path/to/step.py:make").is_file and not SpecRef.parse("pkg.mod:make").is_file
    assert SpecRef.parse(f"{STEPS / 'gspmd_mlp.py'}:mlp_step").load().__name__ == "mlp_step"
    assert SpecRef.parse("tests.steps.gspmd_mlp:mlp_step").load() is gspmd_mlp.mlp_step
    for text, message in [("no_colon", "not a step spec"), ("file.py:not-a-name", "not a step spec"),
                          ("/nonexistent/step.py:make", "no file"), ("no.such.module:make", "cannot import"),
                          (f"{STEPS / 'gspmd_mlp.py'}:missing", "has no function 'missing'")]:
        with pytest.raises(SpecError, match=message):
            SpecRef.parse(text).load()
    with pytest.raises(SpecError, match="raised RuntimeError: the user's code is broken here"):
        Built.of(gspmd_mlp.broken_step, None)
    with pytest.raises(SpecError, match="must return"):
        Built.of(gspmd_mlp.not_a_triple, None)


def test_outputs_pair_with_the_arguments_of_their_structure():
    params, batch = {"w": jnp.ones((2, 3))}, jnp.ones((4,))
    assert pair_outputs((params, batch), ({"w": jnp.zeros((2, 3))}, jnp.float32(0))) == {0: 0}
    assert pair_outputs((params, batch), jnp.float32(0)) == {}


def session(fn, repeats=2):
    reference = Built.of(fn, None)
    return user_step_session(fn, reference, model=fn.__name__, protocol=MeasurementProtocol(repeats=repeats, warmup=1))


def test_a_variant_that_computes_wrong_is_invalid_and_the_right_ones_are_timed(monkeypatch):
    kernel = ring._matmul_reduce_scatter

    def wrong(x, w, axis, config, **options):  # a reduce-scatter ring with chunks=2 is off by 0.1%
        out = kernel(x, w, axis, config, **options)
        return out * 1.001 if config.chunks == 2 else out

    monkeypatch.setattr(ring, "_matmul_reduce_scatter", wrong)
    tuned = Tuned()
    variants = step_variants(tuned) | {
        "wrong": tuned.variant("wrong", lambda role, c: OpConfigs(forward=D("ring-uni-c2-full-in"))
                               if role == "mlp_down" else c),
        "right": tuned.variant("right", lambda role, c: OpConfigs(forward=D("ring-uni-c1-full-in"))
                               if role == "mlp_down" else c),
    }
    result = session(gspmd_mlp.mlp_step).measure(variants)
    status = {v.name: v.status for v in result.variants}
    assert status == {"as-written": "ok", "baseline": "ok", "tuned": "ok", "wrong": "invalid", "right": "ok"}
    wrong_variant = result.variant("wrong")
    assert "off by" in wrong_variant.message and "tolerance 1e-05" in wrong_variant.message
    assert result.variant("right").configs["mlp_down"].forward == D("ring-uni-c1-full-in")
    assert all(len(v.timing.samples_s) == 2 for v in result.variants if v.ok)
    assert result.model == "mlp_step" and result.reference == "as-written" and result.block is None


@pytest.mark.slow  # an optimizer step timed in rounds (7 s)
def test_an_adam_step_that_donates_its_state_is_checked_and_fed_back():
    import flax_nnx_gpt

    result = session(flax_nnx_gpt.tiny_gpt_step, repeats=3).measure(step_variants(Tuned()))
    assert {v.name: v.status for v in result.variants} == {"as-written": "ok", "baseline": "ok", "tuned": "ok"}
    for v in result.variants:  # three timed runs each on the state its last run returned (donated)
        assert len(v.timing.samples_s) == 3 and v.loss == pytest.approx(result.variants[0].loss, rel=1e-5)


def test_the_step_as_written_is_also_timed_with_xlas_windowed_einsum_off_and_on_where_xla_has_one():
    """On TPU and GPU the step as written is a variant with XLA's windowed einsum forced off and on (compiled with
    those options); on CPU, which has none, nothing extra.  The options reach the compile: one XLA does not know
    fails that variant alone."""
    from collective_matmul.planning.xla_options import windowed_einsum

    assert list(step_variants(Tuned(), "cpu")) == ["as-written", "baseline", "tuned"]
    for platform in ("tpu", "gpu"):
        variants = step_variants(Tuned(), platform)
        assert list(variants)[:3] == ["as-written", "as-written-windowed-einsum-off", "as-written-windowed-einsum-on"]
        assert variants["as-written-windowed-einsum-on"].options == windowed_einsum(platform, "on")
    result = session(gspmd_mlp.mlp_step).measure({"as-written": None, "unknown-option": CompiledWith(
        {"xla_no_such_option_here": 1})})
    unknown = result.variant("unknown-option")
    assert result.variant("as-written").ok and unknown.status == "compile_error"
    assert "xla_no_such_option_here" in unknown.message and unknown.configs == {}


def test_verify_needs_concrete_arguments_and_the_same_parameters():
    with pytest.raises(SpecError, match="abstract arguments"):
        session(gspmd_mlp.abstract_mlp_step)

    def other_params(tuned=None):
        step, (params, x, target), mesh = gspmd_mlp.mlp_step(None)
        if tuned is not None:
            params = params | {"extra": jnp.ones(3)}
        return step, (params, x, target), mesh

    result = session(other_params).measure({"as-written": None, "tuned": Tuned()})
    assert result.variant("tuned").status == "compile_error"
    assert "arguments of another structure" in result.variant("tuned").message


def test_a_decision_replaces_the_models_overrides_in_the_bundle(tmp_path):
    path = tmp_path / "tuned.json"
    problems = slot_problems("allgather_matmul", m=128, k=64, n=128, dtype="float32", axis_size=4)
    keep = RoleOverride(model="other", role="mlp_up", hardware=RING_HW, configs=OpConfigs(), reason="other model")
    old = RoleOverride(model="mlp_step", role="mlp_down", hardware=RING_HW, configs=OpConfigs(), reason="old")
    Bundle(overrides=[keep, old]).save(path)
    new = RoleOverride(model="mlp_step", role="mlp_up", hardware=RING_HW, problems=problems, reason="new",
                       configs=OpConfigs(forward=D("ring-uni-c1-full-dus")), step_speedup=1.2)
    save_overrides(path, "mlp_step", RING_HW, [new])
    assert Bundle.load(path).overrides == [keep, new]
    with pytest.raises(ValueError, match="chunks=64 does not divide"):  # an override is checked against its problems
        RoleOverride(model="m", role="r", hardware=RING_HW, problems=problems, reason="bad",
                     configs=OpConfigs(forward=Decomposition(chunks=64)))


# ---- the commands, on step files (subprocesses: each sets its own devices up) --------------------------


def test_problems_of_a_step_and_the_errors_of_bad_specs():
    run = cmtune("problems", "--step", f"{STEPS / 'linen_mlp.py'}:linen_step", "--json", timeout=300)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert {(p["role"], p["slot"]) for p in found["problems"]} >= {("Model/layer1/up", "grad_input"),
                                                                  ("Model/layer0/down", "forward")}
    run = cmtune("problems", "--step", f"{STEPS / 'gspmd_mlp.py'}:no_collective_step", timeout=300)
    assert run.returncode == 1 and "no collective matmul" in flat(run.stdout)
    for args, message in [(["--step", "nope.py:f"], "no file nope.py"),
                          (["--step", "tests.steps.gspmd_mlp:mlp_step", "--devices", "processes:2"],
                           "give processes:PxD"),
                          (["--step", "tests.steps.gspmd_mlp:mlp_step", "--model", "tiny"], "leave out --model")]:
        run = cmtune("problems", *args, timeout=300)
        assert run.returncode != 0 and says(run, message), run.stdout + run.stderr


@pytest.mark.slow  # a step discovered and tuned in a subprocess (9 s)
def test_tune_a_step_then_the_drop_in_finds_its_configs_exactly(tmp_path):
    out = tmp_path / "tuned.json"
    run = cmtune("tune", "--step", "tests.steps.gspmd_mlp:abstract_mlp_step", "--trials", "2", "--repeats", "2",
                 "--out", str(out), timeout=600)
    assert run.returncode == 0, run.stderr
    bundle = Bundle.load(out)
    assert {c.hardware.key for c in bundle.configs} == {"cpu:cpu:4:1/8"}  # the rings of the data x model mesh
    assert len(bundle.configs) == 3  # the step's five (role, slot) problems share three keys
    tuned = Tuned(bundle=out)
    step, args, _ = gspmd_mlp.mlp_step(tuned)
    step.lower(*args)
    assert {f.match for site in tuned.report() for f in site.found.values()} == {"exact"}


@pytest.mark.slow  # a whole step search (11 s); its parts are tested on their own above
def test_verify_a_step_and_decide(tmp_path):
    bundle = Bundle()
    rings = {"allgather_matmul": D("ring-uni-c1-full-dus"), "matmul_reduce_scatter": D("ring-uni-c1-full-in"),
             "allgather_grad_weight": D("ring-uni-c1-full-in")}
    for collective, k, n in (("allgather_matmul", 64, 128), ("matmul_reduce_scatter", 128, 64)):
        for problem in slot_problems(collective, m=128, k=k, n=n, dtype="float32", axis_size=4).values():
            bundle.add(TunedConfig(problem=problem, hardware=RING_HW, decomposition=rings[problem.collective],
                                   time_s=1.0, baseline_s=1.1, speedup=1.1, software=Software.detect()))
    path, out = tmp_path / "tuned.json", tmp_path / "step.json"
    bundle.save(path)
    spec = f"{STEPS / 'gspmd_mlp.py'}:mlp_step"
    run = cmtune("verify", "--step", spec, "--bundle", str(path), "--decide", "--search-rounds", "2",
                 "--round-variants", "2", "--repeats", "3", "--warmup", "1", "--json", str(out), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    text = flat(run.stdout)
    assert "2 applied, 0 fell back" in text and "ring-uni-c1-full-in (exact)" in text
    # the step search: the seeds, one round improving the first role, then the grading in fresh rounds
    assert "the seeds (" in text and "round 2 (mlp_up, 2 changes)" in text
    assert "the step search stops: the search budget of 2 rounds" in text
    result = StepMeasurement.model_validate_json(out.read_text())
    names = [v.name for v in result.variants]
    assert names[:3] == ["as-written", "baseline", "tuned"] and "always-ring" in names
    assert {v.status for v in result.variants} == {"ok"}
    graded = [v.name for v in result.confirmation]
    assert graded[:2] == ["as-written", "baseline"] and all(v.ok for v in result.confirmation)
    # the bundle holds exactly the decision's overrides, each with its role's problems
    decided = next(line for line in run.stdout.splitlines() if line.startswith("decision:"))
    chosen = decided.removeprefix("decision: ").split(": ")[0]
    assert chosen in graded and set(graded) >= set(names)  # every fixed setting of the seeds, graded again
    saved = {o.role: o for o in Bundle.load(path).overrides if o.model == "mlp_step"}
    assert set(saved) <= {"mlp_up", "mlp_down"} and all(o.problems is not None for o in saved.values())
    assert f"wrote {len(saved)} per-role override(s) of 'mlp_step' on cpu:cpu:4:1/8" in text
    # one round: the standard menu, the per-role ablation with it (from the bundle without the decision)
    bundle.save(path)
    run = cmtune("verify", "--step", spec, "--bundle", str(path), "--decide", "--search-rounds", "1",
                 "--repeats", "2", "--warmup", "1", "--json", str(out), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    names = [v.name for v in StepMeasurement.model_validate_json(out.read_text()).variants]
    assert {"tuned-minus-mlp_up", "tuned-minus-mlp_down", "tuned-fuse-mlp_up"} <= set(names)


@pytest.mark.slow
def test_verify_the_example_on_two_processes(tmp_path):
    out = tmp_path / "step.json"
    run = cmtune("verify", "--step", "examples/flax_nnx_gpt.py:tiny_gpt_step", "--devices", "processes:2x4",
                 "--repeats", "3", "--warmup", "1", "--json", str(out), timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["hardware"]["process_count"] == 2 and result["mesh"] == {"data": 2, "model": 4}
    assert [v["name"] for v in result["variants"]] == ["as-written", "baseline", "tuned"]
    assert {v["status"] for v in result["variants"]} == {"ok"}
    assert "4 applied, 0 fell back" in flat(run.stdout)


@pytest.mark.slow
def test_problems_and_tune_a_linen_step_on_two_processes(tmp_path):
    spec = f"{STEPS / 'linen_mlp.py'}:linen_step"
    run = cmtune("problems", "--step", spec, "--devices", "processes:2x4", "--json", timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    found, _ = json.JSONDecoder().raw_decode(run.stdout[run.stdout.index("{"):])  # process 0's, among gloo's lines
    assert {p["problem"]["axis_size"] for p in found["problems"]} == {4} and found["mesh"] == {"data": 2, "model": 4}
    out = tmp_path / "tuned.json"
    run = cmtune("tune", "--step", spec, "--devices", "processes:2x4", "--trials", "2", "--repeats", "2",
                 "--out", str(out), timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    # both processes tuned every model ring at once: the configs are for a ring within one process, of 8 devices
    assert {c.hardware.key for c in Bundle.load(out).configs} == {"cpu:cpu:4:1/8"}


@pytest.mark.slow  # two verify runs of the Llama example (about 30 s)
def test_verify_times_the_step_without_its_shared_gathers_and_no_share_turns_them_off(tmp_path):
    """The Llama example's tuned step shares q/k/v's and gate/up's gathers: verify says so and times
    ``tuned-no-share`` beside it, every variant checked against the step as written; ``--no-share`` runs the
    tuned step with every call gathering for itself and times no such variant."""
    spec = f"{ROOT / 'examples' / 'flax_linen_llama.py'}:tiny_llama_step"
    runs = {}
    for flag in ("--share", "--no-share"):
        out = tmp_path / f"{flag}.json"
        run = cmtune("verify", "--step", spec, "--devices", "virtual:8", "--repeats", "2", "--warmup", "1",
                     flag, "--json", str(out), timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        runs[flag] = (flat(run.stdout), StepMeasurement.model_validate_json(out.read_text()))
    text, shared = runs["--share"]
    assert "2 gather(s) shared: layers/query gathers for layers/key, layers/value" in text
    assert [v.name for v in shared.variants] == ["as-written", "baseline", "tuned", "tuned-no-share"]
    assert {v.status for v in shared.variants} == {"ok"}
    text, unshared = runs["--no-share"]
    assert "gather(s) shared" not in text and "reuses the gather" not in text
    assert [v.name for v in unshared.variants] == ["as-written", "baseline", "tuned"]


def test_a_spec_may_bring_the_context_its_step_is_traced_under():
    """``(step, args, mesh, context)``: every lowering, trace and run of the step enters a fresh context (MaxText's
    ``jax.set_mesh`` and axis rules); a context manager object instead of a function is refused with the fix."""
    import contextlib

    import jax

    entered = []

    @contextlib.contextmanager
    def under():
        entered.append("in")
        with jax.set_mesh(mesh):  # raises inside jax.jit: the step itself could not enter it
            yield

    step, args, mesh = gspmd_mlp.mlp_step(None)
    built = Built.of(lambda tuned=None: (step, args, mesh, under), None)
    assert built.step.lower(*built.args).compile() is not None and entered == ["in"]
    built.step.trace(*built.args)
    jax.block_until_ready(built.step(*built.args))
    assert entered == ["in"] * 3
    with pytest.raises(SpecError, match="give a function of no arguments"):
        Built.of(lambda tuned=None: (step, args, mesh, mesh), None)
    with pytest.raises(SpecError, match="got 5 values"):
        Built.of(lambda tuned=None: (step, args, mesh, under, None), None)
