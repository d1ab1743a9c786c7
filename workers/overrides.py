"""A step searched locally (`cmtune verify --decide`): the step search's rounds on a step session, the tuner's
choice (made on process 0) said, and its per-role overrides written into a bundle, for the reference block and a
user's step alike.

`search_and_write_overrides` is the one procedure; what a kind of step says is its `StepPlan` (what process 0
searches, and what the overrides must fit) and how a round's variants become config sources:
`cmtune.workers.step.block_plan` and `fixed_sources` for the reference block, `cmtune.workers.userstep.user_step_plan`
and `UserSources` for a user's step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cmtune.workers.progress import Level, ProgressLine, Say, lines
from cmtune.workers.step_rounds import run_step_search
from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.planning.problem import Hardware, Problem


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What process 0 knows of a step to search."""

    model: str  # the overrides' model
    hardware: Hardware  # the ring's (the overrides' and the bound's)
    configs: dict[str, OpConfigs]  # the roles searched, each at its configs as tuned
    problems: dict[str, dict[str, Problem]]  # each searched role's problems, per slot
    history: list  # tuned configs of the bundle (any hardware): the runners-up, and the bound's tuned configs
    bound_problems: list[Problem]  # each collective matmul the step runs, for its bound
    others: dict[str, bool] = field(default_factory=dict)  # roles not searched: whether they run a ring
    ablation: bool = True
    # a user's step: every call of each role (its problems per slot), which an override must fit, and the problems
    # the overrides carry (None: the reference block's overrides carry none)
    calls: dict[str, list[dict[str, Problem]]] = field(default_factory=dict)
    override_problems: dict[str, dict[str, Problem]] | None = None


@dataclass(frozen=True)
class SearchBudget:
    """How far `cmtune verify --decide` searches: ``rounds`` search rounds of up to ``per_round`` variants."""

    rounds: int
    per_round: int


def search_and_write_overrides(group, session, plan: Callable[[], StepPlan], sources: Callable[[Mapping], dict], *,
                               bundle: Path, budget: SearchBudget, say: Say, **measure_options):
    """The step search on ``session`` to its grading, the tuner choosing on process 0 (``plan()`` is called there
    alone), and the choice's overrides written into ``bundle``.

    Args:
        sources: a round's variants (name -> per-role configs, None: the step as written) as ``session``'s config
            sources.
        say: called with the progress (on process 0 alone, by the caller's choice).
        measure_options: what ``session.measure`` takes besides (a user's step: its ``axis``).

    Returns:
        The first round's measurement (the fixed settings) with the grading rounds as its confirmation.
    """
    from cmtune.tuner.stepsearch import SearchSpace, StepSearch

    rounds, per_round = budget.rounds, budget.per_round
    planned = search = None
    if group.leader:
        planned = plan()
        space = SearchSpace.of(planned.configs, planned.problems, planned.hardware,
                               measured=lambda problem: measured_configs(planned.history, problem),
                               others=planned.others)
        search = StepSearch(space, rounds=rounds, per_round=per_round, ablation=planned.ablation, model=planned.model)

    def measure(variants):
        return session.measure(sources(variants), **measure_options, on_event=lines(say, Level.DETAIL))

    grading, measured = run_step_search(search, measure, group=group, say=lines(say, Level.ROUND))
    result = measured[0].model_copy(update={"confirmation": grading.variants if grading is not None else []}) \
        if measured else None
    if group.leader:
        write_overrides(search.decide(grading), planned, result, bundle, say)
    return result


def write_overrides(decision, plan: StepPlan, result, bundle: Path, say: Say) -> None:
    """Say what the tuner chose (``decision``: `cmtune.tuner.stepsearch.StepSearch.decide`'s) and the step against
    its bound, and write its overrides into ``bundle`` (those that fit every call of their role; the others are said
    and left out)."""
    from cmtune.tuner.step_studies import with_step_bound

    if not decision.ok:
        say(ProgressLine(f"no decision: {decision.summary}", Level.FAILURE))
        return
    software = result.hardware.software if plan.override_problems is not None else None
    overrides, dropped = [], []
    for override in decision.role_overrides(plan.model, plan.hardware, plan.override_problems, software=software):
        calls = plan.calls.get(override.role, [])
        if all(p.accepts(getattr(override.configs, slot)) for call in calls for slot, p in call.items()):
            overrides.append(override)
        else:
            dropped.append(override.role)
    save_overrides(bundle, plan.model, plan.hardware, overrides)
    say(ProgressLine(f"decision: {decision.summary}"))
    record = with_step_bound(decision.record, [tuned_here(plan.history, p, plan.hardware) for p in plan.bound_problems])
    if record is not None and record.bound is not None:
        say(ProgressLine(f"against its bound (one layer): {record.bound.summary}"))
    written = f": {', '.join(o.role for o in overrides)}" if overrides else " (the tuned configs run as they are)"
    say(ProgressLine(f"wrote {len(overrides)} per-role override(s) of {plan.model!r} on {plan.hardware.key} to "
                     f"{bundle}{written}"))
    if dropped:
        say(ProgressLine("not written (the decided configs do not fit every problem of the role): "
                         f"{', '.join(dropped)}", Level.WARNING))


# ---- the bundle --------------------------------------------------------------------------------


def tuned_here(history, problem, hardware):
    """``problem``'s tuned config on ``hardware`` in a bundle's entries (the one of this process's stack, else the
    newest of any: `collective_matmul.wire.lookup.from_tuned`'s exact-or-stale), None if it has none."""
    from collective_matmul.wire.lookup import by_problem, from_tuned

    here = [c for c in history if c.hardware.key == hardware.identity().key and c.problem == problem]
    found = from_tuned(problem, by_problem(here), hardware.software) if here else None
    return found[1] if found is not None and found[0] in ("exact", "stale") else None


def measured_configs(history, problem) -> list:
    """A problem's decompositions in a bundle (its entries on every hardware), the fastest first."""
    return [c.decomposition for c in sorted((c for c in history if c.problem == problem), key=lambda c: -c.speedup)]


def save_overrides(path: Path, model: str, hardware, overrides) -> None:
    """Replace ``model``'s overrides on ``hardware`` in the bundle at ``path`` by ``overrides`` (a new
    decision replaces the last one: a role it leaves alone runs its tuned configs again)."""
    from collective_matmul.wire.bundle import Bundle

    saved = Bundle.load(path) if path.exists() else Bundle()
    saved.overrides = [o for o in saved.overrides if not (o.model == model and o.hardware.key == hardware.key)]
    for override in overrides:
        saved.add_override(override)
    saved.save(path)
