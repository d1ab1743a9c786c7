"""The step study's part of the lifecycle: a submitted model's whole training step, tuned vs baseline.

A step study (`Stepping.create`) waits until the search studies it depends on are final (a search study that
ends wakes it: `wake_step_studies`), then searches its per-role configs with the step as the objective.  The
search policy is `cmtune.tuner.stepsearch` and the decision `cmtune.tuner.decision`; this module stores them:

1. Each round is one step trial naming exactly the variants to time (each with its per-role configs).  When its
   result comes (`Stepping.record`), the search is rebuilt from the stored rounds (`replay`), records it, and
   queues the next round; once the search stops, the study is ``confirming`` and a last trial grades the choice
   in fresh rounds.  A round without a result is left out and the search goes on (the first round's failure
   fails the study).  Candidates per slot are each problem's best search trials (`Stepping.space`).
2. With a budget of one round, one trial times the standard menu (`cmtune.tuner.variants.variant_configs`) and
   the worker grades `step_decision`'s choice itself.
3. Either way the choice's changes become per-model, per-role overrides (`RoleOverride`) with their reasons,
   and the study records the measured speedup of what will run (`StepChoice`, with the step's bound:
   `with_step_bound`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence

from cmtune.tuner.decision import StepDecision, step_decision
from cmtune.tuner.errors import InvalidError
from cmtune.tuner.search import SearchSettings
from cmtune.tuner.states import StopReason, move_study, move_trial
from cmtune.tuner.stepsearch import PlanKind, SearchSpace, StepSearch, replay
from cmtune.tuner.store import StepStudySpec, StoreTx, StudyRecord, TrialRecord
from cmtune.tuner.variants import variant_configs
from collective_matmul.planning.decomposition import Decomposition, OpConfigs
from collective_matmul.planning.models import ROLES, SLOTS, MeshSpec, TransformerBlock, role_problems
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import (
    STEP_ROUND_VARIANTS,
    STEP_SEARCH_ROUNDS,
    MeasurementProtocol,
    Status,
    StepChoice,
    StepMeasurement,
    StepResult,
    StepTask,
    StudyKind,
    StudyState,
    TrialKind,
    TrialState,
    TrialTask,
)
from collective_matmul.wire.bounds import step_bound
from collective_matmul.wire.bundle import TunedConfig
from collective_matmul.wire.lookup import weight_gradient

S, T = StudyState, TrialState
STEP_CANDIDATES = 3  # a problem's best search trials a step search considers per slot (the winner among them)


class Stepping:
    """The step study's part of the lifecycle (the engine dispatches a study of kind ``step`` here)."""

    def create(self, tx: StoreTx, *, block: TransformerBlock, mesh: MeshSpec, hardware: Hardware,
               depends_on: Sequence[int], protocol: MeasurementProtocol, now: dt.datetime,
               submission_id: int | None = None,
               ablation: bool = True, search_rounds: int = STEP_SEARCH_ROUNDS,
               round_variants: int = STEP_ROUND_VARIANTS, software: Software | None = None) -> StudyRecord:
        """A new step study, its first trial queued if its search studies are final (`Engine.create_step_study`)."""
        role_problems(block, mesh)  # the model must fit the mesh (ValueError otherwise)
        spec = StepStudySpec(block, mesh, tuple(depends_on), ablation, max(search_rounds, 1), round_variants)
        study = tx.add_study(problem=None, hardware=hardware.identity(), settings=SearchSettings(), protocol=protocol,
                             space_size=0, now=now, kind=StudyKind.STEP, submission_id=submission_id, step=spec,
                             software=software)
        self.refill(tx, study, now=now)
        return tx.study(study.id)

    def refill(self, tx: StoreTx, study: StudyRecord, *, now: dt.datetime,
               trials: Sequence[TrialRecord] | None = None) -> list[TrialRecord]:
        """Queue the first step trial once every search study it depends on is final: the search's first
        round (the seeds), or one round of the standard menu.  Later rounds are queued as results come."""
        if study.state != S.PENDING or tx.trials(study.id):
            return []
        if any(tx.study(d).state.active for d in study.step.depends_on):
            return []
        configs = self.configs(tx, study)
        flat = _flat(configs)
        if not study.step.searches:
            return tx.add_trials(study.id, TrialKind.STEP, [flat], now, after=0)
        first = self._search(tx, study, (), winners=configs).plan()
        return tx.add_trials(study.id, TrialKind.STEP, [flat], now, after=0, variants=[first.variants])

    def record(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, result: StepResult, *, now: dt.datetime,
               lease_id: str | None) -> TrialRecord:
        """Store a step trial's measurement: a search round's (the search goes on, or grades, or concludes), or
        the one round of the menu (the study concludes with the worker's grading).

        Raises:
            InvalidError: ``result`` is not a step measurement of this trial (`_check_step_result`).
        """
        step = result.step
        configs = step_task_configs(trial)
        problems = _check_step_result(study, trial, step, configs)
        if trial.variants is not None:
            done = self._advance(tx, study, trial, step, now=now, lease_id=lease_id, problems=problems)
            return dataclasses.replace(trial, **done)
        decision = step_decision(step, configs)  # one round of the menu, graded by the worker
        done = _complete(tx, trial, step, ok=decision.ok, ratio=decision.ratio, message=decision.summary, now=now,
                         lease_id=lease_id)
        if study.state.active:
            self._conclude(tx, study, trial, decision, problems, now=now, stop_reason=StopReason.MEASURED,
                           software=study.software or step.hardware.software)
        return dataclasses.replace(trial, **done)

    def abandon(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, *, message: str, now: dt.datetime) -> None:
        """A step trial failed without a result: the study fails if it was its only or first round; else the
        search goes on without it."""
        if trial.variants is None or trial.number == 1:
            move_study(tx, study, S.FAILED, finished_at=now,
                       message=f"the step measurement got no result: {message}"[:2000])
        else:
            self._advance(tx, study, trial, None, now=now)

    def cancelled(self, tx: StoreTx, study: StudyRecord, *, now: dt.datetime) -> None:
        """Nothing waits for a step study."""

    @staticmethod
    def task(study: StudyRecord, trial: TrialRecord) -> TrialTask:
        """What a worker runs for a step trial: the study's block and mesh with the trial's configs and variants."""
        spec = study.step
        return TrialTask(id=trial.id, study_id=study.id, kind=trial.kind, problem=None, decomposition=None,
                         decompositions=list(trial.decompositions), protocol=study.protocol,
                         step=StepTask(block=spec.block, mesh=spec.mesh.axes, tensor_axis=spec.mesh.tensor_axis,
                                       configs=step_task_configs(trial), ablation=spec.ablation,
                                       variants=trial.variants))

    def configs(self, tx: StoreTx, study: StudyRecord) -> dict[str, OpConfigs]:
        """Each role's tuned configs for a step study: the tuned decomposition of each of its problems.

        A problem without a tuned config runs the baseline; a weight gradient what
        `collective_matmul.wire.lookup.weight_gradient` makes of its tuned config (a tuned ring runs unfused: the
        step trial also times it fused).  A step study of one stack takes that stack's configs (another's
        newest where it has none); of none, the newest of any stack.
        """
        configs = {}
        for role, problems in role_problems(study.step.block, study.step.mesh).items():
            chosen = {}
            for slot, problem in problems.items():
                tuned = _tuned(tx, study, problem)
                found = tuned.decomposition if tuned is not None else None
                chosen[slot] = weight_gradient(found) if slot == "grad_weight" else found or Decomposition.baseline()
            configs[role] = OpConfigs(**chosen)
        return configs

    def space(self, tx: StoreTx, study: StudyRecord, winners: dict[str, OpConfigs] | None = None) -> SearchSpace:
        """What a step study's search chooses from: each role's tuned configs, and per slot the candidates of
        `cmtune.tuner.variants.slot_candidates` (the problem's best ring search trials as runners-up), the
        cost model's whole-step choice beside them."""
        return SearchSpace.of(winners or self.configs(tx, study), role_problems(study.step.block, study.step.mesh),
                              study.hardware, measured=lambda problem: tx.best_search_trials(
                                  problem, study.hardware, limit=STEP_CANDIDATES))

    def _search(self, tx: StoreTx, study: StudyRecord, rounds: Sequence[TrialRecord], *,
                winners: dict[str, OpConfigs]) -> StepSearch:
        """The step study's search, rebuilt from its finished ``rounds`` (step trials, in number order); a round's
        wall time runs from the one before it finished (the first's is not counted)."""
        stored, previous = [], None
        for trial in rounds:
            wall = (trial.finished_at - previous).total_seconds() if previous and trial.finished_at else None
            stored.append((trial.variants or {}, trial.step if trial.state == T.COMPLETED else None, wall))
            previous = trial.finished_at
        return replay(self.space(tx, study, winners), stored, rounds=study.step.search_rounds,
                      per_round=study.step.round_variants, ablation=study.step.ablation, model=study.step.block.name)

    def _advance(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, result: StepMeasurement | None, *,
                 now: dt.datetime, lease_id: str | None = None,
                 problems: dict[str, dict[str, Problem]] | None = None) -> dict:
        """A search round's result (None: the round got none, and is failed already): rebuild the search from the
        rounds before it, record it, and queue the next round or the grading; or, when this trial was the
        grading, complete the study with the choice.  Returns the trial's changes (none when it had failed)."""
        earlier = [t for t in tx.trials(study.id, measurements=True)
                   if t.kind == TrialKind.STEP and t.number < trial.number and t.state in (T.COMPLETED, T.FAILED)]
        winners = step_task_configs(trial)
        search = self._search(tx, study, earlier, winners=winners)
        problems = problems or role_problems(study.step.block, study.step.mesh)
        done: dict = {}
        if search.plan().kind == PlanKind.GRADE:
            decision = search.decide(result)
            if result is not None:
                done = _complete(tx, trial, result, ok=decision.ok, ratio=decision.ratio, message=decision.summary,
                                 now=now, lease_id=lease_id)
            if study.state.active:
                self._conclude(tx, study, trial, decision, problems, now=now, stop_reason=None,
                               software=study.software or (result.hardware.software if result else None))
            return done
        previous = earlier[-1].finished_at if earlier else None
        search.record(trial.variants, result, wall_s=(now - previous).total_seconds() if previous else None)
        if result is not None:
            ratio = next((v.ratio for v in result.variants if v.name == search.incumbent and v.ok), None)
            done = _complete(tx, trial, result, ok=search.failure is None, ratio=ratio, message=search.summary(),
                             now=now, lease_id=lease_id)
        if not study.state.active:
            return done
        tx.update_study(study.id, trials_done=len(search.rounds))
        plan = search.plan()
        if plan.kind == PlanKind.FAILED:
            move_study(tx, study, S.FAILED, finished_at=now, message=plan.reason[:2000])
            return done
        if plan.kind == PlanKind.GRADE:
            move_study(tx, study, S.CONFIRMING, stop_reason=plan.stop)
        tx.add_trials(study.id, TrialKind.STEP, [_flat(winners)], now, after=trial.number, variants=[plan.variants])
        return done

    @staticmethod
    def _conclude(tx: StoreTx, study: StudyRecord, trial: TrialRecord, decision: StepDecision,
                  problems: dict[str, dict[str, Problem]], *, now: dt.datetime, stop_reason: StopReason | None,
                  software: Software | None) -> None:
        """Complete a step study with its decision (its overrides replace the model's, and say which stack,
        ``software``, decided them), or fail it."""
        study = tx.study(study.id, lock=True)
        if not decision.ok:
            move_study(tx, study, S.FAILED, finished_at=now, message=decision.summary[:2000])
            return
        model = study.step.block.name
        tx.save_overrides(model, study.hardware, decision.role_overrides(model, study.hardware, problems,
                                                                         software=software))
        tx.update_study(study.id, best_ratio=decision.ratio, best_trial_id=trial.id, trials_done=trial.number)
        record = with_step_bound(decision.record, [_tuned(tx, study, p)
                                                   for slots in problems.values() for p in slots.values()])
        move_study(tx, study, S.COMPLETED, finished_at=now, message=decision.summary[:2000],
                   decision=record, **({"stop_reason": stop_reason} if stop_reason else {}))


