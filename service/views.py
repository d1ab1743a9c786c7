"""Rows → public schemas (shared by the routers)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy.orm import Session

from collective_matmul import Decomposition
from service import repository as repo
from service.models import Study, Trial, Worker
from service.queue import search_settings
from service.schemas import BestSoFar, StudyPublic, TrialPublic, WorkerPublic


def study_public(session: Session, study: Study) -> StudyPublic:
    trials = repo.list_trials(session=session, study_id=study.id)
    search = [t for t in trials if t.kind == "search"]
    done = [t for t in search if t.state in ("completed", "failed")]
    ok = [t for t in done if t.status == "ok" and t.ratio is not None]
    best = min(ok, key=lambda t: t.ratio, default=None)
    settings = search_settings(study)
    tuned = None
    if study.state == "completed":
        row = repo.get_tuned(session=session, problem_id=study.problem_id, hardware_id=study.hardware_id)
        tuned = repo.to_tuned_config(row) if row is not None else None
    return StudyPublic(
        id=study.id, state=study.state, problem=repo.to_problem(study.problem),
        hardware=repo.to_hardware(study.hardware), settings=study.settings, space_size=study.space_size,
        trials_done=len(done), trials_budget=min(settings.max_trials or study.space_size, study.space_size),
        trials_running=sum(t.state == "leased" for t in trials),
        best=BestSoFar(decomposition=Decomposition.model_validate(best.decompositions[0]), ratio=best.ratio,
                       speedup=1 / best.ratio, trial_id=best.id) if best else None,
        tuned=tuned, stop_reason=study.stop_reason, message=study.message, created_at=study.created_at,
        started_at=study.started_at, finished_at=study.finished_at,
    )


def trial_public(trial: Trial) -> TrialPublic:
    first = (trial.measurements or [None])[0] if trial.kind == "search" else None
    candidate = (first or {}).get("candidate") or {}
    baseline = (first or {}).get("baseline") or {}
    return TrialPublic(
        id=trial.id, study_id=trial.study_id, number=trial.number, kind=trial.kind,
        decompositions=[Decomposition.model_validate(d) for d in trial.decompositions],
        decomposition_id=trial.decomposition_id, state=trial.state, attempts=trial.attempts, status=trial.status,
        ratio=trial.ratio, speedup=1 / trial.ratio if trial.ratio else None,
        median_s=candidate.get("median_s"), iqr_s=candidate.get("iqr_s"), baseline_s=baseline.get("median_s"),
        message=trial.message, worker_id=trial.worker_id, created_at=trial.created_at,
        finished_at=trial.finished_at,
    )


def worker_public(worker: Worker, *, current_trial_id: int | None, online_after: dt.datetime) -> WorkerPublic:
    return WorkerPublic(
        id=worker.id, name=worker.name, hardware=repo.to_hardware(worker.hardware), software=worker.software,
        registered_at=worker.registered_at, last_heartbeat=worker.last_heartbeat,
        online=worker.active and worker.last_heartbeat >= online_after, active=worker.active,
        current_trial_id=current_trial_id, trials_done=worker.trials_done,
    )
