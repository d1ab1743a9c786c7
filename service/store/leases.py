"""Leases: the claim of a pending trial, a worker's time-limited hold on it, its end and expiry.

The policy (when expiry runs, what a late result gets, who may report) is `cmtune.service.leasing`'s;
this room holds its SQL.  A claim is a trial's move from pending to leased, checked against the
engine's `TRIAL_MOVES` (`cmtune.tuner.states`) where it is made (`Leases.claim`); a lease that expires or is
given back moves its trial through the engine (`Engine.release`, `Engine.abandon`).  Claims use ``FOR UPDATE SKIP
LOCKED`` on PostgreSQL; SQLite's write transaction is exclusive.

On PostgreSQL a result's lease ends, its worker's trial counts, and the next trial is claimed and
leased in one statement (`_claim_leased`); SQLite, which has no writes inside ``WITH``, runs them one
by one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import and_, exists, func, insert, or_, select, true, update

from cmtune.service.store.base import (
    MEASURED,
    MUTABLE,
    OWNER,
    TRIAL,
    P,
    Tx,
    hardware_t,
    leases,
    studies,
    trial_record,
    trials,
    workers,
)
from cmtune.service.store.prepared import Prepared
from cmtune.tuner.states import check_trial_move
from cmtune.tuner.store import TrialRecord
from collective_matmul.planning.problem import Hardware, Software
from collective_matmul.wire import ACTIVE_STUDY_STATES, StudyState, TrialState

ACTIVE = [s.value for s in ACTIVE_STUDY_STATES]


@dataclass(frozen=True)
class LeaseInfo:
    id: str
    trial_id: int
    worker_id: int
    expires_at: dt.datetime
    active: bool


_LEASE_COLUMNS = (leases.c.id, leases.c.trial_id, leases.c.worker_id, leases.c.expires_at, leases.c.active)
_LEASE_SELECT = select(*_LEASE_COLUMNS).where(leases.c.id == P("lease_id"))
_LEASE = Prepared(_LEASE_SELECT)
_LEASE_LOCKED = Prepared(_LEASE_SELECT.with_for_update())
_UPDATE_LEASE = Prepared(update(leases).where(leases.c.id == P("_lease_id")))
_INSERT_LEASE = Prepared(insert(leases))
_LEASE_AND_TRIAL = Prepared(select(*TRIAL, *MEASURED, leases.c.id.label("lease_id"),
                                   leases.c.worker_id.label("lease_worker_id"),
                                   leases.c.expires_at.label("lease_expires_at"),
                                   leases.c.active.label("lease_active"), *OWNER)
                            .join(leases, leases.c.trial_id == trials.c.id)
                            .join(studies, studies.c.id == trials.c.study_id)
                            .where(trials.c.id == P("trial_id"), leases.c.id == P("lease_id")).with_for_update())
_COUNT_WORKER_TRIAL = Prepared(update(workers).where(workers.c.id == P("_worker_id"))
                               .values(trials_done=workers.c.trials_done + 1))
_END_LEASE_UPDATE = update(leases).where(leases.c.id == P("_lease_id")).values(active=False) \
    .returning(leases.c.worker_id)
_END_LEASE = Prepared(_END_LEASE_UPDATE)
_ENDED = _END_LEASE_UPDATE.cte("ended")
_END_LEASE_COUNTED = Prepared(update(workers).where(workers.c.id == _ENDED.c.worker_id)
                              .values(trials_done=workers.c.trials_done + 1).add_cte(_ENDED))


@functools.lru_cache(maxsize=1024)
def served_keys(hardware: Hardware) -> tuple[str, ...]:
    """The hardware keys a worker of ``hardware`` (its identity) leases trials of: its own, then its rings'
    (`Hardware.rings`)."""
    return tuple(ring.key for ring in hardware.rings())


def _key_parameters(hardware: Hardware) -> dict[str, str]:
    """The parameters ``hardware_key_0``, ``hardware_key_1``, ... of a claim on ``hardware``'s `served_keys`."""
    return {f"hardware_key_{i}": key for i, key in enumerate(served_keys(hardware.identity()))}