def step_study_of(tx: StoreTx, *, block: TransformerBlock, mesh: MeshSpec, hardware: Hardware) -> StudyRecord | None:
    """The step study of this model (block and mesh) on ``hardware`` that is not final, if any: one
    measures a model at a time, and an identical submission joins it."""
    return next((s for s in tx.active_step_studies(hardware) if s.step.block == block and s.step.mesh == mesh), None)


def wake_step_studies(tx: StoreTx, hardware: Hardware, *, now: dt.datetime) -> None:
    """Queue the first trial of each step study on ``hardware`` whose search studies are all final now."""
    for waiting in tx.waiting_step_studies(hardware):
        Stepping().refill(tx, waiting, now=now)


def step_task_configs(trial: TrialRecord) -> dict[str, OpConfigs]:
    """A step trial's per-role tuned configs (stored flat: role by role, forward, grad_input, grad_weight)."""
    flat = list(trial.decompositions)
    return {role: OpConfigs(**dict(zip(SLOTS, flat[i * 3:(i + 1) * 3], strict=True))) for i, role in enumerate(ROLES)}


def with_step_bound(record: StepChoice | None, tuned: Sequence[TunedConfig | None]) -> StepChoice | None:
    """``record`` with the step's own bound (`collective_matmul.wire.bounds.step_bound`): ``tuned`` holds the tuned
    config of each collective matmul one layer of the step runs (None: not tuned, left out), against the graded
    rounds' all-baseline and chosen steps; unchanged where those rounds did not time the all-baseline step."""
    if record is None or record.saved_s is None or record.time_s is None:
        return record
    entries = [(1, config) for config in tuned if config is not None]
    if not entries:
        return record
    return record.model_copy(update={"bound": step_bound(entries, record.time_s + record.saved_s, record.time_s)})


