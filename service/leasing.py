"""Leasing: how workers claim the engine's trials, keep them alive, give them back and report.

The engine (`cmtune.tuner.engine`) owns the study lifecycle; this module adds the leasing policy over
the store's leases (``tx.leases``, `cmtune.service.store.leases`, which holds every statement):

1. A lease request claims the oldest pending trial of the active studies on the worker's
   hardware or one of its rings (`Hardware.rings`: a worker of N devices tunes every ring whose size
   divides N, all such rings at once) and leases it (`Leases.claim_leased`: one ``FOR UPDATE SKIP
   LOCKED`` statement on PostgreSQL, its hardware keys an IN list; SQLite's write transaction is
   exclusive); the first claim starts its study
   (`Engine.claimed`).  The engine queues proposals in advance, so a lease is a claim, never an
   ask.  Only a study with nothing in flight at all (e.g. one created by an older version) is
   refilled on the spot.
2. Expired leases give their trials back (the attempt counts; a trial whose leases expired
   ``max_attempts`` times is abandoned with that reason and its study goes on).  Expiry is
   checked at most every `expiry_interval` on the lease path, and always for the lease a result
   arrives under: a late result is refused.
3. A result is accepted only under the lease that holds the trial; the same report twice is
   harmless.  A heartbeat extends a live lease of its own worker, never an expired one.
"""

from __future__ import annotations

import datetime as dt
import functools
import threading
import time
from dataclasses import dataclass

from cmtune.service.settings import Settings
from cmtune.service.store import LeaseInfo, SqlTx, WorkerInfo
from cmtune.tuner.engine import Engine, task_for
from cmtune.tuner.errors import ConflictError, InvalidError
from cmtune.tuner.store import TrialRecord
from collective_matmul.planning.problem import Hardware
from collective_matmul.wire import (
    LeaseGranted,
    LeasePublic,
    Status,
    TrialKind,
    TrialResult,
    TrialState,
    TrialTask,
)

LEASE_TOUCH_SECONDS = 2.0  # a lease marks its worker alive at most this often (per server process)
_expiry_lock = threading.Lock()
_last_expiry = 0.0


def expiry_interval(settings: Settings) -> float:
    """How often (seconds) the lease path looks for expired leases."""
    return min(1.0, settings.lease_seconds / 4)


def expire(tx: SqlTx, engine: Engine, settings: Settings, now: dt.datetime, *, force: bool = False) -> int:
    """Give the trials of expired leases back (or abandon them after ``max_attempts``)."""
    global _last_expiry
    with _expiry_lock:
        if not force and time.monotonic() - _last_expiry < expiry_interval(settings):
            return 0
        _last_expiry = time.monotonic()
    expired = tx.leases.active(expired_before=now)
    for lease in expired:
        _expire_one(tx, engine, settings, lease, now)
    return len(expired)


def _expire_one(tx: SqlTx, engine: Engine, settings: Settings, lease: LeaseInfo, now: dt.datetime) -> None:
    tx.leases.close(lease.id)
    trial = tx.trial(lease.trial_id, lock=True)
    if trial.state != TrialState.LEASED:
        return
    if trial.attempts >= settings.max_attempts:
        engine.abandon(tx, trial, status=Status.TIMEOUT, now=now,
                       message=f"lease expired {trial.attempts} times (limit {settings.max_attempts}); no result")
    else:
        engine.release(tx, trial, count_attempt=True)


def lease(tx: SqlTx, engine: Engine, worker: WorkerInfo, settings: Settings,
          now: dt.datetime, *, ending: str | None = None) -> tuple[LeaseInfo, TrialTask] | None:
    """Claim one trial for ``worker``, or None if no study on its hardware or its rings has one to give;
    ``ending``: the worker's lease whose result was just stored ends first (`Leases.claim_leased`)."""
    expire(tx, engine, settings, now)
    claim = functools.partial(tx.leases.claim_leased, hardware=worker.hardware, software=worker.software,
                              worker_id=worker.id, now=now, seconds=settings.lease_seconds)
    claimed = claim(ending=ending)
    if claimed is None and _refill_starving(tx, engine, worker, now):
        claimed = claim()
    if claimed is None:
        return None
    trial, granted = claimed
    engine.claimed(tx, trial, now=now)
    return granted, task_for(tx.study(trial.study_id), trial)


def grant(tx: SqlTx, engine: Engine, settings: Settings, worker_id: int, now: dt.datetime, *,
          reuse_held: bool = False, ending: str | None = None) -> LeaseGranted | None:
    """The worker's next trial, leased to it (None if there is none).

    Args:
        reuse_held: a lease the worker already holds is answered again instead of a new one (a
            result sent twice, because its answer was lost, must not leave a lease nobody runs).
        ending: the worker's lease whose result was just stored, ended by the claim (see `report`).

    Raises:
        NotFoundError: the worker is not registered (or left).
    """
    worker = tx.workers.touch(worker_id, now, at_most_every_s=LEASE_TOUCH_SECONDS)
    held = [h for h in tx.leases.active(worker_id=worker_id) if h.expires_at > now] if reuse_held else []
    if held:
        granted = held[-1]
        trial = tx.trial(granted.trial_id)
        task = task_for(tx.study(trial.study_id), trial)
    else:
        claimed = lease(tx, engine, worker, settings, now, ending=ending)
        if claimed is None:
            return None
        granted, task = claimed
    return LeaseGranted(lease=LeasePublic(id=granted.id, expires_at=granted.expires_at), trial=task)


