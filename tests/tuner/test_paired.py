"""The statistics of a step's interleaved rounds (`cmtune.tuner.paired`): pairing by round, the rule of three
rounds of four, and the rounds a choice is graded in."""

from __future__ import annotations

import pytest

from cmtune.tuner.paired import faster, grading_rounds, ratio_quartiles, speedup, timed
from collective_matmul import Hardware
from collective_matmul.wire import MeasurementProtocol, StepMeasurement, StepVariant, Timing, paired_quartiles

HW = Hardware(platform="cpu", device_kind="cpu", device_count=8)


def variants(samples: dict[str, list[float] | None]) -> list[StepVariant]:
    """Variants timed as ``samples`` say (None: failed), their ratios against the first's."""
    reference = next(iter(samples.values()))
    out = []
    for name, times in samples.items():
        if times is None:
            out.append(StepVariant(name=name, status="error", message="boom"))
            continue
        q1, median, q3 = paired_quartiles(times, reference)
        out.append(StepVariant(name=name, status="ok", timing=Timing.of(times), ratio=median, ratio_iqr=q3 - q1))
    return out


def step(samples: dict, fresh: dict | None = None) -> StepMeasurement:
    return StepMeasurement(model="mine", mesh={"model": 8}, tensor_axis="model", hardware=HW,
                           protocol=MeasurementProtocol(repeats=4), variants=variants(samples),
                           confirmation=variants(fresh) if fresh else [])


ROUNDS = step({"as-written": [1.0, 1.2, 1.0, 1.1], "tuned": [0.9, 1.0, 0.8, 1.0],
               "close": [0.85, 1.3, 0.7, 1.2], "broken": None})


def test_ratios_pair_up_by_round():
    assert ratio_quartiles(ROUNDS, "tuned", "as-written") == paired_quartiles([0.9, 1.0, 0.8, 1.0],
                                                                             [1.0, 1.2, 1.0, 1.1])
    assert ratio_quartiles(ROUNDS, "as-written", "as-written") == (1.0, 1.0, 1.0)
    assert ratio_quartiles(ROUNDS, "broken", "tuned") is None  # no timing to pair
    assert speedup(ROUNDS, "tuned", "as-written").median == pytest.approx(1 / ROUNDS.variant("tuned").ratio)
    with pytest.raises(KeyError):
        ratio_quartiles(ROUNDS, "missing", "tuned")


def test_faster_means_faster_in_three_rounds_of_four():
    assert faster(ROUNDS, "tuned", "as-written")[2] < 1
    assert faster(ROUNDS, "close", "tuned") is None  # faster in the median only
    assert faster(ROUNDS, "broken", "tuned") is None and faster(ROUNDS, "missing", "tuned") is None
    assert timed(ROUNDS, "tuned") and not timed(ROUNDS, "broken") and not timed(ROUNDS, "missing")


def test_a_choice_is_graded_in_fresh_rounds_where_they_timed_it():
    fresh = {"as-written": [1.0] * 4, "tuned": [0.95] * 4}
    measured = step({"as-written": [1.0] * 4, "tuned": [0.9] * 4}, fresh)
    graded = grading_rounds(measured, "tuned")
    assert [v.name for v in graded.variants] == ["as-written", "tuned"] and not graded.confirmation
    assert graded.variant("tuned").ratio == pytest.approx(0.95)
    assert grading_rounds(measured, "close") is measured  # the fresh rounds did not time it
