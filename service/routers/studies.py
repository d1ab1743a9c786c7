"""Studies: create from a problem or a model + mesh, list, inspect, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from collective_matmul import MeshSpec, TransformerBlock, model_problems
from service import repository as repo
from service.deps import AdminDep, DatabaseDep, ReaderDep, SessionDep
from service.errors import InvalidError
from service.queue import default_budget, space_size
from service.schemas import StudyCreate, StudyCreated, StudyPage, StudyPublic, TrialPublic
from service.views import study_public, trial_public
from tuner.measure import Protocol
from tuner.search import SearchSettings

router = APIRouter(prefix="/v1/studies", tags=["studies"])


@router.post("", response_model=StudyCreated, status_code=201)
def create_studies(body: StudyCreate, db: DatabaseDep, _: AdminDep) -> StudyCreated:
    """One study per unique problem; problems already tuned or under study are skipped unless ``force``."""
    hardware = body.hardware.to_hardware()
    if body.problem is not None:
        targets = [(body.problem, ["problem"], 1)]
        model = mesh = None
    else:
        try:
            model = body.model if isinstance(body.model, TransformerBlock) else TransformerBlock.load(body.model)
            mesh = MeshSpec(axes=body.mesh.axes, tensor_axis=body.mesh.tensor_axis)
            targets = [(mp.problem, list(mp.roles), mp.count) for mp in model_problems(model, mesh)]
        except ValueError as exc:
            raise InvalidError(str(exc)) from None
    for problem, _roles, _count in targets:
        if problem.axis_size != hardware.device_count:
            raise InvalidError(
                f"{problem.key} is a ring of {problem.axis_size} devices but the hardware has device_count="
                f"{hardware.device_count}; tune each ring on hardware of its size")
    created, skipped = [], []
    with db.session(write=True) as session:
        hw_row = repo.get_or_create_hardware(session=session, hardware=hardware)
        submission = None
        if model is not None:
            submission = repo.create_submission(session=session, model=model.model_dump(mode="json"),
                                                mesh=mesh.model_dump(mode="json"), hardware=hw_row)
        for problem, roles, count in targets:
            problem_row = repo.get_or_create_problem(session=session, problem=problem)
            existing = None if body.force else repo.find_open_study(session=session, problem=problem_row,
                                                                    hardware=hw_row)
            tuned = None if body.force else repo.get_tuned(session=session, problem_id=problem_row.id,
                                                           hardware_id=hw_row.id)
            if existing is not None or tuned is not None:
                study_id = existing.id if existing is not None else tuned.study_id
                skipped.append({"problem": problem.key, "study_id": study_id,
                                "reason": "under study" if existing is not None and existing.state != "completed"
                                else "already tuned"})
            else:
                size = space_size(problem)
                settings = SearchSettings(
                    sampler=body.sampler, seed=body.seed,
                    max_trials=body.budget.trials or default_budget(size),
                    max_seconds=body.budget.minutes * 60 if body.budget.minutes else None,
                    patience=body.budget.patience, confirm_top=body.confirm_top,
                )
                study = repo.create_study(
                    session=session, problem=problem_row, hardware=hw_row,
                    settings=settings.model_dump(mode="json"),
                    protocol=Protocol(repeats=body.repeats, seed=body.seed).model_dump(mode="json"),
                    space_size=size,
                )
                created.append(study)
                study_id = study.id
            if submission is not None:
                repo.link_submission(session=session, submission=submission, study_id=study_id,
                                     problem=problem_row, roles=roles, count=count)
        session.flush()
        return StudyCreated(studies=[study_public(session, s) for s in created],
                            submission_id=submission.id if submission else None, skipped=skipped)


@router.get("", response_model=StudyPage)
def list_studies(
    session: SessionDep, _: ReaderDep,
    state: Annotated[
        str | None, Query(description="pending, running, confirming, completed, cancelled, failed")
    ] = None,
    hardware: Annotated[str | None, Query(description="hardware key, e.g. cpu:cpu:8:1")] = None,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> StudyPage:
    rows, total = repo.list_studies(session=session, state=state, hardware_key=hardware, offset=offset, limit=limit)
    return StudyPage(items=[study_public(session, s) for s in rows], total=total, offset=offset, limit=limit)


@router.get("/{study_id}", response_model=StudyPublic)
def get_study(study_id: int, session: SessionDep, _: ReaderDep) -> StudyPublic:
    return study_public(session, repo.get_study(session=session, study_id=study_id))


@router.get("/{study_id}/trials", response_model=list[TrialPublic])
def list_trials(study_id: int, session: SessionDep, _: ReaderDep) -> list[TrialPublic]:
    repo.get_study(session=session, study_id=study_id)
    return [trial_public(t) for t in repo.list_trials(session=session, study_id=study_id)]


@router.post("/{study_id}/cancel", response_model=StudyPublic)
def cancel_study(study_id: int, db: DatabaseDep, _: AdminDep) -> StudyPublic:
    from service.queue import cancel

    with db.session(write=True) as session:
        study = repo.get_study(session=session, study_id=study_id, lock=True)
        cancel(session=session, study=study)
        session.flush()
        return study_public(session, study)
