"""Submissions: a model + mesh and the studies of its problems."""

from __future__ import annotations

from fastapi import APIRouter

from collective_matmul import Decomposition
from service import repository as repo
from service.deps import ReaderDep, SessionDep
from service.schemas import SubmissionEntry, SubmissionPublic, SubmissionSummary

router = APIRouter(prefix="/v1/submissions", tags=["submissions"])


@router.get("", response_model=list[SubmissionSummary])
def list_submissions(session: SessionDep, _: ReaderDep) -> list[SubmissionSummary]:
    """The newest submitted models (100 at most)."""
    return [SubmissionSummary(id=s.id, name=s.model.get("name", "model"), mesh=s.mesh,
                              hardware=repo.to_hardware(s.hardware), problems=len(s.entries), created_at=s.created_at)
            for s in repo.list_submissions(session=session)]


@router.get("/{submission_id}", response_model=SubmissionPublic)
def get_submission(submission_id: int, session: SessionDep, _: ReaderDep) -> SubmissionPublic:
    """Each role's problem, study and tuned speedup, and the estimated time saved per step."""
    sub = repo.get_submission(session=session, submission_id=submission_id)
    entries, saved, complete = [], 0.0, True
    for entry in sub.entries:
        tuned = repo.get_tuned(session=session, problem_id=entry.problem_id, hardware_id=sub.hardware_id)
        if tuned is None:
            complete = False
        else:
            saved += entry.count * (tuned.baseline_s - tuned.time_s)
        entries.append(SubmissionEntry(
            role=entry.roles[0], roles=entry.roles, count=entry.count, problem=repo.to_problem(entry.problem),
            study_id=entry.study_id or 0, study_state=entry.study.state if entry.study else "imported",
            speedup=tuned.speedup if tuned else None, time_s=tuned.time_s if tuned else None,
            baseline_s=tuned.baseline_s if tuned else None,
            decomposition=Decomposition.model_validate(tuned.decomposition) if tuned else None,
        ))
    layers = int(sub.model.get("layers", 1))
    return SubmissionPublic(
        id=sub.id, model=sub.model, mesh=sub.mesh, hardware=repo.to_hardware(sub.hardware),
        created_at=sub.created_at, entries=entries, layers=layers,
        saved_s_per_step=saved * layers if complete and entries else None,
    )
