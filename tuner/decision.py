"""The step decision: the rules that pick the variant of a training step that runs, from its measurements.

Every place that decides what a step runs calls this module: the engine for a step study
(`cmtune.tuner.step_studies`), the step search for its rounds and its grading (`cmtune.tuner.stepsearch`),
the service for a submitted result, and the workers for a local step.  Two decisions share one rule:

- `step_decision`: one measurement of the standard menu (`cmtune.tuner.variants.variant_configs`) decides.
- `search_decision`: a finished step search (`SearchOutcome`, what `StepSearch.decide` hands over) decides,
  graded in fresh rounds.

The terms (docs/tuning.md, "The step search's terms", says them in words):

- the *incumbent* is the variant that runs if nothing replaces it (`TUNED` at first);
- the *replacement rule* (the search's step 2: "the rule of 2") is `replacement`: a contender replaces the
  incumbent only if it is `cmtune.tuner.paired.faster` beyond the spread, and of several such the fastest
  against the step as written wins;
- an *acceptance* (`Acceptance`) is a replacement the search made;
- the *seeds* (`SEEDS`) are the fixed settings the search's first round times; the *seed* is the one that
  round chose (the best fixed setting);
- the *rival* of an acceptance is what the next round times again beside it (`cmtune.tuner.stepsearch.Recheck`).

Pure and deterministic: no JAX, no timing of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cmtune.tuner.paired import faster, grading_rounds, ratio_quartiles, speedup, timed
from cmtune.tuner.variants import ALWAYS_RING, BASELINE, COSTMODEL, RING_FILL, TUNED
from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import Quartiles, Speedup, StepChoice, StepMeasurement, StepVariant
from collective_matmul.wire.bundle import RoleOverride

SEEDS = (BASELINE, TUNED, COSTMODEL, RING_FILL, ALWAYS_RING)
"""The fixed settings, in the order the step search's first round times them (each only where it differs from
those before it), after the step as written; the choice is graded against those that ran."""


# ---- the rule ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replacement:
    """A contender that the replacement rule puts in the incumbent's place."""

    variant: str
    paired: Quartiles  # its time over the incumbent's, quartiles of the paired rounds


def replacement(measurement: StepMeasurement, incumbent: str, contenders: Sequence[str]) -> Replacement | None:
    """The replacement rule: of the ``contenders`` `faster` than ``incumbent`` beyond the spread, the one with the
    lowest time over the step as written, below the incumbent's (the first of equals); None if there is none."""
    best, bar = None, measurement.variant(incumbent).ratio if timed(measurement, incumbent) else None
    for name in contenders:
        paired = faster(measurement, name, incumbent)
        ratio = measurement.variant(name).ratio if paired is not None else None
        if ratio is not None and bar is not None and ratio < bar:
            best, bar = Replacement(name, paired), ratio
    return best


@dataclass(frozen=True)
class Acceptance:
    """A replacement the step search made: a round's winner that became the incumbent."""

    round: int
    variant: str
    replaced: str
    paired: Quartiles  # its time over the one it replaced, quartiles of the paired rounds


