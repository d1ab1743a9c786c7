"""The step search: per-role configs chosen with the whole training step as the objective.

What an op wins alone and what it wins inside the step differ (one fixed ring everywhere has beaten
the op-level winners in the step), so the step study searches the roles' configs on the step itself,
within a budget of rounds.  Each round is one set of interleaved step measurements (a step trial of
the service, or one `measure` of a local session): the step as written (the reference every variant
is checked and timed against), the incumbent, and the variants the round proposes.

`StepSearch` is the policy: pure and deterministic (no JAX, no timing of its own), a function of its
`SearchSpace` and the rounds recorded so far, so the service rebuilds it from the step trials it
stored and a multi-process run lets process 0 alone hold it (`cmtune.workers.step.search_step`).

1. Round 1 times the seeds: the step as written, ``baseline`` (every role at the baseline),
   ``tuned`` (the op-level winners), ``costmodel`` (the cost model's whole-step choice),
   ``tuned-ring-fill`` and ``always-ring`` (`cmtune.tuner.variants`), each only where it differs
   from those before it; with a budget of one round also the per-role ablation
   (``tuned-minus-<role>``, ``tuned-fuse-<role>``): today's menu.
2. The incumbent is ``tuned`` unless another variant is faster than it beyond the spread (`faster`:
   its time over the incumbent's, paired by round, below 1 in three rounds of four); among such
   variants the fastest against the step as written wins.  The first round's choice is the *seed*:
   the best fixed setting.
3. Each later round improves one role, the roles in turn: the incumbent with that role's configs
   changed, one variant per change (first the whole role as the other fixed settings run it: its
   op-level winners, ``tuned-ring-fill``'s and ``always-ring``'s, so the roles of two settings
   that ran close combine; then each slot set to one of its candidates, best first, the first of
   each slot before the second of any; a ring weight gradient fused or unfused; the whole role at
   the baseline, last), at most ``per_round`` of them, never a setting timed before nor a change
   from the role's configs tried before.  The rule of 2 against the incumbent decides; the winner
   is the new incumbent.
4. An acceptance is re-checked in the next round, which times its *rival* again beside it: what it
   replaced (for the seeds' round: the runner-up seed, where a second seed was faster than tuned
   beyond the spread too; a seed that alone beat tuned is not re-checked).  The rounds that
   accept a change favour it (many variants, a few rounds each: some pass the rule by chance),
   so it stands only if those fresh rounds time it no slower than its rival in the median; else
   the rival is the incumbent again (and, for the seeds' round, the seed).
5. The search stops at its budget of rounds, or when a full pass over the roles changed nothing:
   no role has a change left to try (each role's candidates were tried from its configs, and
   what the rounds rejected is not tried again unless the role's configs change) and no
   acceptance waits for its re-check.  Then the choice is graded in fresh rounds: the step as
   written, every fixed setting the seeds' round ran (the all-baseline step and the seed among
   them) and the choice (`plan` of kind ``grade``), and `decide` reports it from those rounds:
   against the step as written, the seed, and each other fixed setting (``vs_fixed``).  Where
   those fresh rounds time a fixed setting faster than the choice in the median, the fastest
   such setting runs instead: the rounds that chose it favoured it, the fresh ones do not, and a
   fixed setting no slower is the simpler program.

Every variant has a unique, bounded name (``r<round>-<role>-<change>`` for a search round's, at
most `MAX_VARIANT_NAME` characters) and carries its per-role configs, so a stored round says what
it timed without this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from cmtune.tuner.rounds import faster, grading_rounds, ratio_quartiles, speedup, timed
from cmtune.tuner.variants import (
    REFERENCE,
    ablation_variants,
    cost_model_configs,
    ring_everywhere,
    ring_fill,
    slot_candidates,
)
from collective_matmul.planning.decomposition import Decomposition, OpConfigs
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import (
    MAX_VARIANT_NAME,
    Quartiles,
    Speedup,
    StepChoice,
    StepMeasurement,
    StepVariant,
    StopReason,
)
from collective_matmul.wire.bundle import RoleOverride

Setting = Mapping[str, OpConfigs]  # a variant's configs per role; a role it does not name runs its op-level winners
Variants = dict[str, dict[str, OpConfigs] | None]  # name -> setting, in the order to time them (None: the reference)
SEEDS = ("baseline", "tuned", "costmodel", "tuned-ring-fill", "always-ring")
_SLOT_TAGS = (("forward", "fw"), ("grad_input", "gi"), ("grad_weight", "gw"))


# ---- the rule ----------------------------------------------------------------------------------


def _fastest(measurement: StepMeasurement, incumbent: str, contenders: Sequence[str]) -> tuple[str, Quartiles] | None:
    """The contender `faster` than ``incumbent`` with the lowest time over the reference, below the incumbent's
    (the first of equals)."""
    best, bar = None, measurement.variant(incumbent).ratio if timed(measurement, incumbent) else None
    for name in contenders:
        paired = faster(measurement, name, incumbent)
        ratio = measurement.variant(name).ratio if paired is not None else None
        if ratio is not None and bar is not None and ratio < bar:
            best, bar = (name, paired), ratio
    return best


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
    def failed(cls, summary: str, *, variant: str = "tuned") -> StepDecision:
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


def _fmt(quartiles_: Quartiles) -> str:
    return str(Speedup.of(quartiles_))


def _does(role: str, configs: OpConfigs) -> str:
    return "is set back to the baseline" if configs.is_baseline else f"runs {configs.ids}"


def step_decision(measurement: StepMeasurement, tuned: dict[str, OpConfigs]) -> StepDecision:
    """Which configuration of the step runs, from one step measurement of the standard menu.

    1. The tuned step (every role's tuned configs) is the default.
    2. Any other variant of the custom-VJP ops (an ablation such as ``tuned-minus-<role>`` or
       ``tuned-fuse-<role>``, the all-``baseline`` step, or a whole-step alternative such as
       ``tuned-ring-fill``; see `cmtune.tuner.variants.variant_configs`) replaces it only if it is
       `faster` than the tuned step beyond the spread.  Among such variants the fastest against
       the step as written wins.
    3. The change becomes per-role overrides for this model, each with its reason; the decision
       reports the measured speedup of what runs, against the step as written and the all-baseline step,
       from the measurement's confirmation (fresh rounds timed after the decision; see
       `cmtune.workers.step.run_step`) where it has one, else from the rounds that decided.
    """
    try:
        reference, tuned_variant = measurement.variant(measurement.reference), measurement.variant("tuned")
    except KeyError as exc:
        return StepDecision.failed(f"the step measurement is incomplete: {exc}")
    if not (reference.ok and tuned_variant.ok):
        bad = next(v for v in (reference, tuned_variant) if not v.ok)
        return StepDecision.failed(f"the step could not be measured: {bad.name} {bad.status}: {bad.message}")
    contenders = [v.name for v in measurement.variants if _changes(v, tuned)]
    found = _fastest(measurement, "tuned", contenders)
    chosen, overrides, reasons = "tuned", {}, {}
    if found is not None:
        chosen, paired = found
        overrides = _changes(measurement.variant(chosen), tuned)
        reasons = {role: f"{chosen} ran the step {_fmt(paired)} faster than the tuned configs, so {role} "
                         f"{_does(role, configs)} for {measurement.name}" for role, configs in overrides.items()}
    graded = grading_rounds(measurement, chosen)  # report from fresh rounds where the worker ran them
    record = _choice(graded, chosen, fresh=graded is not measurement, overrides=reasons)
    return StepDecision.made(record, overrides=overrides, reasons=reasons)


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
    if "baseline" in names:
        vs_baseline = speedup(graded, chosen, "baseline")
        saved = graded.variant("baseline").timing.median_s - graded.variant(chosen).timing.median_s
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


# ---- the search --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchSpace:
    """What a step search chooses from.

    Args:
        winners: the op-level winners of each role it searches, in the order it improves them.
        candidates: per role and slot, the configs to try there, best first
            (`cmtune.tuner.variants.slot_candidates`); each must fit its problem.
        costmodel: the cost model's whole-step choice per role (None: not a seed).
        others: roles it does not search (a user's role seen with several problems: no one set of
            configs fits them all), each with whether it runs a ring as tuned.  They run as tuned,
            and are only set back or put on the fixed ring whole (``baseline``, ``always-ring``,
            ``tuned-minus-<role>``).
    """

    winners: Mapping[str, OpConfigs]
    candidates: Mapping[str, Mapping[str, Sequence[Decomposition]]] = field(default_factory=dict)
    costmodel: Mapping[str, OpConfigs] | None = None
    others: Mapping[str, bool] = field(default_factory=dict)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.winners)

    @classmethod
    def of(cls, winners: Mapping[str, OpConfigs], problems: Mapping[str, Mapping[str, Problem]], hardware: Hardware,
           *, measured: Callable[[Problem], Sequence[Decomposition]] = lambda _problem: (),
           others: Mapping[str, bool] | None = None) -> SearchSpace:
        """The space of a step whose searched roles have ``problems`` (per slot) on ``hardware``: per slot the
        candidates of `cmtune.tuner.variants.slot_candidates` with ``measured(problem)`` (a problem's measured
        decompositions, best first: a study's search trials, a bundle's entries) as runners-up, and the cost
        model's whole-step choice (`cmtune.tuner.variants.cost_model_configs`)."""
        candidates = {role: {slot: slot_candidates(problem, slot, winner=getattr(winners[role], slot),
                                                   measured=measured(problem), hardware=hardware)
                             for slot, problem in problems[role].items()} for role in winners}
        return cls(winners=dict(winners), candidates=candidates,
                   costmodel=cost_model_configs({role: problems[role] for role in winners}, hardware),
                   others=dict(others or {}))


