"""Workers: register, heartbeat, lease, unregister, list."""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Response

from collective_matmul import Decomposition
from service import repository as repo
from service.deps import DatabaseDep, ReaderDep, SessionDep, StateDep, WorkerRoleDep
from service.models import utcnow
from service.queue import lease_for, trial_protocol
from service.schemas import (
    HeartbeatIn,
    HeartbeatOut,
    LeaseGranted,
    LeasePublic,
    TrialTask,
    WorkerCreate,
    WorkerPublic,
)
from service.views import worker_public

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.post("", response_model=WorkerPublic, status_code=201)
def register(body: WorkerCreate, state: StateDep, _: WorkerRoleDep) -> WorkerPublic:
    with state.db.session(write=True) as session:
        hw = repo.get_or_create_hardware(session=session, hardware=body.hardware.to_hardware())
        worker = repo.create_worker(session=session, name=body.name, hardware=hw, software=body.software)
        session.refresh(worker)
        return worker_public(worker, current_trial_id=None, online_after=_online_after(state))


@router.get("", response_model=list[WorkerPublic])
def list_workers(session: SessionDep, state: StateDep, _: ReaderDep, include_inactive: bool = False):
    current = repo.current_trials(session=session)
    return [worker_public(w, current_trial_id=current.get(w.id), online_after=_online_after(state))
            for w in repo.list_workers(session=session, include_inactive=include_inactive)]


@router.post("/{worker_id}/heartbeat", response_model=HeartbeatOut)
def heartbeat(worker_id: int, state: StateDep, _: WorkerRoleDep, body: HeartbeatIn | None = None) -> HeartbeatOut:
    """Mark the worker alive; with ``lease_id``, extend that lease by the lease duration."""
    now = utcnow()
    with state.db.session(write=True) as session:
        worker = repo.get_worker(session=session, worker_id=worker_id)
        worker.last_heartbeat = now
        extended = None
        if body is not None and body.lease_id:
            lease = repo.get_lease(session=session, lease_id=body.lease_id, lock=True)
            if lease is not None and lease.worker_id == worker.id and lease.active:
                lease.expires_at = now + dt.timedelta(seconds=state.settings.lease_seconds)
                extended = LeasePublic(id=lease.id, expires_at=lease.expires_at)
        return HeartbeatOut(worker_id=worker.id, lease=extended)


@router.post("/{worker_id}/lease", response_model=LeaseGranted, responses={204: {"description": "no trial to run"}})
def lease(worker_id: int, state: StateDep, _: WorkerRoleDep):
    """Claim a trial whose hardware matches the worker's (204 when there is none)."""
    with state.db.session(write=True) as session:
        worker = repo.get_worker(session=session, worker_id=worker_id)
        worker.last_heartbeat = utcnow()
        claimed = lease_for(session=session, worker=worker, settings=state.settings)
        if claimed is None:
            return Response(status_code=204)
        lease_row, trial, study = claimed
        decompositions = [Decomposition.model_validate(d) for d in trial.decompositions]
        return LeaseGranted(
            lease=LeasePublic(id=lease_row.id, expires_at=lease_row.expires_at),
            trial=TrialTask(
                id=trial.id, study_id=study.id, kind=trial.kind, problem=repo.to_problem(study.problem),
                decomposition=decompositions[0] if trial.kind == "search" else None,
                decompositions=decompositions, protocol=trial_protocol(study, trial),
            ),
        )


@router.delete("/{worker_id}", status_code=204)
def unregister(worker_id: int, db: DatabaseDep, _: WorkerRoleDep) -> Response:
    """The worker leaves: its leased trials go back to the queue."""
    with db.session(write=True) as session:
        worker = repo.get_worker(session=session, worker_id=worker_id)
        repo.release_worker_leases(session=session, worker_id=worker.id)
        worker.active = False
    return Response(status_code=204)


def _online_after(state) -> dt.datetime:
    return utcnow() - dt.timedelta(seconds=state.settings.worker_offline_seconds)