# ---- the decision ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepDecision:
    """What a step measurement (or a step search) decides: the variant that runs, its overrides, and why."""

    ok: bool
    variant: str
    ratio: float | None  # the chosen variant's step time over the step as written (median of rounds)
    overrides: dict[str, OpConfigs]
    reasons: dict[str, str]
    summary: str
    record: StepChoice | None = None  # what is stored and served (None: no decision could be made)

    @classmethod
    def failed(cls, summary: str, *, variant: str = TUNED) -> StepDecision:
        """No decision: ``variant`` runs as it is, with no overrides, and ``summary`` says why."""
        return cls(ok=False, variant=variant, ratio=None, overrides={}, reasons={}, summary=summary)

    @classmethod
    def made(cls, record: StepChoice, *, overrides: dict[str, OpConfigs], reasons: dict[str, str]) -> StepDecision:
        """The decision ``record`` holds, its summary naming the roles it overrides."""
        summary = record.summary + (f"; overrides: {', '.join(sorted(overrides))}" if overrides else "")
        record = record.model_copy(update={"summary": summary[:2000]})
        return cls(ok=True, variant=record.variant, ratio=record.ratio, overrides=overrides, reasons=reasons,
                   summary=summary, record=record)

    def role_overrides(self, model: str, hardware: Hardware,
                       problems: dict[str, dict[str, Problem]] | None = None, *,
                       software: Software | None = None) -> list[RoleOverride]:
        """The decision's changes as the per-role overrides of ``model`` on ``hardware``, each with its
        role's three problems where ``problems`` has them (each config is checked against its own) and the
        stack that measured them (``software``, default ``hardware.software``)."""
        problems = problems or {}
        software = software or hardware.software
        return [RoleOverride(model=model, role=role, hardware=hardware.identity(), configs=configs,
                             reason=self.reasons[role], step_speedup=1 / self.ratio, problems=problems.get(role),
                             software=software)
                for role, configs in self.overrides.items()]


def step_decision(measurement: StepMeasurement, tuned: dict[str, OpConfigs]) -> StepDecision:
    """Which configuration of the step runs, from one step measurement of the standard menu.

    1. The tuned step (every role's tuned configs) is the default.
    2. Any other variant of the custom-VJP ops (an ablation such as ``tuned-minus-<role>`` or
       ``tuned-fuse-<role>``, the all-``baseline`` step, or a whole-step alternative such as
       ``tuned-ring-fill``; see `cmtune.tuner.variants.variant_configs`) replaces it only under the
       replacement rule (`replacement`): `faster` than the tuned step beyond the spread, the fastest
       against the step as written of several such.
    3. The change becomes per-role overrides for this model, each with its reason; the decision
       reports the measured speedup of what runs, against the step as written and the all-baseline step,
       from the measurement's confirmation (fresh rounds timed after the decision) where it has one,
       else from the rounds that decided.

    Args:
        measurement: the step measurement of the menu (with its confirmation, where the worker ran one).
        tuned: each role's tuned configs, as the measurement's ``tuned`` variant ran them.

    Returns:
        the decision; not ``ok`` when the step as written or the tuned step was not measured.
    """
    try:
        reference, tuned_variant = measurement.variant(measurement.reference), measurement.variant(TUNED)
    except KeyError as exc:
        return StepDecision.failed(f"the step measurement is incomplete: {exc}")
    if not (reference.ok and tuned_variant.ok):
        bad = next(v for v in (reference, tuned_variant) if not v.ok)
        return StepDecision.failed(f"the step could not be measured: {bad.name} {bad.status}: {bad.message}")
    contenders = [v.name for v in measurement.variants if _changes(v, tuned)]
    found = replacement(measurement, TUNED, contenders)
    chosen, overrides, reasons = TUNED, {}, {}
    if found is not None:
        chosen = found.variant
        overrides = _changes(measurement.variant(chosen), tuned)
        reasons = {role: f"{chosen} ran the step {_fmt(found.paired)} faster than the tuned configs, so {role} "
                         f"{_does(configs)} for {measurement.name}" for role, configs in overrides.items()}
    graded = grading_rounds(measurement, chosen)  # report from fresh rounds where the worker ran them
    record = _choice(graded, chosen, fresh=graded is not measurement, overrides=reasons)
    return StepDecision.made(record, overrides=overrides, reasons=reasons)


