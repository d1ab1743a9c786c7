"""The step decision (`cmtune.tuner.decision`) on synthetic measurements of the standard menu: the replacement
rule, the overrides and reasons it makes, and the rounds it reports from.  No devices are touched (the search's
decision is tests/tuner/test_stepsearch.py's)."""

from __future__ import annotations

import pytest

from cmtune.tuner.decision import SEEDS, replacement, step_decision
from cmtune.tuner.paired import grading_rounds
from cmtune.tuner.variants import ALWAYS_RING, BASELINE, COSTMODEL, RING_FILL, TUNED, variant_configs
from collective_matmul import Decomposition, Hardware, OpConfigs
from collective_matmul.planning.models import TransformerBlock
from collective_matmul.wire import MeasurementProtocol, StepMeasurement, StepVariant, Timing, quartiles

D = Decomposition.from_id
BLOCK = TransformerBlock(name="small", d_model=64, d_ff=128, heads=8, head_dim=8, gated_mlp=True, seq_len=64,
                         global_batch=2, dtype="float32")
TUNED_CONFIGS = {
    "attn_out": OpConfigs(forward=D("ring-uni-c1-full-in")),
    "mlp_down": OpConfigs(forward=D("ring-bi-c1-full-in"), grad_input=D("ring-uni-c2-full-dus"),
                          grad_weight=D("ring-uni-c1-full-in-fuse")),
    "mlp_up": OpConfigs(),  # tuned to the baseline: no ablation variant
}


def synthetic_step(samples: dict[str, list[float]]) -> StepMeasurement:
    """A step measurement with these samples per variant (configs as the worker would record them)."""
    configs = variant_configs(TUNED_CONFIGS)
    reference = samples["as-written"]
    variants = []
    for name, times in samples.items():
        q1, median, q3 = quartiles([t / r for t, r in zip(times, reference, strict=True)])
        variants.append(StepVariant(name=name, status="ok", configs=configs[name] or {}, timing=Timing.of(times),
                                    ratio=median, ratio_iqr=q3 - q1))
    return StepMeasurement(block=BLOCK, mesh={"model": 8}, tensor_axis="model",
                           hardware=Hardware(platform="cpu", device_kind="cpu", device_count=8),
                           protocol=MeasurementProtocol(repeats=4), variants=variants)


def test_the_seeds_are_the_fixed_settings_in_the_order_the_first_round_times_them():
    assert SEEDS == (BASELINE, TUNED, COSTMODEL, RING_FILL, ALWAYS_RING)
    assert SEEDS == ("baseline", "tuned", "costmodel", "tuned-ring-fill", "always-ring")  # the names stored


def test_the_replacement_rule_takes_the_fastest_of_those_faster_beyond_the_spread():
    step = synthetic_step({"as-written": [1.0, 1.0, 1.0, 1.0], "tuned": [0.8, 0.82, 0.79, 0.81],
                           "tuned-ring-fill": [0.7, 0.71, 0.69, 0.72], "always-ring": [0.75, 0.74, 0.76, 0.75],
                           "baseline": [0.8, 0.7, 0.9, 0.8]})  # faster in the median only
    found = replacement(step, "tuned", ["baseline", "always-ring", "tuned-ring-fill"])
    assert found is not None and found.variant == "tuned-ring-fill" and found.paired[2] < 1
    assert replacement(step, "tuned", ["baseline"]) is None
    assert replacement(step, "tuned-ring-fill", ["tuned", "always-ring"]) is None  # nothing beats the fastest


def test_the_step_decision_takes_a_whole_step_alternative_only_beyond_the_spread():
    tuned = variant_configs(TUNED_CONFIGS)["tuned"]
    wins = synthetic_step({"as-written": [1.0, 1.0, 1.0, 1.0], "baseline": [0.95, 0.96, 0.94, 0.95],
                           "tuned": [0.8, 0.82, 0.79, 0.81], "tuned-ring-fill": [0.7, 0.71, 0.69, 0.72],
                           "always-ring": [0.75, 0.74, 0.76, 0.75]})
    decision = step_decision(wins, tuned)
    assert decision.ok and decision.variant == "tuned-ring-fill"
    fill = variant_configs(TUNED_CONFIGS)["tuned-ring-fill"]
    # the overrides are exactly the roles the fill changed, with what they run now
    assert decision.overrides == {role: fill[role] for role in ("qkv", "attn_out", "mlp_up")}
    assert "ring-uni-c1-full-auto" in decision.reasons["qkv"] and "tuned-ring-fill ran the step" in \
        decision.reasons["qkv"]
    assert "against the step as written" in decision.summary and "overrides: attn_out, mlp_up, qkv" in decision.summary
    # faster in the median but not in three rounds of four: the tuned configs stay
    noisy = synthetic_step({"as-written": [1.0, 1.0, 1.0, 1.0], "tuned": [0.8, 0.8, 0.8, 0.8],
                            "tuned-ring-fill": [0.7, 0.95, 0.75, 0.9], "always-ring": [0.9, 0.9, 0.9, 0.9]})
    kept = step_decision(noisy, tuned)
    assert kept.variant == "tuned" and kept.overrides == {}


def test_the_step_decision_reports_from_the_fresh_rounds():
    tuned = variant_configs(TUNED_CONFIGS)["tuned"]
    deciding = synthetic_step({"as-written": [1.0, 1.0, 1.0, 1.0], "baseline": [0.95, 0.96, 0.94, 0.95],
                               "tuned": [0.8, 0.82, 0.79, 0.81], "tuned-ring-fill": [0.7, 0.71, 0.69, 0.72]})
    fresh = synthetic_step({"as-written": [1.0, 1.0, 1.0, 1.0], "baseline": [0.95, 0.95, 0.95, 0.95],
                            "tuned-ring-fill": [0.76, 0.74, 0.75, 0.75]})
    measured = deciding.model_copy(update={"confirmation": fresh.variants})
    decision = step_decision(measured, tuned)
    # the choice comes from the deciding rounds, the numbers from the fresh ones
    assert decision.variant == "tuned-ring-fill" and decision.ratio == pytest.approx(0.75)
    assert "1.33x" in decision.summary and "(fresh rounds after the decision)" in decision.summary
    assert grading_rounds(measured, "tuned-ring-fill").variants == fresh.variants
    assert grading_rounds(measured, "tuned") is measured  # not timed again
    # a confirmation without the reference is not a grade: the deciding rounds are reported, and said to be
    partial = deciding.model_copy(update={"confirmation": fresh.variants[1:]})
    assert grading_rounds(partial, "tuned-ring-fill") is partial
    assert step_decision(partial, tuned).ratio == pytest.approx(0.705)
    assert "(the rounds that decided)" in step_decision(partial, tuned).summary


def test_a_step_that_was_not_measured_decides_nothing():
    tuned = variant_configs(TUNED_CONFIGS)["tuned"]
    missing = synthetic_step({"as-written": [1.0, 1.0, 1.0, 1.0], "baseline": [0.95, 0.96, 0.94, 0.95]})
    decision = step_decision(missing, tuned)
    assert not decision.ok and decision.variant == "tuned" and "incomplete" in decision.summary
