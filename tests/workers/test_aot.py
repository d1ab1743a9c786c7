"""A user's step compiled and never run (`cmtune.workers.aot.compile_user_step`), on this host's CPU devices."""

from __future__ import annotations

from cmtune.tuner.variants import REFERENCE
from cmtune.workers.aot import COUNTED, compile_user_step, screen_problems
from collective_matmul import Tuned
from tests.steps import gspmd_mlp


def test_a_users_step_compiles_as_written_and_through_the_drop_in_each_a_record():
    """The step as written (CPU's XLA has no windowed einsum: one variant), the drop-in at the baseline and tuned:
    each compiled with its memory, its collectives counted and its overlap read; the call sites the tuned step
    traced come with them."""
    compiled = compile_user_step(gspmd_mlp.mlp_step, "tests/steps/gspmd_mlp.py:mlp_step",
                                 Tuned(unmeasured="costmodel"))
    assert compiled.platform == "cpu" and compiled.mesh == {"data": 2, "model": 4}
    assert [v.label for v in compiled.variants] == [REFERENCE, "baseline", "tuned"]
    for variant in compiled.variants:
        assert not variant.error and variant.windowed_einsum is None, variant
        assert variant.compile_s > 0 and variant.memory_bytes > 0 and set(variant.collectives) == set(COUNTED)
        assert variant.overlap.verdict == "no permutes"
        assert variant.prediction is None  # virtual CPU devices: no figures worth a prediction
    written, baseline, _ = compiled.variants
    assert baseline.collectives["reduce-scatter"] == 1 and written.collectives["reduce-scatter"] == 0
    assert len(compiled.sites.applied) == 2 and not compiled.sites.groups and compiled.device_options == {}


def test_a_variant_that_does_not_compile_is_a_record_with_the_reason():
    """A tuned step that fails to lower is its variant's error; the others compile."""

    def refused(*_):
        raise RuntimeError("no program for this one")

    client = Tuned(unmeasured="costmodel")

    def step(tuned=None):
        built = gspmd_mlp.mlp_step(tuned)
        return (refused, *built[1:]) if tuned is client else built

    compiled = compile_user_step(step, "step", client)
    written, baseline, tuned = compiled.variants
    assert not written.error and not baseline.error
    assert tuned.error == "RuntimeError: no program for this one" and tuned.compile_s is None
    assert tuned.memory_bytes is None and tuned.collectives == {} and tuned.overlap is None


def test_a_submissions_screen_is_one_per_unique_problem_with_a_ring():
    """`screen_problems`: each problem screened once, a problem no ring fits left to the service, and a ring that
    does not divide the devices named."""
    import jax
    import pytest

    from collective_matmul import Problem
    from collective_matmul.planning.space import has_ring

    devices = jax.devices()[:4]
    problem = Problem.parse("rs:256x128x64:float32:4")
    ringless = Problem.parse("ag:4x4x4:float32:1")  # a ring of one device: nothing to decompose
    assert not has_ring(ringless)
    (screened,) = screen_problems([problem, ringless, problem], devices)
    assert screened.problem == problem.key and screened.device_kind == devices[0].device_kind
    assert len(screened.screen) == 16 and {s.overlap for s in screened.screen} == {"synchronous"}
    with pytest.raises(ValueError, match="allgather_matmul:256x64x128:float32:8: a ring of 8 does not divide"):
        screen_problems([Problem.parse("ag:256x64x128:float32:8")], devices)


def test_a_compiled_steps_table_shows_a_predicted_time_labelled_with_its_cost_model():
    from rich.console import Console

    from cmtune.report import compiled_steps_table
    from cmtune.workers.aot import CompiledVariant
    from collective_matmul.programs.predict import Prediction
    from collective_matmul.programs.schedule import Overlap

    counts = dict.fromkeys(COUNTED, 1)
    predicted = Prediction(seconds=770e-6, exposed_comm_s=1e-4, comm_s=2e-4, compute_s=6e-4,
                           cost_model="cmtune-roofline/h100-nvlink", unpriced=("custom-call k (mine)",))
    variants = [CompiledVariant(label=REFERENCE, compile_s=1.0, memory_bytes=2**20, collectives=counts,
                                overlap=Overlap((), 0), prediction=predicted),
                CompiledVariant(label="tuned", error="RuntimeError: no program")]
    console = Console(width=250, record=True)
    console.print(compiled_steps_table(variants, title="t"))
    text = " ".join(console.export_text().split())
    assert "770 µs predicted, 1 unpriced" in text and "(cmtune-roofline/h100-nvlink), a prediction, not a measurement" \
        in text and "RuntimeError: no program" in text
