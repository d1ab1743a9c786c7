"""Quartiles, and what the records' validators check with them: a reported summary is the one its samples give
(the service believes only what it can check)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collective_matmul.wire.records import Measurement, StepVariant, Timing

Quartiles = tuple[float, float, float]  # (q1, median, q3)
_RELATIVE = 1e-6  # how far a reported summary may sit from the one its samples give (float rounding)


def quartiles(values: Sequence[float]) -> Quartiles:
    """(q1, median, q3), inclusive method; one value is its own quartiles."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def paired_quartiles(samples: Sequence[float], reference: Sequence[float]) -> Quartiles:
    """Quartiles of ``samples`` over ``reference``, paired one to one (by round).

    Raises:
        ValueError: if the two have different lengths.
    """
    return quartiles([t / r for t, r in zip(samples, reference, strict=True)])


def agrees(reported: float, computed: float) -> bool:
    """``reported`` is ``computed`` but for float rounding."""
    return math.isclose(reported, computed, rel_tol=_RELATIVE, abs_tol=1e-12)


def check_ratio(record: Measurement | StepVariant, timing: Timing, reference: Timing, name: str, against: str) -> None:
    """``record.ratio`` (and ``ratio_iqr``) must be what its samples give, paired one to one with the reference's.

    Raises:
        ValueError: if they are not (the service computes nothing twice: it believes only what it can check).
    """
    if len(timing.samples_s) != len(reference.samples_s):
        raise ValueError(f"{name} {len(timing.samples_s)} samples cannot be paired with {against} "
                         f"{len(reference.samples_s)}: a ratio needs one sample of each per round")
    q1, median, q3 = paired_quartiles(timing.samples_s, reference.samples_s)
    if not agrees(record.ratio, median):
        raise ValueError(f"ratio={record.ratio!r} disagrees with the samples: {name} over {against}, paired, have "
                         f"median {median!r}")
    if record.ratio_iqr is not None and not agrees(record.ratio_iqr, q3 - q1):
        raise ValueError(f"ratio_iqr={record.ratio_iqr!r} disagrees with the samples ({q3 - q1!r})")


def check_rounds(variants: list[StepVariant], reference: str, field: str) -> None:
    """One set of interleaved rounds: names unique, and every ratio the one its samples give against
    ``reference``'s, paired by round.

    Raises:
        ValueError: if not.
    """
    if not variants:
        return
    names = [v.name for v in variants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{field}: each variant is measured once; {twice} appear more than once")
    ref = next((v for v in variants if v.name == reference), None)
    if ref is None:
        raise ValueError(f"{field}: the reference variant {reference!r} is missing (measured: {names})")
    for v in variants:
        if v.ratio is None:
            continue
        if v.timing is None or ref.timing is None:
            raise ValueError(f"{field}: {v.name} has a ratio, but it or the reference {reference!r} has no timing "
                             "to compute it from")
        check_ratio(v, v.timing, ref.timing, f"{v.name}'s", f"{reference}'s")
