"""Workers: register, heartbeat, lease, unregister, list."""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Response

from cmtune.service import leasing, reconfirming
from cmtune.service.deps import Id, ReaderDep, StateDep, WorkerDep, WorkerRoleDep
from cmtune.service.errors import responses
from cmtune.service.models import utcnow
from cmtune.service.views import json_response, worker_public
from collective_matmul.wire import (
    HeartbeatIn,
    HeartbeatOut,
    LeaseGranted,
    LeasePublic,
    WorkerCreate,
    WorkerPublic,
    WorkerRegistered,
)

router = APIRouter(prefix="/v1/workers", tags=["workers"], responses=responses(401, 403, 413, 503))


@router.post("", response_model=WorkerRegistered, status_code=201)
def register(body: WorkerCreate, state: StateDep, _: WorkerRoleDep) -> WorkerRegistered:
    """Register a worker; the answer holds its own ``credential`` (shown once), which every later call of
    this worker sends in the ``X-Cmtune-Worker`` header.  A worker of a software stack the service holds
    configs for only under other stacks of its hardware queues their re-confirmation on its stack
    (`cmtune.service.reconfirming`)."""
    now = utcnow()
    with state.store.write() as tx:
        hardware = body.hardware.to_hardware()
        # first: it locks the hardware's row (PostgreSQL), which the worker's row then refers to
        reconfirming.on_register(tx, state.engine, hardware, body.software, now=now)
        worker_id, credential = tx.workers.add(name=body.name, hardware=hardware, software=body.software,
                                               memory_bytes=body.memory_bytes, now=now)
        public = worker_public(tx.workers.get(worker_id), current_trial_id=None, online_after=_online_after(state))
        return WorkerRegistered(**dict(public), credential=credential)


@router.get("", response_model=list[WorkerPublic])
def list_workers(state: StateDep, _: ReaderDep, include_inactive: bool = False) -> list[WorkerPublic]:
    with state.store.read() as tx:
        current = tx.leases.current_trials()
        return [worker_public(w, current_trial_id=current.get(w.id), online_after=_online_after(state))
                for w in tx.workers.all(include_inactive=include_inactive)]


@router.post("/{worker_id}/heartbeat", response_model=HeartbeatOut, responses=responses(404))
def heartbeat(worker_id: Id, state: StateDep, _: WorkerDep, body: HeartbeatIn | None = None) -> HeartbeatOut:
    """Mark the worker alive; with ``lease_id``, extend that lease by the lease duration (if still live)."""
    with state.store.write() as tx:
        worker = tx.workers.get(worker_id)
        extended = leasing.heartbeat(tx, worker, body.lease_id if body else None, state.settings, utcnow())
        return HeartbeatOut(worker_id=worker.id, lease=LeasePublic(id=extended.id, expires_at=extended.expires_at)
                            if extended else None)


@router.post("/{worker_id}/lease", response_model=LeaseGranted,
             responses={204: {"description": "no trial to run"}, **responses(404)})
def lease(worker_id: Id, state: StateDep, _: WorkerDep):
    """Claim a trial whose hardware matches the worker's (204 when there is none)."""
    with state.store.write() as tx:
        granted = leasing.grant(tx, state.engine, state.settings, worker_id, utcnow())
    return json_response(granted) if granted is not None else Response(status_code=204)


@router.delete("/{worker_id}", status_code=204, responses=responses(404))
def unregister(worker_id: Id, state: StateDep, _: WorkerDep) -> Response:
    """The worker leaves: its leased trials go back to the queue."""
    with state.store.write() as tx:
        worker = tx.workers.get(worker_id)
        leasing.release_worker(tx, state.engine, worker.id)
        tx.workers.leave(worker.id)
    return Response(status_code=204)


def _online_after(state) -> dt.datetime:
    return utcnow() - dt.timedelta(seconds=state.settings.worker_offline_seconds)