def _refill_starving(tx: SqlTx, engine: Engine, worker: WorkerInfo, now: dt.datetime) -> bool:
    """Refill the searching studies on the worker's hardware (or its rings) that have no trial in flight at all."""
    return any([engine.refill(tx, study_id, now=now) for study_id in tx.leases.starving_studies(worker.hardware)])


def heartbeat(tx: SqlTx, worker: WorkerInfo, lease_id: str | None, settings: Settings,
              now: dt.datetime) -> LeaseInfo | None:
    """Mark the worker alive; extend its lease ``lease_id`` if that lease is still live."""
    tx.workers.beat(worker.id, now)
    if not lease_id:
        return None
    return tx.leases.extend(lease_id, worker_id=worker.id, now=now, seconds=settings.lease_seconds)


@dataclass(frozen=True)
class Reported:
    """What became of a result: stored, a repeat of a stored one, or too late (the lease expired)."""

    trial: TrialRecord
    duplicate: bool = False
    expired: bool = False
    next: LeaseGranted | None = None  # with ``lease_next``: the worker's next trial, if there is one


def report(tx: SqlTx, engine: Engine, settings: Settings, *, trial_id: int, lease_id: str, result: TrialResult,
           now: dt.datetime, worker_id: int | None = None, lease_next: bool = False) -> Reported:
    """Store a trial's result under its lease; with ``lease_next``, lease the worker its next trial too
    (`grant`; a result sent twice gets the lease its worker holds).  The lease ends as the next claim runs:
    on PostgreSQL one statement ends it, counts the worker's trial, claims and leases the next.

    Raises:
        ConflictError: the lease is unknown, for another trial or worker, or no longer holds the trial.
        InvalidError: the result is not of this trial's kind, problem and candidates.
        NotFoundError: with ``lease_next``, the worker is not registered (or left).
    """
    found = tx.leases.with_trial(lease_id, trial_id)  # one statement when the lease holds the trial
    held, trial = found if found is not None else (tx.leases.get(lease_id, lock=True), tx.trial(trial_id, lock=True))
    if held is None or held.trial_id != trial.id:
        raise ConflictError(f"lease {lease_id} does not hold trial {trial_id}")
    if worker_id is not None and held.worker_id != worker_id:
        raise ConflictError(f"lease {lease_id} belongs to another worker")
    if trial.state in (TrialState.COMPLETED, TrialState.FAILED, TrialState.CANCELLED):
        if trial.result_lease_id == held.id:
            return Reported(trial, duplicate=True, next=grant(tx, engine, settings, held.worker_id, now,
                                                              reuse_held=True) if lease_next else None)
        if trial.state == TrialState.CANCELLED:
            raise ConflictError(f"trial {trial_id} was cancelled ({trial.message or 'its study was cancelled'}); "
                                "drop this result")
        raise ConflictError(f"trial {trial_id} already has a result from another lease; this lease is stale")
    if not held.active or trial.state != TrialState.LEASED:
        raise ConflictError(f"lease {lease_id} expired and trial {trial_id} went back to the queue; "
                            "drop this result and lease again")
    if held.expires_at < now:
        _expire_one(tx, engine, settings, held, now)
        return Reported(tx.trial(trial_id), expired=True)
    result = _on_stack(result, tx.workers.touch(held.worker_id, now, at_most_every_s=LEASE_TOUCH_SECONDS))
    stored = engine.record(tx, trial, result, now=now, lease_id=held.id)
    if lease_next:
        return Reported(stored, next=grant(tx, engine, settings, held.worker_id, now, ending=held.id))
    tx.leases.end(held.id)
    return Reported(stored)


def _on_stack(result: TrialResult, worker: WorkerInfo) -> TrialResult:
    """``result`` as measured on the stack the worker registered with: a record that names none gets it, one
    that names another is refused (a worker's stack is what decides which configs its results make).

    Raises:
        InvalidError: a record names another stack than its worker's.
    """
    def stamped(hardware: Hardware) -> Hardware:
        if hardware.software is None:
            return hardware.model_copy(update={"software": worker.software})
        if hardware.software.key != worker.software.key:
            raise InvalidError(f"the result was measured on {hardware.software}, but worker {worker.id} registered "
                               f"with {worker.software}: register again from the stack that measures")
        return hardware

    def one(record):  # a Measurement, BoundsMeasurement or StepMeasurement: each names its hardware
        return record.model_copy(update={"hardware": stamped(record.hardware)})

    if result.kind == TrialKind.STEP:
        return result.model_copy(update={"step": one(result.step)})
    if result.kind == TrialKind.SEARCH:
        return result.model_copy(update={"measurement": one(result.measurement)})
    return result.model_copy(update={"measurements": [one(m) for m in result.measurements],
                                     "bounds": one(result.bounds) if result.bounds else None})


def release_worker(tx: SqlTx, engine: Engine, worker_id: int) -> int:
    """A worker leaving on purpose gives its trials back (the attempt does not count)."""
    held = tx.leases.active(worker_id=worker_id)
    for lease_row in held:
        tx.leases.close(lease_row.id)
        trial = tx.trial(lease_row.trial_id, lock=True)
        if trial.state == TrialState.LEASED:
            engine.release(tx, trial, count_attempt=False)
    return len(held)


def cancel(tx: SqlTx, engine: Engine, study_id: int, now: dt.datetime) -> None:
    """Cancel a study: the engine cancels its trials; their leases end."""
    for lease_row in tx.leases.active(study_id=study_id):
        tx.leases.close(lease_row.id)
    engine.cancel(tx, study_id, now=now)