@functools.cache
def _claim(by_studies: bool, hardware_keys: int, with_study: bool, by_software: bool = False) -> Prepared:
    """The claim: the oldest pending trial (of the studies ``study_ids``, or on one of ``hardware_keys`` hardware
    keys, ``hardware_key_0``, ...) becomes leased by ``claimer``, in one statement; ``by_software`` (with
    ``hardware_keys``): only of studies whose stack is ``software_key`` or none; ``with_study`` (PostgreSQL:
    SQLite's RETURNING names only the updated table) returns its study's `MUTABLE` columns too, as `OWNER`.

    Each key is a parameter of its own (not one expanded at execution), so the statement stays `Prepared`."""
    pending = trials.alias("pending")
    # whether a pending trial's study may give it out, asked per trial (a subquery the planner cannot
    # turn into a join): the claim walks the pending index in order and usually stops at its first entry,
    # where a join would visit every active study and sort all their pending trials
    claimable = select(or_(*(studies.c.state == s for s in ACTIVE))).where(studies.c.id == pending.c.study_id)
    if hardware_keys:
        stack = [or_(studies.c.software_key.is_(None), studies.c.software_key == P("software_key"))] \
            if by_software else []
        keys = [P(f"hardware_key_{i}") for i in range(hardware_keys)]
        on_hardware = hardware_t.c.key == keys[0] if hardware_keys == 1 else hardware_t.c.key.in_(keys)
        claimable = select(and_(or_(*(studies.c.state == s for s in ACTIVE)), on_hardware, *stack)) \
            .join_from(studies, hardware_t, hardware_t.c.id == studies.c.hardware_id) \
            .where(studies.c.id == pending.c.study_id)
    query = select(pending.c.id).where(pending.c.state == TrialState.PENDING, claimable.scalar_subquery()) \
        .order_by(pending.c.study_id, pending.c.number).limit(1)
    if by_studies:
        query = query.where(pending.c.study_id.in_(P("study_ids", expanding=True)))
    # PostgreSQL: concurrent claims skip each other's row (SKIP LOCKED); SQLite: the write transaction
    # is exclusive
    oldest = query.with_for_update(of=pending, skip_locked=True).scalar_subquery()
    claim = update(trials).where(trials.c.id == oldest).values(
        state=TrialState.LEASED, attempts=trials.c.attempts + 1, worker_id=P("claimer"))
    if not with_study:
        return Prepared(claim.returning(*TRIAL))
    owner = studies.alias("owner")
    return Prepared(claim.where(owner.c.id == trials.c.study_id).returning(
        *TRIAL, *(owner.c[c.name].label(f"owner_{c.name}") for c in MUTABLE)))


@functools.cache
def _claim_leased(ending: bool, hardware_keys: int) -> Prepared:
    """PostgreSQL: `_claim` on ``hardware_keys`` keys and ``software_key`` (with its study) and the lease of what
    it claims, in one statement (``lease_id``, ``now``, ``until``; nothing is inserted when there is nothing to
    claim); ``ending``: the lease ``_lease_id`` ends and its worker counts a trial done, whatever is claimed (a
    data-modifying WITH always runs)."""
    claimed = _claim(False, hardware_keys, True, True).statement.cte("claimed")
    leased = insert(leases).from_select(
        ["id", "trial_id", "worker_id", "created_at", "expires_at", "active"],
        select(P("lease_id", type_=leases.c.id.type), claimed.c.id, claimed.c.worker_id,
               P("now", type_=leases.c.created_at.type), P("until", type_=leases.c.expires_at.type),
               true())).cte("leased")
    statement = select(claimed).add_cte(leased)
    if ending:
        statement = statement.add_cte(_END_LEASE_COUNTED.statement.cte("counted"))
    return Prepared(statement)


