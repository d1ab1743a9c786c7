"""Paired-round statistics: what the step decision (`cmtune.tuner.decision`) and the step search
(`cmtune.tuner.stepsearch`) read from a `StepMeasurement`'s interleaved rounds.

Every variant of a step is timed once per round, in turn, so two variants' times pair up by round: one
variant's time over another's in each round, and the quartiles of those ratios (`ratio_quartiles`), say how
much faster it ran without the drift between rounds.  A variant is `faster` than another beyond the spread when
it ran faster in three rounds of four.  A decision is reported from the fresh rounds timed after it where
the worker ran them (`grading_rounds`).  Pure Python, no JAX.
"""

from __future__ import annotations

from collective_matmul.wire import Quartiles, Speedup, StepMeasurement, paired_quartiles


def timed(measurement: StepMeasurement, name: str) -> bool:
    """``measurement`` timed the variant ``name`` (it ran, and ran ``ok``)."""
    return any(v.name == name and v.ok for v in measurement.variants)


def ratio_quartiles(measurement: StepMeasurement, name: str, against: str) -> Quartiles | None:
    """Quartiles (q1, median, q3) of ``name``'s time over ``against``'s, paired by round; None if either has no
    timing (or they ran different numbers of rounds).

    Raises:
        KeyError: ``measurement`` has no variant of either name.
    """
    a, b = measurement.variant(name).timing, measurement.variant(against).timing
    if a is None or b is None or len(a.samples_s) != len(b.samples_s):
        return None
    return paired_quartiles(a.samples_s, b.samples_s)


def speedup(measurement: StepMeasurement, name: str, against: str) -> Speedup | None:
    """``name``'s speedup over ``against`` (`ratio_quartiles`, as a speedup); None if either has no timing."""
    return Speedup.of(ratio_quartiles(measurement, name, against))


def faster(measurement: StepMeasurement, name: str, than: str) -> Quartiles | None:
    """The quartiles of ``name``'s time over ``than``'s, paired by round, if ``name`` is faster beyond the spread
    (both ran, and the upper quartile is below 1: faster in three rounds of four); else None."""
    if not (timed(measurement, name) and timed(measurement, than)):
        return None
    quartiles = ratio_quartiles(measurement, name, than)
    return quartiles if quartiles is not None and quartiles[2] < 1 else None


def grading_rounds(measurement: StepMeasurement, chosen: str) -> StepMeasurement:
    """The rounds to report ``chosen`` from: ``measurement``'s confirmation (fresh rounds after the decision)
    where it timed both the reference and ``chosen``, as a measurement of its own; else the rounds that decided
    (``measurement`` itself)."""
    fresh = {v.name for v in measurement.confirmation if v.ok}
    if {measurement.reference, chosen} <= fresh:
        return measurement.model_copy(update={"variants": measurement.confirmation, "confirmation": []})
    return measurement
