"""Deciding a step locally (`cmtune verify --decide`): the step search on a step session, process 0 deciding, and
the choice's per-role overrides written into a bundle, for the reference block and a user's step alike.

`decide_step` is the one procedure; what a kind of step says is its `StepPlan` (what process 0 searches, and what
the overrides must fit) and how a round's variants become config sources: `block_plan` and `fixed_sources` for the
reference block, `user_step_plan` and `UserSources` for a user's step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.planning.problem import Hardware, Problem


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What process 0 knows of a step to decide."""

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


def decide_step(group, session, plan: Callable[[], StepPlan], sources: Callable[[Mapping], dict], *, bundle: Path,
                rounds: int, per_round: int, say: Callable[[str], None], **measure_options):
    """The step search on ``session`` to its grading, process 0 deciding (``plan()`` is called there alone), and the
    choice's overrides written into ``bundle``.

    Args:
        sources: a round's variants (name -> per-role configs, None: the step as written) as ``session``'s config
            sources.
        measure_options: what ``session.measure`` takes besides (a user's step: its ``axis``).

    Returns:
        The first round's measurement (the fixed settings) with the grading rounds as its confirmation.
    """
    from cmtune.tuner.stepsearch import SearchSpace, StepSearch
    from cmtune.workers.step import search_step

    planned = search = None
    if group.leader:
        planned = plan()
        space = SearchSpace.of(planned.configs, planned.problems, planned.hardware,
                               measured=lambda problem: measured_configs(planned.history, problem),
                               others=planned.others)
        search = StepSearch(space, rounds=rounds, per_round=per_round, ablation=planned.ablation, model=planned.model)

    def measure(variants):
        return session.measure(sources(variants), **measure_options, on_event=lambda line: say(f"[dim]{line}[/dim]"))

    grading, measured = search_step(search, measure, group=group, say=lambda line: say(f"[bold]{line}[/bold]"))
    result = measured[0].model_copy(update={"confirmation": grading.variants if grading is not None else []}) \
        if measured else None
    if group.leader:
        write_decision(search.decide(grading), planned, result, bundle, say)
    return result


def write_decision(decision, plan: StepPlan, result, bundle: Path, say: Callable[[str], None]) -> None:
    """Say what the search chose and the step against its bound, and write its overrides into ``bundle`` (those
    that fit every call of their role; the others are said and left out)."""
    from cmtune.tuner.step_studies import with_step_bound

    if not decision.ok:
        say(f"[red]no decision: {decision.summary}[/red]")
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
    say(f"decision: {decision.summary}")
    record = with_step_bound(decision.record, [tuned_here(plan.history, p, plan.hardware) for p in plan.bound_problems])
    if record is not None and record.bound is not None:
        say(f"against its bound (one layer): {record.bound.summary}")
    say(f"wrote {len(overrides)} per-role override(s) of {plan.model!r} on {plan.hardware.key} to {bundle}"
        + (f": {', '.join(o.role for o in overrides)}" if overrides else " (the tuned configs run as they are)"))
    if dropped:
        say(f"[yellow]not written (the decided configs do not fit every problem of the role): "
            f"{', '.join(dropped)}[/yellow]")


# ---- the reference block ---------------------------------------------------------------------


def block_plan(block, spec, layout, configs: dict[str, OpConfigs], bundle: Path, *, ablation: bool) -> StepPlan:
    """The reference block as submitted on ``spec`` (measured on ``layout``), searched from its tuned ``configs``
    with the bundle's entries for its problems (any hardware) as the runners-up."""
    from collective_matmul.client.tuned import ring_hardware
    from collective_matmul.planning.models import role_problems
    from collective_matmul.wire.bundle import Bundle

    problems = role_problems(block, spec)
    return StepPlan(model=block.name, hardware=ring_hardware(layout.mesh, layout.axis).identity(), configs=configs,
                    problems=problems, history=Bundle.load(bundle).configs, ablation=ablation,
                    bound_problems=[p for slots in problems.values() for p in slots.values()])


# ---- a user's step ---------------------------------------------------------------------------


def user_step_plan(tuned, per_role: Mapping[str, list[OpConfigs]], model: str) -> StepPlan:
    """A user's step as its `Tuned` client traced it (process 0's): each role searched from the configs of its
    first call, as the drop-in resolved them.

    A role seen with several problems is not searched (no one set of configs fits them all): it runs as tuned,
    and is only set back or put on the fixed ring whole, and gets an override only where its configs fit every
    one of its problems.
    """
    uniform = {role: configs[0] for role, configs in per_role.items() if len(configs) == 1}
    others = {role: any(not c.is_baseline for c in configs) for role, configs in per_role.items() if len(configs) > 1}
    sites: dict[str, list] = {}
    for site in tuned.report().applied:
        sites.setdefault(site.role, []).append(site)
    return StepPlan(model=model, hardware=next(iter(sites.values()))[0].hardware, configs=uniform,
                    problems={role: sites[role][0].problems for role in uniform}, others=others,
                    history=tuned.bundle.configs if tuned.bundle is not None else [],
                    bound_problems=[p for site in tuned.report().applied for p in site.problems.values()],
                    calls={role: [site.problems for site in calls] for role, calls in sites.items()},
                    override_problems={role: calls[0].problems for role, calls in sites.items()})


class UserSources:
    """A round's variants of a user's step as config sources: ``tuned`` itself, or a variant of it with the round's
    configs; one source per name (a variant timed again is not built again)."""

    def __init__(self, tuned):
        self.tuned, self.sources = tuned, {}

    def __call__(self, variants: Mapping) -> dict:
        for name, setting in variants.items():
            if name not in self.sources:
                self.sources[name] = None if setting is None else self.tuned if name == "tuned" else \
                    self.tuned.variant(name, lambda role, c, setting=setting: setting.get(role, c))
        return {name: self.sources[name] for name in variants}


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
