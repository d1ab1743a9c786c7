"""The step search: per-role configs chosen with the whole training step as the objective.

What an op wins alone and what it wins inside the step differ (one fixed ring everywhere has beaten
the op-level winners in the step), so the step study searches the roles' configs on the step itself,
within a budget of rounds.  Each round is one set of interleaved step measurements (a step trial of
the service, or one `measure` of a local session): the step as written (`REFERENCE`, the reference every
variant is checked and timed against), the incumbent, and the variants the round proposes.

`StepSearch` is the policy: pure and deterministic (no JAX, no timing of its own), a function of its
`SearchSpace` and the rounds recorded so far, so the service rebuilds it from the step trials it
stored and a multi-process run lets process 0 alone hold it.  It plans rounds (`StepSearch.plan`) and
records them (`StepSearch.record`); the rules that choose are `cmtune.tuner.decision`'s, whose docstring
and docs/tuning.md ("The step search's terms") define the terms used here.

1. Round 1 times the seeds (`cmtune.tuner.decision.SEEDS`), each only where it differs from those before
   it; with a budget of one round also the per-role ablation: the standard menu.  The replacement rule
   against `TUNED` chooses the *seed*, the first incumbent.
2. Each later round improves one role, the roles in turn: the incumbent with that role's configs
   changed, one variant per change (`StepSearch._changes` lists them in order), at most ``per_round`` of
   them, never a setting timed before nor a change from the role's configs tried before.  The
   replacement rule against the incumbent decides; the winner is the new incumbent (an `Acceptance`).
3. An acceptance is re-checked in the next round, which times its *rival* again beside it (a `Recheck`):
   what it replaced (for the seeds' round: the runner-up seed, where a second seed was faster than tuned
   beyond the spread too; a seed that alone beat tuned is not re-checked).  The rounds that accept a change
   favour it (many variants, a few rounds each: some pass the rule by chance), so it stands only if those
   fresh rounds time it no slower than its rival in the median; else the rival is the incumbent again (and,
   for the seeds' round, the seed).
4. The search stops (`PlanKind.GRADE`) at its budget of rounds, or when a full pass over the roles changed
   nothing and no acceptance waits for its re-check.  Then the choice is graded in fresh rounds beside the
   step as written and every seed the first round ran, and `StepSearch.decide` reports it
   (`cmtune.tuner.decision.search_decision`).

Every variant has a unique, bounded name (`variant_name`) and carries its per-role configs, so a stored
round says what it timed without this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from cmtune.tuner.decision import SEEDS, Acceptance, SearchOutcome, StepDecision, replacement, search_decision
from cmtune.tuner.paired import ratio_quartiles, timed
from cmtune.tuner.variants import (
    ALWAYS_RING,
    BASELINE,
    COSTMODEL,
    REFERENCE,
    RING_FILL,
    TUNED,
    ablation_variants,
    cost_model_configs,
    ring_everywhere,
    ring_fill,
    slot_candidates,
)
from collective_matmul.planning.decomposition import Decomposition, OpConfigs
from collective_matmul.planning.problem import Hardware, Problem
from collective_matmul.wire import (
    MAX_VARIANT_NAME,
    Quartiles,
    Speedup,
    StepMeasurement,
    StepSetting,
    StepVariants,
    StopReason,
)

__all__ = ["REFERENCE", "SEEDS", "Plan", "PlanKind", "Recheck", "SearchSpace", "StepSearch", "replay", "variant_name"]

_SLOT_TAGS = (("forward", "fw"), ("grad_input", "gi"), ("grad_weight", "gw"))


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


class PlanKind(StrEnum):
    """What a `Plan` asks for."""

    SEARCH = "search"  # a search round: the seeds, or changes of one role beside the incumbent (and its rival)
    GRADE = "grade"  # the grading: the choice in fresh rounds beside the step as written and the seeds that ran
    FAILED = "failed"  # nothing: the search failed


@dataclass(frozen=True)
class Plan:
    """What to time next: a search round, the grading of the choice, or nothing (the search failed)."""

    kind: PlanKind
    round: int
    variants: StepVariants  # name -> setting, in the order to time them (None: the step as written)
    role: str | None = None  # the role a search round improves (None: the seeds)
    reason: str = ""  # why the search stopped (grade) or failed, in words
    stop: StopReason | None = None  # why it stopped (grade), as a study stores it


@dataclass(frozen=True)
class Recheck:
    """An acceptance timed again beside its rival in the next round (step 3 of the module)."""

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


def _key(setting: StepSetting | None) -> tuple | None:
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
        self.rounds: list[tuple[StepVariants, StepMeasurement | None]] = []
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
            return Plan(PlanKind.FAILED, number, {}, reason=self.failure)
        if not self.rounds:
            return Plan(PlanKind.SEARCH, 1, self.seeds())
        if len(self.rounds) >= self.budget:
            return self._grade(f"the search budget of {self.budget} round{'s' * (self.budget > 1)}",
                               StopReason.STEP_BUDGET)
        roles = self.space.roles
        timed: StepVariants = {REFERENCE: None, self.incumbent: self.names[self.incumbent]}
        if self._pending is not None:
            timed[self._pending.rival] = self.names[self._pending.rival]
        for step in range(len(roles)):
            role = roles[(self._cursor + step) % len(roles)]
            proposals = self._proposals(role, number)
            if proposals:
                return Plan(PlanKind.SEARCH, number, timed | proposals, role=role)
        if self._pending is not None:  # nothing left to propose: the round re-checks the last acceptance alone
            return Plan(PlanKind.SEARCH, number, timed)
        return self._grade("a full pass over the roles changed nothing: no role has a change left to try",
                           StopReason.NOTHING_LEFT)

    def seeds(self) -> StepVariants:
        """Round 1: the reference, the all-baseline step, the op-level winners and the whole-step alternatives
        (each only where it differs from those before it); with a budget of one round, the per-role ablation."""
        space = self.space
        roles, every = space.roles, (*space.roles, *space.others)
        winners = {role: space.winners[role] for role in roles}
        variants: StepVariants = {REFERENCE: None, BASELINE: {role: OpConfigs() for role in every}, TUNED: winners}
        alternatives = [(COSTMODEL, winners | dict(space.costmodel)) if space.costmodel is not None else None,
                        (RING_FILL, ring_fill(winners, roles)), (ALWAYS_RING, ring_everywhere(every))]
        for name, setting in filter(None, alternatives):
            if _key(setting) not in {_key(s) for s in variants.values()}:
                variants[name] = setting
        if self.ablation and self.budget <= 1:
            variants |= ablation_variants(winners, roles, [role for role, ringed in space.others.items() if ringed])
        return variants

    def _changes(self, role: str, current: OpConfigs) -> list[tuple[str, OpConfigs]]:
        """The changes of ``role``'s configs a round may propose, in the order it tries them: first the whole role
        as the other fixed settings run it (its op-level winners, `RING_FILL`'s and `ALWAYS_RING`'s, so the roles of
        two settings that ran close combine); then each slot set to one of its candidates, best first, the first of
        each slot before the second of any; a ring weight gradient fused or unfused; the whole role at the
        baseline, last."""
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

    def _proposals(self, role: str, number: int) -> StepVariants:
        """Up to ``per_round`` settings: the incumbent with one change of ``role``, none timed before, and no
        change from the role's configs that a round tried before (rejected, it is not tried again until the role
        runs something else)."""
        incumbent = self.names[self.incumbent]
        current = incumbent.get(role, self.space.winners[role])
        found: StepVariants = {}
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
        names = dict.fromkeys([REFERENCE, BASELINE, *self._fixed(), self.seed, self.incumbent])
        return Plan(PlanKind.GRADE, len(self.rounds) + 1, {name: self.names[name] for name in names}, reason=reason,
                    stop=stop)

    def _fixed(self) -> list[str]:
        """The seeds the first round timed and ran (the fixed settings the choice is graded against)."""
        variants, result = self.rounds[0]
        return [name for name in variants if name in SEEDS and result is not None and timed(result, name)]

    # -- what was timed ---------------------------------------------------------------------

    def record(self, variants: StepVariants, result: StepMeasurement | None, *, wall_s: float | None = None) -> None:
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
        found = replacement(result, self.incumbent, proposals)
        if found is not None:
            self.accepted.append(Acceptance(number, found.variant, self.incumbent, found.paired))
            self._pending = _Pending(found.variant, self.incumbent, None)
            self.incumbent = found.variant

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
            bad = [v for v in (result.variant(result.reference), result.variant(TUNED)) if not v.ok]
        except KeyError as exc:
            self.failure = f"the step measurement is incomplete: {exc}"
            return
        if bad:
            self.failure = f"the step could not be measured: {bad[0].name} {bad[0].status}: {bad[0].message}"
            return
        self.incumbent = TUNED
        seeds = [n for n in self.rounds[0][0] if n not in (REFERENCE, TUNED)]
        found = replacement(result, TUNED, seeds)
        if found is not None:
            self.accepted.append(Acceptance(1, found.variant, TUNED, found.paired))
            self.incumbent = found.variant
            runner_up = replacement(result, TUNED, [n for n in seeds if n != found.variant])
            if runner_up is not None:  # two seeds ran close enough to both beat tuned: the next round re-checks
                self._pending = _Pending(found.variant, runner_up.variant,
                                         Acceptance(1, runner_up.variant, TUNED, runner_up.paired))
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
            f"; {check.variant} ran {Speedup.of(check.paired)} of {check.rival}'s speed "
            + ("again, so it stays" if check.kept else f"in this round's fresh rounds, so {check.rival} is back"))
        if step is None:
            return f"{where}: nothing ran the step faster than {self.incumbent} beyond the spread" + told
        return f"{where}: {step.variant} ran the step {Speedup.of(step.paired)} faster than {step.replaced}" + told

    # -- the choice -------------------------------------------------------------------------

    def outcome(self) -> SearchOutcome:
        """What the search chose and how, as `cmtune.tuner.decision.search_decision` reads it."""
        return SearchOutcome(
            model=self.model, winners=self.space.winners, others=frozenset(self.space.others),
            settings=dict(self.names), incumbent=self.incumbent, seed=self.seed,
            fixed=tuple(self._fixed()) if self.rounds else (), accepted=tuple(self.accepted),
            measurements=tuple(result for _, result in self.rounds),
            variants_tried=len(self.timed - {None}), search_s=self.search_s, failure=self.failure)

    def decide(self, graded: StepMeasurement | None) -> StepDecision:
        """The choice, graded in ``graded`` (the grading round): `cmtune.tuner.decision.search_decision`."""
        return search_decision(self.outcome(), graded)


def replay(space: SearchSpace, stored: Sequence[tuple[StepVariants, StepMeasurement | None, float | None]], **options
           ) -> StepSearch:
    """A `StepSearch` over ``space`` (``options`` as for it) with the ``stored`` search rounds recorded in order:
    ``(variants, measurement or None, wall seconds or None)`` each.  The caller asks the rebuilt search's
    `plan` whether what follows is a round or the grading."""
    search = StepSearch(space, **options)
    for variants, measurement, wall_s in stored:
        search.record(variants, measurement, wall_s=wall_s)
    return search