@dataclass(frozen=True)
class Plan:
    """What to time next: a search round, the grading of the choice, or nothing (the search failed)."""

    kind: Literal["search", "grade", "failed"]
    round: int
    variants: Variants
    role: str | None = None  # the role a search round improves (None: the seeds)
    reason: str = ""  # why the search stopped (grade) or failed, in words
    stop: StopReason | None = None  # why it stopped (grade), as a study stores it


@dataclass(frozen=True)
class Acceptance:
    """A round's winner that became the incumbent."""

    round: int
    variant: str
    replaced: str
    paired: Quartiles  # its time over the one it replaced, quartiles of the paired rounds


@dataclass(frozen=True)
class Recheck:
    """An acceptance timed again beside its rival in the next round (step 4 of the module)."""

    round: int  # the round that re-timed them
    variant: str  # the accepted one
    rival: str
    paired: Quartiles  # its time over the rival's in that round
    kept: bool  # False: slower than the rival in the median, so the rival is the incumbent again


@dataclass(frozen=True)
class _Pending:
    """An acceptance waiting for its re-check: the rival, and the acceptance that stands if the rival wins
    (None: the rival is what the accepted variant replaced, whose own acceptance stands)."""

    variant: str
    rival: str
    restore: Acceptance | None


def _key(setting: Setting | None) -> tuple | None:
    return None if setting is None else tuple(sorted(setting.items()))


