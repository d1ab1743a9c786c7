"""Submissions: a model + mesh and the studies of its problems."""

from __future__ import annotations

from fastapi import APIRouter

from cmtune.service.deps import Id, ReaderDep, StoreDep
from cmtune.service.errors import NotFoundError, responses
from cmtune.service.lookup import bounds_fields
from cmtune.tuner.decision import step_decision
from cmtune.tuner.step_studies import step_task_configs
from collective_matmul.planning.models import MeshSpec
from collective_matmul.wire import (
    StepPublic,
    StudyState,
    SubmissionEntry,
    SubmissionPublic,
    SubmissionSummary,
)

router = APIRouter(prefix="/v1/submissions", tags=["submissions"], responses=responses(401, 403, 413, 503))


@router.get("", response_model=list[SubmissionSummary])
def list_submissions(store: StoreDep, _: ReaderDep) -> list[SubmissionSummary]:
    """The newest submitted models (100 at most)."""
    with store.read() as tx:
        return [SubmissionSummary(id=s.id, name=s.name, mesh=s.mesh, hardware=s.hardware, hardware_key=s.hardware.key,
                                  problems=len(s.entries), created_at=s.created_at)
                for s in tx.submissions.newest()]


@router.get("/{submission_id}", response_model=SubmissionPublic, responses=responses(404))
def get_submission(submission_id: Id, store: StoreDep, _: ReaderDep) -> SubmissionPublic:
    """Each role's problem, study and tuned config, and the estimated time saved per step."""
    with store.read() as tx:
        sub = tx.submissions.get(submission_id)
        if sub is None:
            raise NotFoundError(f"submission {submission_id} does not exist")
        states = {s.id: s.state for s in (tx.study(e.study_id) for e in sub.entries if e.study_id)}
        layers = int(sub.model.get("layers", 1))
        entries = []
        for e in sub.entries:
            config = tx.tuned_config(e.problem, sub.hardware.ring(e.problem.axis_size))  # where it was studied
            entries.append(SubmissionEntry(
                role=e.roles[0], roles=list(e.roles), count=e.count, problem=e.problem,
                problem_key=e.problem.key, study_id=e.study_id, study_state=states.get(e.study_id),
                decomposition=config.decomposition if config else None,
                decomposition_id=config.decomposition.id if config else None,
                speedup=config.speedup if config else None, speedup_iqr=config.speedup_iqr if config else None,
                time_s=config.time_s if config else None, baseline_s=config.baseline_s if config else None,
                trials=config.trials if config else None, space_size=config.space_size if config else None,
                saved_s_per_layer=e.count * (config.baseline_s - config.time_s) if config else None,
                saved_s_per_step=e.count * layers * (config.baseline_s - config.time_s) if config else None,
                **(bounds_fields(config) if config else {}),
            ))
        step = step_public(tx, tx.catalog.step_study_of(sub.id), layers)
        tensor = MeshSpec.model_validate(sub.mesh).tensor_size
        overrides = tx.catalog.overrides(model=sub.name, hardware=sub.hardware.ring(tensor))
    complete = bool(entries) and all(e.saved_s_per_layer is not None for e in entries)
    return SubmissionPublic(
        id=sub.id, name=sub.name, model=sub.model, mesh=sub.mesh, hardware=sub.hardware,
        hardware_key=sub.hardware.key, created_at=sub.created_at, entries=entries,
        layers=layers, complete=complete,
        saved_s_per_step=sum(e.saved_s_per_step for e in entries) if complete else None,
        step=step, overrides=overrides,
    )


def step_public(tx, study, layers: int) -> StepPublic | None:
    """A submission's step study as measured: the variant that runs, its speedups, the time it saves."""
    if study is None:
        return None
    rounds = [t for t in tx.trials(study.id, measurements=True) if t.step is not None]
    trial = rounds[0] if rounds else None  # the seeds' round (or the one round of the menu)
    measured = trial.step if trial is not None else None
    decision = study.decision if study.state == StudyState.COMPLETED else None
    if decision is None and measured is not None and study.state == StudyState.COMPLETED and trial.variants is None:
        # completed before decisions were stored (migration 0006): decide again from the stored measurement
        decision = step_decision(measured, step_task_configs(trial)).record
    variants, confirmation = (measured.variants, measured.confirmation) if measured else ([], [])
    if trial is not None and trial.variants is not None:  # a step search: a trial per round, then the grading
        graded = decision is not None and decision.fresh_rounds and len(rounds) > 1
        seen = {v.name for v in variants}
        for later in rounds[1:len(rounds) - graded]:  # each variant once, from the round that first timed it
            variants = variants + [v for v in later.step.variants if v.name not in seen]
            seen |= {v.name for v in later.step.variants}
        confirmation = rounds[-1].step.variants if graded else []
    return StepPublic(
        study_id=study.id, state=study.state, message=study.message, decision=decision,
        variant=decision.variant if decision else None, vs_reference=decision.vs_reference if decision else None,
        vs_baseline=decision.vs_baseline if decision else None,
        measured_saved_s_per_step=decision.saved_s * layers if decision and decision.saved_s is not None else None,
        reference=measured.reference if measured else None,
        mesh=measured.mesh if measured else None,
        batch=measured.block.global_batch if measured else None, variants=variants, confirmation=confirmation)