def _flat(configs: dict[str, OpConfigs]) -> list[Decomposition]:
    """Per-role configs as a step trial stores them (`step_task_configs` reads them back)."""
    return [getattr(configs[role], slot) for role in ROLES for slot in SLOTS]


def _complete(tx: StoreTx, trial: TrialRecord, result: StepMeasurement, *, ok: bool, ratio: float | None,
              message: str, now: dt.datetime, lease_id: str | None) -> dict:
    """Complete a step trial with its measurement (``ok``: whether it decided, or the search goes on); the
    trial's changes."""
    done = dict(state=T.COMPLETED, status=Status.OK if ok else Status.ERROR, ratio=ratio, step=result,
                message=message[:2000], finished_at=now, result_lease_id=lease_id)
    move_trial(tx, trial, **done)
    return done


def _tuned(tx: StoreTx, study: StudyRecord, problem: Problem) -> TunedConfig | None:
    """The tuned config a step study runs for ``problem``: its stack's (another's newest where it has none);
    of no stack, the newest of any."""
    return ((study.software is not None and tx.tuned_config(problem, study.hardware, study.software))
            or tx.tuned_config(problem, study.hardware))


def _check_step_result(study: StudyRecord, trial: TrialRecord, result: StepMeasurement,
                       configs: dict[str, OpConfigs]) -> dict[str, dict[str, Problem]]:
    """A step result decides what a model runs: it must measure this study's block, only the variants
    the trial asked for (a search round's own, or the standard menu of ``configs``) with the configs it
    gave them, each config fitting its role's problem.  Its ratios were checked against its samples
    where it was parsed (`StepMeasurement`).

    Returns:
        the block's problems by role and slot.

    Raises:
        InvalidError: naming the first thing that does not hold.
    """
    if result.block is None or result.block.name != study.step.block.name:
        raise InvalidError(f"trial {trial.id} measures the block {study.step.block.name!r}: send its 'block'")
    problems = role_problems(study.step.block, study.step.mesh)
    asked = trial.variants if trial.variants is not None else variant_configs(configs, ablation=study.step.ablation)
    if trial.variants is not None and result.confirmation:
        raise InvalidError(f"trial {trial.id} is a round of the step search: it asks for no confirmation (the "
                           "grading is a trial of its own); leave 'confirmation' empty")
    measured = {v.name for v in result.variants}
    for variant in [*result.variants, *result.confirmation]:
        for role, role_configs in variant.configs.items():
            if role not in problems:
                raise InvalidError(f"trial {trial.id}: variant {variant.name} has configs for {role!r}, which is "
                                   f"not a role of the block ({', '.join(problems)})")
            for slot in SLOTS:
                try:
                    problems[role][slot].check(getattr(role_configs, slot))
                except ValueError as exc:
                    raise InvalidError(f"trial {trial.id}: variant {variant.name}, {role} {slot}: {exc}") from None
        if variant.name not in asked:
            raise InvalidError(f"trial {trial.id} asked for the variants {', '.join(asked)}: "
                               f"{variant.name!r} is not one of them")
        if variant.configs != (asked[variant.name] or {}):
            raise InvalidError(f"trial {trial.id}: variant {variant.name} measured other configs than the trial "
                               "gave it")
        if variant.name not in measured:
            raise InvalidError(f"trial {trial.id}: the confirmation re-times {variant.name}, which the rounds "
                               "did not measure")
    return problems