@dataclass(frozen=True)
class SearchOutcome:
    """What a finished step search hands to `search_decision` (`cmtune.tuner.stepsearch.StepSearch.outcome`).

    Args:
        model: the model's name, for the reasons.
        winners: the op-level winners of each role the search searched.
        others: the roles it did not search (they run as tuned unless a fixed setting changes them whole).
        settings: every variant it named, with its per-role configs (None: the step as written).
        incumbent: its choice (None: it ran no round).
        seed: the seeds' round's choice.
        fixed: the seeds its first round timed and ran.
        accepted: its acceptances, in order.
        measurements: each search round's measurement, in order (None: the round got no result).
        variants_tried: the settings its rounds asked for.
        search_s: wall seconds of the rounds after the first (None: not known).
        failure: why it failed, if it did.
    """

    model: str
    winners: Mapping[str, OpConfigs]
    others: frozenset[str]
    settings: Mapping[str, Mapping[str, OpConfigs] | None]
    incumbent: str | None
    seed: str | None
    fixed: tuple[str, ...]
    accepted: tuple[Acceptance, ...]
    measurements: tuple[StepMeasurement | None, ...]
    variants_tried: int
    search_s: float | None
    failure: str | None = None


def search_decision(outcome: SearchOutcome, graded: StepMeasurement | None) -> StepDecision:
    """A step search's choice, reported from ``graded`` (the grading round) where it timed the choice and the
    step as written, else from the last round that did (and the record says so).

    Where the grading's fresh rounds time a fixed setting faster than the choice in the median, the fastest
    such setting runs instead: the rounds that chose it favoured it, the fresh ones do not, and a fixed
    setting no slower is the simpler program.

    Returns:
        the decision; not ``ok`` if the search failed or no round timed its choice and the step as written.
    """
    if outcome.failure is not None or outcome.incumbent is None:
        return StepDecision.failed(outcome.failure or "the step search has no round")
    chosen = outcome.incumbent
    usable = [m for m in ([graded] if graded is not None else []) + [r for r in reversed(outcome.measurements) if r]
              if timed(m, m.reference) and timed(m, chosen)]
    measurement = usable[0] if usable else None
    if measurement is None:
        return StepDecision.failed(f"no round timed {chosen} and the step as written", variant=chosen)
    fresh = measurement is graded
    slower = _fixed_faster(outcome, graded, chosen) if fresh else None
    if slower is not None:  # the rounds that chose it favoured it; the fresh ones put a fixed setting ahead
        chosen, slower = slower
    setting = outcome.settings[chosen]
    overrides = {role: configs for role, configs in setting.items()
                 if configs != outcome.winners.get(role) and (role in outcome.winners or role in outcome.others)}
    reasons = {role: _reason(outcome, role, configs) if slower is None else
               (f"{chosen} (a fixed setting the seeds' round of the step search timed) ran the step faster than "
                f"the search's choice {outcome.incumbent} in the fresh rounds of its grading ({outcome.incumbent} "
                f"ran {_fmt(slower)} of its speed), so {role} {_does(configs)} for {outcome.model}")
               for role, configs in overrides.items()}
    rounds = len(outcome.measurements)
    search = {"rounds": rounds, "variants_tried": outcome.variants_tried,
              "search_s": outcome.search_s if rounds > 1 else None}
    record = _choice(measurement, chosen, fresh=fresh, overrides=reasons, seed=outcome.seed, fixed=outcome.fixed,
                     **search)
    if slower is not None:
        record = record.model_copy(update={"summary": f"{record.summary}; the search's choice {outcome.incumbent} "
                                           f"was slower than {chosen} in the fresh rounds, so {chosen} runs"})
    return StepDecision.made(record, overrides=overrides, reasons=reasons)


def _fixed_faster(outcome: SearchOutcome, graded: StepMeasurement, chosen: str) -> tuple[str, Quartiles] | None:
    """The fixed setting the grading's fresh rounds timed faster than ``chosen`` in the median (the fastest such,
    the seed first among equals), with ``chosen``'s time over its, paired by round; None if there is none."""
    best = None
    for name in dict.fromkeys([outcome.seed, *outcome.fixed]):
        if name is None or name == chosen or not timed(graded, name):  # `search_decision` graded only a timed choice
            continue
        paired = ratio_quartiles(graded, chosen, name)
        if paired is not None and paired[1] > 1 and (best is None or paired[1] > best[1][1]):
            best = (name, paired)
    return best