class Leases:
    """The leases of one transaction (`Tx`)."""

    def __init__(self, tx: Tx):
        self._tx = tx

    def claim(self, *, study_ids: Sequence[int] | None = None, hardware: Hardware | None = None,
              worker_id: int | None = None, software: Software | None = None) -> TrialRecord | None:
        """The oldest pending trial (of ``study_ids``, else of the active studies on ``hardware`` or its rings,
        `served_keys`, whose stack is ``software`` or none), moved to leased by ``worker_id`` (attempts + 1) in one
        statement, or None (`StoreTx.claim`: the engine's `Engine.claim` checks the move first)."""
        parameters = {"claimer": worker_id}
        if study_ids is not None:
            parameters["study_ids"] = list(study_ids)
        keys = _key_parameters(hardware) if hardware is not None else {}
        parameters |= keys
        by_software = hardware is not None and software is not None
        if by_software:
            parameters["software_key"] = software.key
        with_study = self._tx.is_postgres
        row = self._tx.first(_claim(study_ids is not None, len(keys), with_study, by_software), parameters)
        if row is None:
            return None
        if with_study:
            self._tx.remember_study(row, "owner_")
        return trial_record(row, False)

    def claim_leased(self, *, hardware: Hardware, worker_id: int, now: dt.datetime, seconds: float,
                     ending: str | None = None, software: Software | None = None,
                     ) -> tuple[TrialRecord, LeaseInfo] | None:
        """`claim` the oldest pending trial on ``hardware`` or one of its rings (`served_keys`) of a study of the
        worker's ``software`` stack (or of none) for ``worker_id`` and lease it to the worker for ``seconds`` (on
        PostgreSQL one statement), or None (a worker that names no stack: ``Software()``); ``ending``: a lease that
        ends first, as by `end` (in the same statement).  The caller's engine takes the claimed trial's study
        through its own moves (`Engine.claimed`)."""
        check_trial_move(None, TrialState.PENDING, TrialState.LEASED)  # the engine's guard, once per claim
        tx, software = self._tx, software or Software()
        lease_id, expires_at = str(uuid.uuid4()), now + dt.timedelta(seconds=seconds)
        lease = LeaseInfo(id=lease_id, trial_id=0, worker_id=worker_id, expires_at=expires_at, active=True)
        if not tx.is_postgres:
            if ending is not None:
                self.end(ending)
            trial = self.claim(hardware=hardware, worker_id=worker_id, software=software)
            if trial is None:
                return None
            lease = dataclasses.replace(lease, trial_id=trial.id)
            tx.rows(_INSERT_LEASE, {"created_at": now, **dataclasses.asdict(lease)})
            return trial, lease
        keys = _key_parameters(hardware)
        parameters = {"claimer": worker_id, **keys, "software_key": software.key, "lease_id": lease_id, "now": now,
                      "until": expires_at}
        if ending is not None:
            parameters["_lease_id"] = ending
        row = tx.first(_claim_leased(ending is not None, len(keys)), parameters)
        if row is None:
            return None
        tx.remember_study(row, "owner_")
        return trial_record(row, False), dataclasses.replace(lease, trial_id=row.id)

    def get(self, lease_id: str, *, lock: bool = False) -> LeaseInfo | None:
        row = self._tx.first(_LEASE_LOCKED if lock else _LEASE, {"lease_id": lease_id})
        return LeaseInfo(**row._asdict()) if row is not None else None

    def with_trial(self, lease_id: str, trial_id: int) -> tuple[LeaseInfo, TrialRecord] | None:
        """The lease and the trial a result names, both locked for this transaction, with the trial's study
        (one statement), or None when the lease does not hold that trial (or either does not exist)."""
        row = self._tx.first(_LEASE_AND_TRIAL, {"lease_id": lease_id, "trial_id": trial_id})
        if row is None:
            return None
        held = LeaseInfo(id=row.lease_id, trial_id=row.id, worker_id=row.lease_worker_id,
                         expires_at=row.lease_expires_at, active=row.lease_active)
        self._tx.locked.add(self._tx.remember_study(row, "owner_").id)
        return held, trial_record(row, True)

    def end(self, lease_id: str) -> None:
        """The lease ends with its result: no longer active, its worker has one more trial done (on
        PostgreSQL one statement)."""
        if self._tx.is_postgres:
            self._tx.rows(_END_LEASE_COUNTED, {"_lease_id": lease_id})
        else:
            (worker_id,) = self._tx.first(_END_LEASE, {"_lease_id": lease_id})
            self._tx.rows(_COUNT_WORKER_TRIAL, {"_worker_id": worker_id})

    def close(self, lease_id: str) -> None:
        """The lease ends without a result (expired, given back, its study cancelled)."""
        self._tx.rows(_UPDATE_LEASE, {"_lease_id": lease_id, "active": False})

    def extend(self, lease_id: str, *, worker_id: int, now: dt.datetime, seconds: float) -> LeaseInfo | None:
        """The worker's live lease, extended to ``now + seconds``; None (and nothing changed) for a lease
        that is unknown, another worker's, ended or expired."""
        held = self.get(lease_id, lock=True)
        if held is None or held.worker_id != worker_id or not held.active or held.expires_at < now:
            return None
        extended = dataclasses.replace(held, expires_at=now + dt.timedelta(seconds=seconds))
        self._tx.rows(_UPDATE_LEASE, {"_lease_id": held.id, "expires_at": extended.expires_at})
        return extended

    def active(self, *, expired_before: dt.datetime | None = None, worker_id: int | None = None,
               study_id: int | None = None) -> list[LeaseInfo]:
        """Active leases (expired ones, a worker's, or a study's), oldest first, locked for this transaction
        (those another transaction holds are skipped)."""
        query = select(*_LEASE_COLUMNS).where(leases.c.active.is_(True))
        if expired_before is not None:
            query = query.where(leases.c.expires_at < expired_before)
        if worker_id is not None:
            query = query.where(leases.c.worker_id == worker_id)
        if study_id is not None:
            query = query.where(leases.c.trial_id.in_(select(trials.c.id).where(trials.c.study_id == study_id)))
        return [LeaseInfo(**row._mapping) for row in self._tx.execute(
            query.order_by(leases.c.created_at).with_for_update(skip_locked=True))]

    def starving_studies(self, hardware: Hardware) -> list[int]:
        """The searching studies on ``hardware`` or its rings (`served_keys`) with no trial in flight at all
        (pending or leased)."""
        in_flight = exists().where(trials.c.study_id == studies.c.id,
                                   trials.c.state.in_([TrialState.PENDING.value, TrialState.LEASED.value]))
        return list(self._tx.execute(
            select(studies.c.id).join(hardware_t, hardware_t.c.id == studies.c.hardware_id)
            .where(hardware_t.c.key.in_(served_keys(hardware.identity())),
                   studies.c.state.in_([StudyState.PENDING.value, StudyState.RUNNING.value]), ~in_flight)
            .order_by(studies.c.id)).scalars())

    def current_trials(self) -> dict[int, int]:
        """worker id -> the trial it holds an active lease on."""
        rows = self._tx.execute(select(leases.c.worker_id, leases.c.trial_id).where(leases.c.active.is_(True)))
        return {worker_id: trial_id for worker_id, trial_id in rows}

    def count_active(self) -> int:
        return int(self._tx.scalar(select(func.count()).select_from(leases).where(leases.c.active.is_(True))) or 0)
