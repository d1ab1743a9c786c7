"""Bounds of a collective matmul: how far a tuned config is from the limit, and why no ring won.

A problem's **bounds** are three medians timed together, round by round, on the same devices
(`cmtune.workers.measure.OpSession.bounds`): ``compute`` (each device's local product alone, no
collective), ``communication`` (the collective alone: the same bytes, no matmul) and the baseline
op.  The **bound** is ``max(compute, communication)``: the best any overlap of the two can do.

The **hidden fraction** is ``(baseline − tuned) / (baseline − bound)``: the share of the time
overlap could save that the tuned config saved.  The tuned and baseline times of a `TunedConfig`
come from the confirmation round, the bounds from their own rounds with their own baseline, and a
machine drifts between the two, so the fraction is computed from ratios, each within its own
rounds::

    bound fraction = bound / baseline of the bounds rounds
    tuned ratio    = tuned / baseline of the confirmation round
    hidden         = (1 − tuned ratio) / (1 − bound fraction)

which equals the formula above when the two baselines agree.  The rules (nothing is clamped):

- no bounds measured: no fraction (None);
- nothing to hide (the collective alone under `NOTHING_TO_HIDE` of the baseline, or the baseline
  within `AT_BOUND` of the bound): no fraction (None);
- the baseline won: 0 (it hides nothing more than the baseline does: the rings were no faster);
- a ring won: the raw value, below 0 if it is slower than the baseline's median, above 1 if it
  beat the measured bound.

`reason` says in plain words why no ring won, one case each; `verdict` says it for any tuned
config (a winning ring: how much it hid, and how far it is from the bound).  `step_bound` sums
the bounds of a step's collective matmuls against the measured step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from collective_matmul.planning.models import MAX_ROLES
from collective_matmul.planning.text import as_message, message
from collective_matmul.wire.fields import ProblemKey

if TYPE_CHECKING:
    from collective_matmul.wire.bundle import TunedConfig

# the compiled schedule's verdict on a ring's permutes (collective_matmul.programs.schedule): each hides behind a
# product, some do, none do (serialised), XLA made them synchronous, or the program has none (the baseline)
OverlapVerdict = Literal["overlaps", "partly", "serialised", "synchronous", "no permutes"]

NOTHING_TO_HIDE = 0.05  # the collective alone under this share of the baseline: nothing to hide
AT_BOUND = 0.05  # the baseline within this share of itself above the bound: it sits at the bound
NO_OVERLAP = 0.10  # the baseline within this share of compute + communication: nothing in it overlaps
AGREE = 0.10  # an estimated and a measured saving this close (relative) agree
MAX_TERMS = 3 * MAX_ROLES  # a step's collective matmuls: three slots per role at most
Summary = message(2000)  # as the step decision's summary


def ms(seconds: float) -> str:
    """Seconds as milliseconds, for the sentences (three significant digits)."""
    value = seconds * 1e3
    return f"{value:.3g} ms" if abs(value) < 1000 else f"{value:.0f} ms"


@dataclass(frozen=True)
class Bounds:
    """The three medians of one problem's bounds rounds (seconds, each > 0)."""

    compute_s: float
    communication_s: float
    baseline_s: float  # the baseline timed in the same rounds

    def __post_init__(self):
        for name in ("compute_s", "communication_s", "baseline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"bounds: {name} must be above 0, got {getattr(self, name)!r}")

    @property
    def bound_s(self) -> float:
        """``max(compute, communication)``: the best overlap of the two can do."""
        return max(self.compute_s, self.communication_s)

    @property
    def sum_s(self) -> float:
        """``compute + communication``: the time with no overlap at all."""
        return self.compute_s + self.communication_s

    @property
    def bound_fraction(self) -> float:
        """The bound over the baseline of the same rounds."""
        return self.bound_s / self.baseline_s

    @property
    def hideable_fraction(self) -> float:
        """``1 − bound fraction``: the share of the baseline overlap could save (below 0: the baseline
        beat the bound measured)."""
        return 1.0 - self.bound_fraction

    @property
    def communication_fraction(self) -> float:
        return self.communication_s / self.baseline_s

    @property
    def nothing_to_hide(self) -> bool:
        """The collective is a few percent of the baseline, or the baseline already sits at the bound."""
        return self.communication_fraction < NOTHING_TO_HIDE or self.hideable_fraction < AT_BOUND

    @property
    def communication_bound(self) -> bool:
        """The collective alone takes at least as long as the matmul alone."""
        return self.communication_s >= self.compute_s


def hidden_fraction(bounds: Bounds | None, tuned_ratio: float, *, ring: bool) -> float | None:
    """The share of the hideable time a tuned config hid (the module's rules).

    Args:
        bounds: the problem's bounds (None: not measured).
        tuned_ratio: the tuned time over the baseline's, in the same round (1 for a baseline winner).
        ring: whether the tuned config is a ring (False: the baseline won).

    Returns:
        None where there is nothing to hide or no bounds; 0 for a baseline winner; else the raw value.
    """
    if bounds is None or bounds.nothing_to_hide:
        return None
    if not ring:
        return 0.0
    return (1.0 - tuned_ratio) / bounds.hideable_fraction


def times_bound(bounds: Bounds, tuned_ratio: float) -> float:
    """The tuned time over the bound (1: overlap-perfect), each against its own round's baseline."""
    return tuned_ratio / bounds.bound_fraction


def reason(bounds: Bounds | None, *, best_ring_ratio: float | None = None) -> str:
    """Why no ring beat the baseline, in plain words from the bounds (one case each, first that holds).

    1. no bounds measured;
    2. nothing to hide: the collective alone is a few percent of the baseline;
    3. the baseline already sits at the bound (the runtime overlaps already, or the smaller of
       the two is too small to matter), or ran faster than the bound measured beside it;
    4. communication-bound: the collective alone takes at least as long as the matmul alone, so
       at best a ring hides the matmul and the link time stays;
    5. the ring's steps cost more than the transfer they hide.

    Args:
        bounds: the problem's bounds (None: not measured).
        best_ring_ratio: the best ring's time over the baseline's in the confirmation round, where known.
    """
    ring = "" if best_ring_ratio is None else f"; the best ring ran at {1 / best_ring_ratio:.2f}x the baseline's speed"
    if bounds is None:
        return ("no bounds were measured (a confirmation round times them, and none did here, or they failed): it "
                "is not known whether anything was left to hide" + ring)
    b = bounds
    if b.communication_fraction < NOTHING_TO_HIDE:
        return (f"nothing to hide: the collective alone takes {ms(b.communication_s)}, "
                f"{b.communication_fraction:.0%} of the baseline's {ms(b.baseline_s)}" + ring)
    if b.hideable_fraction < -AT_BOUND:
        return (f"the baseline ({ms(b.baseline_s)}) ran faster than the bound measured beside it ({ms(b.bound_s)}): "
                "the programs alone ran slower than inside the op (or the rounds were noisy), so nothing is known "
                "to be left to hide" + ring)
    if b.hideable_fraction < AT_BOUND:
        smaller = min(b.compute_s, b.communication_s)
        if smaller / b.baseline_s < NOTHING_TO_HIDE:
            what = "the matmul" if b.compute_s < b.communication_s else "the collective"
            return (f"the baseline ({ms(b.baseline_s)}) already sits at the bound ({ms(b.bound_s)}): {what} alone "
                    f"takes only {ms(smaller)}, so compute + communication is about their max" + ring)
        return (f"the baseline ({ms(b.baseline_s)}) already sits at the bound max(compute {ms(b.compute_s)}, "
                f"communication {ms(b.communication_s)}) = {ms(b.bound_s)}: the runtime already overlaps the "
                f"collective with the matmul (their sum is {ms(b.sum_s)})" + ring)
    if b.communication_bound:
        return (f"communication-bound: the collective alone ({ms(b.communication_s)}) takes at least as long as the "
                f"matmul alone ({ms(b.compute_s)}); at best a ring hides the matmul behind the transfer and the link "
                f"time stays, against a baseline of {ms(b.baseline_s)}" + ring)
    if abs(b.baseline_s - b.sum_s) <= NO_OVERLAP * b.baseline_s:
        baseline = (f"the baseline ({ms(b.baseline_s)}) is about compute + communication ({ms(b.sum_s)}): nothing in "
                    "it overlaps")
    else:
        baseline = (f"the baseline ({ms(b.baseline_s)}) against compute + communication ({ms(b.sum_s)}) and the "
                    f"bound ({ms(b.bound_s)})")
    return (f"the ring's steps cost more than the transfer they hide: {baseline}, so "
            f"{ms(b.baseline_s - b.bound_s)} ({b.hideable_fraction:.0%}) could be hidden, but no ring was faster"
            + ring)


def verdict(bounds: Bounds | None, tuned_ratio: float, *, ring: bool, best_ring_ratio: float | None = None) -> str:
    """One sentence for a tuned config: `reason` for a baseline winner; for a winning ring, how much of the
    hideable time it hid and how far it is from the bound."""
    if not ring:
        return reason(bounds, best_ring_ratio=best_ring_ratio)
    speed = f"{1 / tuned_ratio:.2f}x the baseline's speed"
    if bounds is None:
        return f"{speed}; no bounds were measured"
    fraction = hidden_fraction(bounds, tuned_ratio, ring=True)
    if fraction is None:
        return (f"{speed}, though there was little to hide ({reason(bounds)}); {times_bound(bounds, tuned_ratio):.2f}x "
                "the bound")
    if times_bound(bounds, tuned_ratio) < 1:  # faster than the bound: the bound was no floor for this ring
        return (f"{speed}, {times_bound(bounds, tuned_ratio):.2f}x the bound: faster than the matmul or the collective "
                "alone, so its permutes moved the bytes faster than the baseline's collective does (the bound "
                "times that collective, not the fastest transfer); hidden fraction " + f"{fraction:.0%}")
    return f"hides {fraction:.0%} of the hideable time; {times_bound(bounds, tuned_ratio):.2f}x the bound ({speed})"


# --- the step's own bound ---------------------------------------------------------------------


class StepBoundTerm(BaseModel):
    """One collective matmul of a step: how often it runs, and what it saves and could save per run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    problem_key: ProblemKey
    count: int = Field(ge=1, le=1 << 30, description="runs per step")
    baseline_s: float = Field(description="the baseline's median in the confirmation round")
    time_s: float = Field(description="the tuned config's median in the same round")
    bound_s: float | None = Field(
        description="the bound, scaled to the confirmation round's baseline (bound fraction × baseline_s); None: "
                    "no bounds measured")
    saved_s: float = Field(description="count × (baseline − tuned)")
    hideable_s: float | None = Field(
        description="count × (baseline − bound), 0 where the baseline sits at or under the bound (overlap saves "
                    "nothing there); None: no bounds measured")


class StepBound(BaseModel):
    """A step's collective matmuls against the measured step: how far the step is from overlap-perfect.

    Built by `step_bound`; every time is seconds per step (or per layer, as the measured step is).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    terms: list[StepBoundTerm] = Field(max_length=MAX_TERMS)
    estimated_saved_s: float = Field(description="Σ count × (baseline − tuned): the op-level estimate of the saving")
    hideable_s: float | None = Field(description="Σ count × (baseline − bound): the most overlap could save (None: "
                                                 "some op has no bounds)")
    measured_baseline_s: float = Field(description="the all-baseline step, measured (median)")
    measured_tuned_s: float = Field(description="the tuned step, measured (median)")
    measured_saved_s: float = Field(description="measured baseline step − measured tuned step")
    overlap_perfect_s: float | None = Field(description="measured baseline step − hideable_s: the step with every "
                                                        "collective matmul at its bound")
    reached: float | None = Field(description="measured_saved_s / hideable_s: the share of the most overlap could "
                                              "save that the step saved")
    unbounded: list[ProblemKey] = Field(default_factory=list, max_length=MAX_TERMS,
                                        description="the problems without bounds")
    summary: Summary = Field(description="the step against its bound, and the estimate-versus-measured gap, in "
                                         "words")


def step_bound(entries: Iterable[tuple[int, TunedConfig]], measured_baseline_s: float,
               measured_tuned_s: float) -> StepBound:
    """The step's own bound: each collective matmul's bound summed over the step, against the measured step.

    Each op's hideable time is ``baseline_s × (1 − bound fraction)``: the bounds rounds' share, scaled to
    the confirmation round's baseline (the drift-robust form of ``baseline − bound``), and 0 where the
    baseline sat at or under its bound.

    Args:
        entries: per collective matmul of the step, ``(runs per step, its tuned config)``.
        measured_baseline_s: the all-baseline step's median (the same step, every op at the baseline).
        measured_tuned_s: the tuned step's median, in the same rounds.

    Returns:
        the sums, the measured saving, the overlap-perfect step and a sentence explaining the gap.

    Raises:
        ValueError: for a count below 1 or a measured time that is not above 0.
    """
    if not (measured_baseline_s > 0 and measured_tuned_s > 0):
        raise ValueError(f"step_bound: measured times must be above 0, got {measured_baseline_s!r} and "
                         f"{measured_tuned_s!r}")
    terms = []
    for count, config in entries:
        if count < 1:
            raise ValueError(f"step_bound: {config.problem.key} runs {count} times per step; give a count >= 1")
        b = config.bounds
        bound = config.baseline_s * b.bound_fraction if b is not None else None
        terms.append(StepBoundTerm(
            problem_key=config.problem.key, count=count, baseline_s=config.baseline_s, time_s=config.time_s,
            bound_s=bound, saved_s=count * (config.baseline_s - config.time_s),
            hideable_s=count * max(config.baseline_s - bound, 0.0) if bound is not None else None))
    estimated = sum(t.saved_s for t in terms)
    unbounded = [t.problem_key for t in terms if t.hideable_s is None]
    hideable = sum(t.hideable_s for t in terms) if not unbounded else None
    measured = measured_baseline_s - measured_tuned_s
    perfect = measured_baseline_s - hideable if hideable is not None else None
    reached = measured / hideable if hideable else None
    return StepBound(terms=terms, estimated_saved_s=estimated, hideable_s=hideable,
                     measured_baseline_s=measured_baseline_s, measured_tuned_s=measured_tuned_s,
                     measured_saved_s=measured, overlap_perfect_s=perfect, reached=reached, unbounded=unbounded,
                     summary=as_message(_step_summary(estimated, measured, hideable, perfect, measured_tuned_s,
                                                      unbounded), 2000))


def _step_summary(estimated: float, measured: float, hideable: float | None, perfect: float | None,
                  tuned: float, unbounded: list[str]) -> str:
    parts = []
    if perfect is not None:
        parts.append(f"the tuned step ({ms(tuned)}) is {ms(tuned - perfect)} from overlap-perfect ({ms(perfect)}): "
                     f"it saved {ms(measured)} of the {ms(hideable)} overlap could save"
                     + (f" ({measured / hideable:.0%})" if hideable else ""))
    else:
        parts.append(f"no step bound: {len(unbounded)} of its collective matmuls have no bounds "
                     f"({', '.join(unbounded[:3])}{' ...' if len(unbounded) > 3 else ''})")
    scale = max(abs(estimated), abs(measured))
    if scale == 0 or abs(estimated - measured) <= AGREE * scale:
        parts.append(f"the op-level estimate ({ms(estimated)}) and the measured saving ({ms(measured)}) agree")
    elif estimated > measured:
        parts.append(f"the op-level estimate ({ms(estimated)}) exceeds the measured saving ({ms(measured)}) by "
                     f"{ms(estimated - measured)}: each op was timed alone with the devices to itself, while in the "
                     "step its ring shares them with the rest of the step's work, and XLA already overlaps part of "
                     "the all-baseline step's collectives with neighbouring computation")
    else:
        parts.append(f"the step saved more ({ms(measured)}) than the ops alone predict ({ms(estimated)}): in the "
                     "step, the rings' transfers also hide behind neighbouring computation (other matmuls of the "
                     "forward and backward), which an op timed alone cannot show")
    return "; ".join(parts)