def _reason(outcome: SearchOutcome, role: str, configs: OpConfigs) -> str:
    """Why ``role`` runs ``configs``: the last accepted round that changed it."""
    winner = outcome.winners.get(role)
    for step in reversed(outcome.accepted):
        before, after = outcome.settings[step.replaced] or {}, outcome.settings[step.variant] or {}
        if before.get(role, winner) != after.get(role, winner):
            where = "the seeds' round" if step.round == 1 else f"round {step.round}"
            against = "the tuned configs" if step.replaced == TUNED else step.replaced
            return (f"{step.variant} ({where} of the step search) ran the step {_fmt(step.paired)} faster than "
                    f"{against}, so {role} {_does(configs)} for {outcome.model}")
    return f"the step search chose {outcome.incumbent}, so {role} {_does(configs)} for {outcome.model}"


def _fmt(quartiles_: Quartiles) -> str:
    return str(Speedup.of(quartiles_))


def _does(configs: OpConfigs) -> str:
    return "is set back to the baseline" if configs.is_baseline else f"runs {configs.ids}"


def _changes(variant: StepVariant, tuned: dict[str, OpConfigs]) -> dict[str, OpConfigs]:
    """The roles ``variant`` runs otherwise than ``tuned``, with what it runs (empty for plain
    the step as written, which calls no op of ours, and for the tuned step itself)."""
    return {role: configs for role, configs in variant.configs.items()
            if configs != tuned.get(role, OpConfigs())}


def _choice(graded: StepMeasurement, chosen: str, *, fresh: bool, overrides: dict[str, str],
            seed: str | None = None, fixed: Sequence[str] = (), **search) -> StepChoice:
    """``chosen`` as reported from ``graded`` (it and the reference ran there): its speedups, the time it saves,
    and against each of the ``fixed`` settings ``graded`` timed."""
    vs_reference = speedup(graded, chosen, graded.reference)
    names = {v.name for v in graded.variants if v.ok}
    vs_baseline = saved = vs_seed = None
    parts = [f"{chosen}: {vs_reference} against the step as written"]
    if BASELINE in names:
        vs_baseline = speedup(graded, chosen, BASELINE)
        saved = graded.variant(BASELINE).timing.median_s - graded.variant(chosen).timing.median_s
        parts.append(f"{vs_baseline} against the all-baseline step")
    if seed is not None and seed != chosen and seed in names:
        vs_seed = speedup(graded, chosen, seed)
        parts.append(f"{vs_seed} against {seed}, the best fixed setting")
    vs_fixed = {name: vs for name in fixed if name != chosen and name in names
                and (vs := speedup(graded, chosen, name)) is not None}
    if len(vs_fixed) > 1:
        behind = [name for name, vs in vs_fixed.items() if vs.low <= 1]
        parts.append(f"ahead of every other fixed setting ({', '.join(vs_fixed)}) beyond the spread" if not behind
                     else f"not ahead of {', '.join(behind)} beyond the spread")
    rounds = "fresh rounds after the decision" if fresh else "the rounds that decided"
    summary = "; ".join(parts) + f" ({rounds})"
    if search.get("rounds", 1) > 1:
        spent = search.get("search_s")
        summary += (f"; the search: {search['rounds']} rounds, {search.get('variants_tried')} variants"
                    + (f", {spent:.0f} s after the first round" if spent is not None else ""))
    return StepChoice(variant=chosen, ratio=graded.variant(chosen).ratio, vs_reference=vs_reference,
                      vs_baseline=vs_baseline, saved_s=saved, fresh_rounds=fresh, overrides=overrides,
                      summary=summary[:2000], seed=seed, vs_seed=vs_seed, vs_fixed=vs_fixed,
                      time_s=graded.variant(chosen).timing.median_s, **search)