def variant_name(round_: int, role: str, change: str) -> str:
    """``r<round>-<role>-<change>``, at most `MAX_VARIANT_NAME` characters: a role too long for it keeps its
    start and a digest of the whole (so two long roles never share a name)."""
    name = f"r{round_}-{role}-{change}"
    if len(name) <= MAX_VARIANT_NAME:
        return name
    digest = hashlib.sha256(role.encode()).hexdigest()[:8]
    room = MAX_VARIANT_NAME - len(f"r{round_}--{change}") - len(digest) - 1
    return f"r{round_}-{role[:room]}~{digest}-{change}"


class StepSearch:
    """The step search over ``space``, from the rounds `record`-ed so far (see the module).

    Args:
        space: the roles, their op-level winners and candidates.
        rounds: the budget: search rounds, the seeds' included (0 or 1: one round, today's menu).
        per_round: changes of one role a search round times beside the incumbent.
        ablation: with a budget of one round, also each role set back and each ring weight gradient fused.
        model: the model's name, for the reasons.

    Raises:
        ValueError: if ``per_round`` is below 1.
    """

    def __init__(self, space: SearchSpace, *, rounds: int = 3, per_round: int = 3, ablation: bool = True,
                 model: str = "this model"):
        if per_round < 1:
            raise ValueError(f"per_round must be >= 1, got {per_round}")
        self.space, self.budget, self.per_round, self.ablation, self.model = (
            space, max(rounds, 1), per_round, ablation, model)
        self.rounds: list[tuple[Variants, StepMeasurement | None]] = []
        self.names: dict[str, dict[str, OpConfigs] | None] = {}  # every variant named so far
        self.timed: set[tuple] = set()  # every setting a round asked for
        self.incumbent: str | None = None
        self.seed: str | None = None
        self.accepted: list[Acceptance] = []
        self.rechecks: list[Recheck] = []
        self._pending: _Pending | None = None  # the last acceptance, until the next round re-checks it
        self._planned: dict[int, tuple[str | None, str | None]] = {}  # round -> (the rival it re-timed, its role)
        self.failure: str | None = None
        self.search_s: float | None = 0.0  # wall seconds of the rounds after the first (None: not known)
        self._cursor = 0  # the next role to improve
        self._tried: set[tuple[str, OpConfigs, OpConfigs]] = set()  # (role, from, to): changes rounds proposed

    # -- what to time -----------------------------------------------------------------------

    def plan(self) -> Plan:
        """The next round to time (a function of the space and the rounds recorded)."""
        number = len(self.rounds) + 1
        if self.failure is not None:
            return Plan("failed", number, {}, reason=self.failure)
        if not self.rounds:
            return Plan("search", 1, self.seeds())
        if len(self.rounds) >= self.budget:
            return self._grade(f"the search budget of {self.budget} round{'s' * (self.budget > 1)}",
                               StopReason.STEP_BUDGET)
        roles = self.space.roles
        timed: Variants = {REFERENCE: None, self.incumbent: self.names[self.incumbent]}
        if self._pending is not None:
            timed[self._pending.rival] = self.names[self._pending.rival]
        for step in range(len(roles)):
            role = roles[(self._cursor + step) % len(roles)]
            proposals = self._proposals(role, number)
            if proposals:
                return Plan("search", number, timed | proposals, role=role)
        if self._pending is not None:  # nothing left to propose: the round re-checks the last acceptance alone
            return Plan("search", number, timed)
        return self._grade("a full pass over the roles changed nothing: no role has a change left to try",
                           StopReason.NOTHING_LEFT)

    def seeds(self) -> Variants:
        """Round 1: the reference, the all-baseline step, the op-level winners and the whole-step alternatives
        (each only where it differs from those before it); with a budget of one round, the per-role ablation."""
        space = self.space
        roles, every = space.roles, (*space.roles, *space.others)
        winners = {role: space.winners[role] for role in roles}
        variants: Variants = {REFERENCE: None, "baseline": {role: OpConfigs() for role in every}, "tuned": winners}
        alternatives = [("costmodel", winners | dict(space.costmodel)) if space.costmodel is not None else None,
                        ("tuned-ring-fill", ring_fill(winners, roles)), ("always-ring", ring_everywhere(every))]
        for name, setting in filter(None, alternatives):
            if _key(setting) not in {_key(s) for s in variants.values()}:
                variants[name] = setting
        if self.ablation and self.budget <= 1:
            variants |= ablation_variants(winners, roles, [role for role, ringed in space.others.items() if ringed])
        return variants

    def _changes(self, role: str, current: OpConfigs) -> list[tuple[str, OpConfigs]]:
        """The changes of ``role``'s configs a round may propose, in the order it tries them."""
        options = self.space.candidates.get(role, {})
        winners = self.space.winners[role]
        changes = [("tuned", winners), ("fill", ring_fill({role: winners}, [role])[role]),
                   ("ring", ring_everywhere([role])[role])]
        for i in range(max(max((len(v) for v in options.values()), default=0), 1)):
            for slot, tag in _SLOT_TAGS:
                listed = options.get(slot, ())
                if i < len(listed):
                    changes.append((f"{tag}{i + 1}", current.model_copy(update={slot: listed[i]})))
            if i == 0:
                weight = current.grad_weight
                if weight.method == "ring":
                    toggled = weight.model_copy(update={"fuse": not weight.fuse})
                    changes.append(("unfuse" if weight.fuse else "fuse", current.model_copy(
                        update={"grad_weight": toggled})))
        changes.append(("baseline", OpConfigs()))
        return changes

    def _proposals(self, role: str, number: int) -> Variants:
        """Up to ``per_round`` settings: the incumbent with one change of ``role``, none timed before, and no
        change from the role's configs that a round tried before (rejected, it is not tried again until the role
        runs something else)."""
        incumbent = self.names[self.incumbent]
        current = incumbent.get(role, self.space.winners[role])
        found: Variants = {}
        seen = set(self.timed)
        for tag, configs in self._changes(role, current):
            setting = dict(incumbent) | {role: configs}
            if configs == current or _key(setting) in seen or (role, current, configs) in self._tried:
                continue
            seen.add(_key(setting))
            found[variant_name(number, role, tag)] = setting
            if len(found) >= self.per_round:
                break
        return found

    def _grade(self, reason: str, stop: StopReason) -> Plan:
        names = dict.fromkeys([REFERENCE, "baseline", *self._fixed(), self.seed, self.incumbent])
        return Plan("grade", len(self.rounds) + 1, {name: self.names[name] for name in names}, reason=reason,
                    stop=stop)

    def _fixed(self) -> list[str]:
        """The seeds the first round timed and ran (the fixed settings the choice is graded against)."""
        variants, result = self.rounds[0]
        return [name for name in variants if name in SEEDS and result is not None and timed(result, name)]

    # -- what was timed ---------------------------------------------------------------------

    def record(self, variants: Variants, result: StepMeasurement | None, *, wall_s: float | None = None) -> None:
        """One search round's variants (as asked) and its measurement (None: the round got no result).

        Raises:
            ValueError: if the round is the grading (`decide` takes it) or the search has failed.
        """
        if self.failure is not None or (self.rounds and len(self.rounds) >= self.budget):
            raise ValueError("the search is over: the next measurement is its grading (decide)")
        number = len(self.rounds) + 1
        self.rounds.append((dict(variants), result))
        for name, setting in variants.items():
            self.names.setdefault(name, None if setting is None else dict(setting))
            self.timed.add(_key(setting))
        if number == 1:
            self._first(result)
            return
        if wall_s is None or self.search_s is None:
            self.search_s = None
        else:
            self.search_s += wall_s
        incumbent = self.names[self.incumbent]
        rival = self._pending.rival if self._pending is not None and self._pending.rival in variants else None
        proposals = [name for name in variants if name not in (REFERENCE, self.incumbent, rival)]
        for name in proposals:
            for r, c in (variants[name] or {}).items():
                if c != incumbent.get(r, self.space.winners.get(r)):
                    self._tried.add((r, incumbent.get(r, self.space.winners.get(r)), c))
        role = next((r for name in proposals for r, c in (variants[name] or {}).items()
                     if c != incumbent.get(r, self.space.winners.get(r))), None)
        if role in self.space.roles:
            self._cursor = (self.space.roles.index(role) + 1) % len(self.space.roles)
        self._planned[number] = (rival, role)
        if result is None:
            return
        if rival is not None:
            self._recheck(number, result)
        found = _fastest(result, self.incumbent, proposals)
        if found is not None:
            self.accepted.append(Acceptance(number, found[0], self.incumbent, found[1]))
            self._pending = _Pending(found[0], self.incumbent, None)
            self.incumbent = found[0]

    def _recheck(self, number: int, result: StepMeasurement) -> None:
        """Round ``number`` timed the last acceptance beside its rival: it stands unless slower in the median."""
        pending, self._pending = self._pending, None
        paired = ratio_quartiles(result, pending.variant, pending.rival) if (
            timed(result, pending.variant) and timed(result, pending.rival)) else None
        kept = paired is None or paired[1] <= 1
        if paired is not None:
            self.rechecks.append(Recheck(number, pending.variant, pending.rival, paired, kept))
        if kept:
            return
        self.accepted = [a for a in self.accepted if a.variant != pending.variant]
        if pending.restore is not None:
            self.accepted.append(pending.restore)
        if self.seed == pending.variant:
            self.seed = pending.rival
        self.incumbent = pending.rival

    def _first(self, result: StepMeasurement | None) -> None:
        """The seeds' round: the incumbent is tuned unless a seed is faster beyond the spread."""
        if result is None:
            self.failure = "the first round of the step got no result"
            return
        try:
            bad = [v for v in (result.variant(result.reference), result.variant("tuned")) if not v.ok]
        except KeyError as exc:
            self.failure = f"the step measurement is incomplete: {exc}"
            return
        if bad:
            self.failure = f"the step could not be measured: {bad[0].name} {bad[0].status}: {bad[0].message}"
            return
        self.incumbent = "tuned"
        seeds = [n for n in self.rounds[0][0] if n not in (REFERENCE, "tuned")]
        found = _fastest(result, "tuned", seeds)
        if found is not None:
            self.accepted.append(Acceptance(1, found[0], "tuned", found[1]))
            self.incumbent = found[0]
            runner_up = _fastest(result, "tuned", [n for n in seeds if n != found[0]])
            if runner_up is not None:  # two seeds ran close enough to both beat tuned: the next round re-checks
                self._pending = _Pending(found[0], runner_up[0], Acceptance(1, runner_up[0], "tuned", runner_up[1]))
        self.seed = self.incumbent

    def summary(self) -> str:
        """The last round recorded, in one line: what it improved and whether the incumbent changed."""
        if not self.rounds:
            return "no round yet"
        number = len(self.rounds)
        if self.failure is not None:
            return self.failure
        variants, result = self.rounds[-1]
        step = next((a for a in self.accepted if a.round == number), None)  # a round accepts one change at most
        if number == 1:
            where = f"the seeds ({len(variants) - 1} variants)"
        else:
            rival, role = self._planned[number]
            changes = len(variants) - 2 - (rival is not None)
            where = f"round {number} ({role or 'the re-check'}, {changes} change{'s' * (changes != 1)})"
        if result is None:
            return f"{where}: no result; {self.incumbent} stays"
        check = next((c for c in self.rechecks if c.round == number), None)
        told = "" if check is None else (
            f"; {check.variant} ran {_fmt(check.paired)} of {check.rival}'s speed "
            + ("again, so it stays" if check.kept else f"in this round's fresh rounds, so {check.rival} is back"))
        if step is None:
            return f"{where}: nothing ran the step faster than {self.incumbent} beyond the spread" + told
        return f"{where}: {step.variant} ran the step {_fmt(step.paired)} faster than {step.replaced}" + told

    # -- the choice -------------------------------------------------------------------------

    def decide(self, graded: StepMeasurement | None) -> StepDecision:
        """The choice, reported from ``graded`` (the grading round) where it timed the choice and the reference,
        else from the last round that did (and the record says so).

        Returns:
            a decision that is not ``ok`` if the search failed.
        """
        if self.failure is not None or self.incumbent is None:
            return StepDecision.failed(self.failure or "the step search has no round")
        chosen, fresh = self.incumbent, True
        usable = [m for m in ([graded] if graded is not None else []) + [r for _, r in reversed(self.rounds) if r]
                  if timed(m, m.reference) and timed(m, chosen)]
        measurement = usable[0] if usable else None
        if measurement is None:
            return StepDecision.failed(f"no round timed {chosen} and the step as written", variant=chosen)
        fresh = measurement is graded
        slower = self._fixed_faster(graded, chosen) if fresh else None
        if slower is not None:  # the rounds that chose it favoured it; the fresh ones put a fixed setting ahead
            chosen, slower = slower
        setting = self.names[chosen]
        overrides = {role: configs for role, configs in setting.items()
                     if configs != self.space.winners.get(role) and (role in self.space.winners or
                                                                       role in self.space.others)}
        reasons = {role: self._reason(role, configs) if slower is None else
                   (f"{chosen} (a fixed setting the seeds' round of the step search timed) ran the step faster than "
                    f"the search's choice {self.incumbent} in the fresh rounds of its grading ({self.incumbent} ran "
                    f"{_fmt(slower)} of its speed), so {role} {_does(role, configs)} for {self.model}")
                   for role, configs in overrides.items()}
        search = {"rounds": len(self.rounds), "variants_tried": len(self.timed - {None}),
                  "search_s": self.search_s if len(self.rounds) > 1 else None}
        record = _choice(measurement, chosen, fresh=fresh, overrides=reasons, seed=self.seed, fixed=self._fixed(),
                         **search)
        if slower is not None:
            record = record.model_copy(update={"summary": f"{record.summary}; the search's choice {self.incumbent} "
                                               f"was slower than {chosen} in the fresh rounds, so {chosen} runs"})
        return StepDecision.made(record, overrides=overrides, reasons=reasons)

    def _fixed_faster(self, graded: StepMeasurement, chosen: str) -> tuple[str, Quartiles] | None:
        """The fixed setting the grading's fresh rounds timed faster than ``chosen`` in the median (the fastest such,
        the seed first among equals), with ``chosen``'s time over its, paired by round; None if there is none."""
        best = None
        for name in dict.fromkeys([self.seed, *self._fixed()]):
            if name is None or name == chosen or not timed(graded, name):  # `decide` graded only a timed choice
                continue
            paired = ratio_quartiles(graded, chosen, name)
            if paired is not None and paired[1] > 1 and (best is None or paired[1] > best[1][1]):
                best = (name, paired)
        return best

    def _reason(self, role: str, configs: OpConfigs) -> str:
        """Why ``role`` runs ``configs``: the last accepted round that changed it."""
        for step in reversed(self.accepted):
            before, after = self.names[step.replaced] or {}, self.names[step.variant] or {}
            if before.get(role, self.space.winners.get(role)) != after.get(role, self.space.winners.get(role)):
                where = "the seeds' round" if step.round == 1 else f"round {step.round}"
                against = "the tuned configs" if step.replaced == "tuned" else step.replaced
                return (f"{step.variant} ({where} of the step search) ran the step {_fmt(step.paired)} faster than "
                        f"{against}, so {role} {_does(role, configs)} for {self.model}")
        return f"the step search chose {self.incumbent}, so {role} {_does(role, configs)} for {self.model}"


def replay(space: SearchSpace, stored: Sequence[tuple[Variants, StepMeasurement | None, float | None]], **options
           ) -> StepSearch:
    """A `StepSearch` over ``space`` (``options`` as for it) with the ``stored`` search rounds recorded in order:
    ``(variants, measurement or None, wall seconds or None)`` each.  The caller asks the rebuilt search's
    `plan` whether what follows is a round or the grading."""
    search = StepSearch(space, **options)
    for variants, measurement, wall_s in stored:
        search.record(variants, measurement, wall_s=wall_s)
    return search
