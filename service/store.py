"""The SQL store: the engine's store interface on SQLite or PostgreSQL, plus the service's own tables.

Every route reaches the database one way: ``with store.read() as tx`` or ``with store.write() as
tx`` (one transaction; see `cmtune.service.db`), then `SqlTx` methods, which return domain records
(`StudyRecord`, `TrialRecord`, `TunedConfig`, ...) or plain values, never ORM rows.  The engine
(`cmtune.tuner.engine`) takes the same ``tx`` as its `StoreTx`.

The hot paths (claim, result, history, a new study) are single Core statements, built once at
import, compiled once per dialect and run on the driver's cursor (`Prepared`); on PostgreSQL a
lease+report cycle is 5 of them.  A study's problem, hardware, settings and protocol never change
after it is created, so each process keeps them in memory and a study read fetches only its mutable
columns; within a transaction a study is read once, until the transaction changes it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    null,
    or_,
    select,
    true,
    type_coerce,
    update,
)

from cmtune.service.db import Database
from cmtune.service.models import (
    HardwareRow,
    Lease,
    ProblemRow,
    Role,
    RoleOverrideRow,
    Study,
    Submission,
    SubmissionStudy,
    Token,
    Trial,
    TunedConfigRow,
    Worker,
)
from cmtune.service.prepared import Prepared
from cmtune.tuner.errors import NotFoundError
from cmtune.tuner.search import SearchSettings
from cmtune.tuner.store import StepSpec, StudyRecord, TrialRecord
from collective_matmul.bundle import RoleOverride, TunedConfig
from collective_matmul.decomposition import Decomposition, OpConfigs
from collective_matmul.problem import Hardware, Problem
from collective_matmul.wire import (
    ACTIVE_STUDY_STATES,
    Measurement,
    Protocol,
    StepMeasurement,
    StudyKind,
    StudyState,
    TrialKind,
    TrialState,
)

studies, trials, leases, workers = Study.__table__, Trial.__table__, Lease.__table__, Worker.__table__
problems, hardware_t, tuned_t, tokens = ProblemRow.__table__, HardwareRow.__table__, TunedConfigRow.__table__, \
    Token.__table__
overrides_t = RoleOverrideRow.__table__
log = logging.getLogger(__name__)
ACTIVE = [s.value for s in ACTIVE_STUDY_STATES]
MAX_TOUCHED = 100_000


@functools.lru_cache(maxsize=4096)
def decomposition_of(decomposition_id: str) -> Decomposition:
    """A search trial's candidate from its stored id (ids round-trip; checked when stored)."""
    return Decomposition.from_id(decomposition_id)


@dataclass(frozen=True)
class _Fixed:
    """The parts of a study that never change after it is created."""

    problem: Problem | None
    hardware: Hardware
    hardware_id: int
    problem_id: int | None
    settings: SearchSettings
    protocol: Protocol
    space_size: int
    created_at: dt.datetime
    kind: StudyKind
    step: StepSpec | None
    submission_id: int | None

    @classmethod
    def of(cls, row) -> _Fixed:
        """From a row of `_FIXED` columns."""
        return cls(_problem(row) if row.problem_id is not None else None, _hardware(row), row.hardware_id,
                   row.problem_id, SearchSettings.model_validate(row.settings), Protocol.model_validate(row.protocol),
                   row.space_size, row.created_at, StudyKind(row.kind),
                   StepSpec.from_json(row.step) if row.step else None, row.submission_id)


@dataclass(frozen=True)
class TokenInfo:
    id: int
    name: str
    role: Role
    revoked: bool
    created_at: dt.datetime


@dataclass(frozen=True)
class WorkerInfo:
    id: int
    name: str
    hardware: Hardware
    software: dict
    registered_at: dt.datetime
    last_heartbeat: dt.datetime
    active: bool
    trials_done: int
    memory_bytes: int | None = None


@dataclass(frozen=True)
class LeaseInfo:
    id: str
    trial_id: int
    worker_id: int
    expires_at: dt.datetime
    active: bool


@dataclass(frozen=True)
class TunedRow:
    """A stored tuned config and the study that produced it."""

    config: TunedConfig
    study_id: int | None


# The hot paths' statements, built once and compiled once per dialect (`Prepared`); they take their
# values as parameters.
_P = bindparam
# created_at tells a cached study from a row that reused its id after a rollback (SQLite)
_MUTABLE = (studies.c.id, studies.c.created_at, studies.c.state, studies.c.stop_reason, studies.c.message,
            studies.c.started_at, studies.c.finished_at, studies.c.trials_done, studies.c.best_trial_id,
            studies.c.best_ratio)
_STUDY = select(*_MUTABLE).where(studies.c.id == _P("study_id"))
_STUDY_LOCKED = Prepared(_STUDY.with_for_update())
_STUDY = Prepared(_STUDY)
_UPDATE_STUDY = Prepared(update(studies).where(studies.c.id == _P("_study_id")))  # SET: the other parameters

_TRIAL = (trials.c.id, trials.c.study_id, trials.c.number, trials.c.kind, trials.c.decompositions,
          trials.c.decomposition_id, trials.c.state, trials.c.created_at, trials.c.attempts, trials.c.status,
          trials.c.ratio, trials.c.message, trials.c.worker_id, trials.c.result_lease_id, trials.c.finished_at)
# a study's history: a search trial's candidate comes back from its id, so its JSON is not fetched
_BRIEF = (*_TRIAL[:4], type_coerce(case((trials.c.kind == TrialKind.SEARCH.value, null()),
                                        else_=trials.c.decompositions), trials.c.decompositions.type)
          .label("decompositions"), *_TRIAL[5:])
_TRIALS = Prepared(select(*_BRIEF).where(trials.c.study_id == _P("study_id")).order_by(trials.c.number))
_TRIALS_MEASURED = Prepared(select(*_BRIEF, trials.c.measurements).where(trials.c.study_id == _P("study_id"))
                            .order_by(trials.c.number))
_TRIAL_ONE = select(*_TRIAL, trials.c.measurements).where(trials.c.id == _P("trial_id"))
_TRIAL_LOCKED = Prepared(_TRIAL_ONE.with_for_update())
_TRIAL_ONE = Prepared(_TRIAL_ONE)
_UPDATE_TRIAL = Prepared(update(trials).where(trials.c.id == _P("_trial_id")))
_INSERT_TRIAL = Prepared(insert(trials).returning(trials.c.id))
_NEW_TRIAL = ("study_id", "number", "kind", "decompositions", "decomposition_id", "state", "attempts", "created_at")


@functools.lru_cache(maxsize=64)  # n is at most CMTUNE_READY_PROPOSALS (<= 32) or a new study's first proposals
def _insert_trials(n: int) -> Prepared:
    """``n`` new trials in one statement: parameters ``column_i`` for row i; each row's id and number come
    back (in no promised order)."""
    return Prepared(insert(trials).values([{c: _P(f"{c}_{i}", type_=trials.c[c].type) for c in _NEW_TRIAL}
                                           for i in range(n)]).returning(trials.c.id, trials.c.number))


_LEASE_COLUMNS = (leases.c.id, leases.c.trial_id, leases.c.worker_id, leases.c.expires_at, leases.c.active)
_LEASE = select(*_LEASE_COLUMNS).where(leases.c.id == _P("lease_id"))
_LEASE_LOCKED = Prepared(_LEASE.with_for_update())
_LEASE = Prepared(_LEASE)
_UPDATE_LEASE = Prepared(update(leases).where(leases.c.id == _P("_lease_id")))
_INSERT_LEASE = Prepared(insert(leases))
_STUDY_COLUMNS = tuple(c.label(f"owner_{c.name}") for c in _MUTABLE)  # beside a trial's, in one row
_LEASE_AND_TRIAL = Prepared(select(*_TRIAL, trials.c.measurements, leases.c.id.label("lease_id"),
                          leases.c.worker_id.label("lease_worker_id"), leases.c.expires_at.label("lease_expires_at"),
                          leases.c.active.label("lease_active"), *_STUDY_COLUMNS) \
    .join(leases, leases.c.trial_id == trials.c.id).join(studies, studies.c.id == trials.c.study_id) \
    .where(trials.c.id == _P("trial_id"), leases.c.id == _P("lease_id")).with_for_update())
_TOUCH_WORKER = Prepared(update(workers).where(workers.c.id == _P("_worker_id"), workers.c.active.is_(True))
                         .values(last_heartbeat=_P("now")).returning(workers))
_COUNT_WORKER_TRIAL = Prepared(update(workers).where(workers.c.id == _P("_worker_id"))
                               .values(trials_done=workers.c.trials_done + 1))
_END_LEASE = update(leases).where(leases.c.id == _P("_lease_id")).values(active=False).returning(leases.c.worker_id)
_ENDED = _END_LEASE.cte("ended")
_END_LEASE_COUNTED = Prepared(update(workers).where(workers.c.id == _ENDED.c.worker_id)
                              .values(trials_done=workers.c.trials_done + 1).add_cte(_ENDED))
_END_LEASE = Prepared(_END_LEASE)
# a new study: its keys, the study of the same problem it may repeat, and its tuned config at the end
_HARDWARE_ID = Prepared(select(hardware_t.c.id).where(hardware_t.c.key == _P("key")))
_INSERT_HARDWARE = Prepared(insert(hardware_t).returning(hardware_t.c.id))
_PROBLEM_ID = Prepared(select(problems.c.id).where(problems.c.key == _P("key")))
_INSERT_PROBLEM = Prepared(insert(problems).returning(problems.c.id))
_INSERT_STUDY = Prepared(insert(studies).returning(*_MUTABLE))
_FIND_STUDY = Prepared(select(studies.c.id).where(
    studies.c.problem_id == _P("problem_id"), studies.c.hardware_id == _P("hardware_id"),
    studies.c.kind == StudyKind.SEARCH.value, or_(*(studies.c.state == s for s in [*ACTIVE, StudyState.COMPLETED])))
    .order_by(studies.c.id.desc()).limit(1))
_TUNED_ID = Prepared(select(tuned_t.c.id).where(tuned_t.c.problem_id == _P("problem_id"),
                                                tuned_t.c.hardware_id == _P("hardware_id")).with_for_update())
_INSERT_TUNED = Prepared(insert(tuned_t))
_UPDATE_TUNED = Prepared(update(tuned_t).where(tuned_t.c.id == _P("_tuned_id")))
_HARDWARE_MEMORY = Prepared(select(func.max(workers.c.memory_bytes))
                            .join(hardware_t, hardware_t.c.id == workers.c.hardware_id)
                            .where(hardware_t.c.key == _P("key")))


@functools.cache
def _claim(by_studies: bool, by_hardware: bool, with_study: bool):
    """The claim: the oldest pending trial (of the studies ``study_ids``, or on ``hardware_key``) becomes
    leased by ``claimer``, in one statement; ``with_study`` (PostgreSQL: SQLite's RETURNING names only
    the updated table) returns its study's `_MUTABLE` columns too."""
    pending = trials.alias("pending")
    # whether a pending trial's study may give it out, asked per trial (a subquery the planner cannot
    # turn into a join): the claim walks the pending index in order and usually stops at its first entry,
    # where a join would visit every active study and sort all their pending trials
    claimable = select(or_(*(studies.c.state == s for s in ACTIVE))).where(studies.c.id == pending.c.study_id)
    if by_hardware:
        claimable = select(and_(or_(*(studies.c.state == s for s in ACTIVE)), hardware_t.c.key == _P("hardware_key"))) \
            .join_from(studies, hardware_t, hardware_t.c.id == studies.c.hardware_id) \
            .where(studies.c.id == pending.c.study_id)
    query = select(pending.c.id).where(pending.c.state == TrialState.PENDING, claimable.scalar_subquery()) \
        .order_by(pending.c.study_id, pending.c.number).limit(1)
    if by_studies:
        query = query.where(pending.c.study_id.in_(_P("study_ids", expanding=True)))
    # PostgreSQL: concurrent claims skip each other's row (SKIP LOCKED); SQLite: the write transaction
    # is exclusive
    oldest = query.with_for_update(of=pending, skip_locked=True).scalar_subquery()
    claim = update(trials).where(trials.c.id == oldest).values(
        state=TrialState.LEASED, attempts=trials.c.attempts + 1, worker_id=_P("claimer"))
    if not with_study:
        return Prepared(claim.returning(*_TRIAL))
    owner = studies.alias("owner")
    return Prepared(claim.where(owner.c.id == trials.c.study_id).returning(
        *_TRIAL, *(owner.c[c.name].label(f"owner_{c.name}") for c in _MUTABLE)))


@functools.cache
def _update_trial_and_study(trial_columns: tuple[str, ...], study_columns: tuple[str, ...]) -> Prepared:
    """PostgreSQL: a trial's update and its study's in one statement (the study's as a data-modifying
    WITH); the values are the parameters ``trial_`` and ``study_`` + column (a parameter named like a
    column would become a SET of that column in both updates)."""
    study = update(studies).where(studies.c.id == _P("_study_id")) \
        .values({name: _P(f"study_{name}", type_=studies.c[name].type) for name in study_columns}).cte("study")
    return Prepared(update(trials).where(trials.c.id == _P("_trial_id"))
                    .values({name: _P(f"trial_{name}", type_=trials.c[name].type) for name in trial_columns})
                    .add_cte(study))


@functools.cache
def _claim_leased(ending: bool):
    """PostgreSQL: `_claim` on ``hardware_key`` (with its study) and the lease of what it claims, in one
    statement (``lease_id``, ``now``, ``until``; nothing is inserted when there is nothing to claim);
    ``ending``: the lease ``_lease_id`` ends and its worker counts a trial done, whatever is claimed (a
    data-modifying WITH always runs)."""
    claimed = _claim(False, True, True).statement.cte("claimed")
    leased = insert(leases).from_select(
        ["id", "trial_id", "worker_id", "created_at", "expires_at", "active"],
        select(_P("lease_id", type_=leases.c.id.type), claimed.c.id, claimed.c.worker_id,
               _P("now", type_=leases.c.created_at.type), _P("until", type_=leases.c.expires_at.type),
               true())).cte("leased")
    statement = select(claimed).add_cte(leased)
    if ending:
        statement = statement.add_cte(_END_LEASE_COUNTED.statement.cte("counted"))
    return Prepared(statement)


class SqlStore:
    """The database behind the service, and per-process caches of what never changes."""

    def __init__(self, db: Database):
        self.db = db
        self.fixed: dict[int, _Fixed] = {}
        self.hardware: dict[int, Hardware] = {}  # hardware rows never change; filled from committed rows only
        self.touched: dict[int, tuple[float, WorkerInfo]] = {}  # worker id -> when this process marked it alive

    @contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[SqlTx]:
        with self.db.transaction(write=write) as connection:
            yield SqlTx(connection, self)

    def read(self):
        return self.transaction(write=False)

    def write(self):
        return self.transaction(write=True)


class SqlTx:
    """One transaction: the engine's `StoreTx` and the service's queries."""

    def __init__(self, connection: Connection, store: SqlStore):
        self.connection = connection  # Core statements in one transaction (no ORM unit of work)
        self.store = store
        # studies read in this transaction, until it changes them; those it has locked are in `_locked`
        self._studies: dict[int, StudyRecord] = {}
        self._locked: set[int] = set()
        self._ids: dict[tuple[str, str], int | None] = {}  # (table, key) -> id, as this transaction found it

    def execute(self, statement, parameters=None):
        return self.connection.execute(statement, parameters)

    def scalar(self, statement, parameters=None):
        return self.connection.execute(statement, parameters).scalar()

    def _one(self, statement, parameters=None):
        return self.connection.execute(statement, parameters).one_or_none()

    def _rows(self, prepared: Prepared, parameters=None) -> list:
        return prepared.rows(self.connection, parameters)

    def _first(self, prepared: Prepared, parameters=None):
        return prepared.one(self.connection, parameters)

    # --- keys ---------------------------------------------------------------------------------

    def hardware_id(self, hardware: Hardware, *, create: bool = False) -> int | None:
        hw = hardware.identity()
        return self._key_id("hardware", hw.key, _HARDWARE_ID, _INSERT_HARDWARE, dict(
            key=hw.key, platform=hw.platform, device_kind=hw.device_kind, device_count=hw.device_count,
            process_count=hw.process_count) if create else None)

    def problem_id(self, problem: Problem, *, create: bool = False) -> int | None:
        return self._key_id("problems", problem.key, _PROBLEM_ID, _INSERT_PROBLEM,
                            {"key": problem.key, **problem.model_dump()} if create else None)

    def _key_id(self, table: str, key: str, find: Prepared, add: Prepared, values: dict | None) -> int | None:
        """The id of the row of ``table`` with ``key``, inserted from ``values`` if there is none (and they
        are given); a transaction looks each key up once (such rows are never changed or deleted)."""
        if (table, key) in self._ids:
            found = self._ids[table, key]
        else:
            row = self._first(find, {"key": key})
            found = row.id if row is not None else None
        if found is None and values is not None:
            found = self._first(add, values).id
        self._ids[table, key] = found
        return found

    # --- the engine's store interface ---------------------------------------------------------

    def add_study(self, *, problem, hardware, settings, protocol, space_size, now, kind=StudyKind.SEARCH, step=None,
                  submission_id=None) -> StudyRecord:
        hardware_id = self.hardware_id(hardware, create=True)
        problem_id = self.problem_id(problem, create=True) if problem is not None else None
        row = self._first(_INSERT_STUDY, dict(
            problem_id=problem_id, hardware_id=hardware_id, state=StudyState.PENDING,
            settings=settings.model_dump(mode="json"), protocol=protocol.model_dump(mode="json"),
            space_size=space_size, created_at=now, trials_done=0, kind=kind,
            step=step.to_json() if step is not None else None, submission_id=submission_id,
        ))
        # what never changes is what was just written (no read back)
        self.store.fixed[row.id] = _Fixed(problem, hardware.identity(), hardware_id, problem_id, settings, protocol,
                                          space_size, row.created_at, StudyKind(kind), step, submission_id)
        self._locked.add(row.id)  # a row this transaction inserted is its own until it commits
        return self._remember_study(row)

    # what `_Fixed.of` reads: a study's fixed columns with its problem (if any) and hardware
    _FIXED = (studies.c.settings, studies.c.protocol, studies.c.space_size, studies.c.created_at, studies.c.kind,
              studies.c.step, studies.c.submission_id, studies.c.hardware_id, studies.c.problem_id)

    @staticmethod
    def _with_keys(query):
        return query.outerjoin(problems, problems.c.id == studies.c.problem_id) \
            .join(hardware_t, hardware_t.c.id == studies.c.hardware_id)

    def study(self, study_id: int, *, lock: bool = False) -> StudyRecord:
        seen = self._studies.get(study_id)
        if seen is not None and (not lock or study_id in self._locked):
            return seen
        row = self._first(_STUDY_LOCKED if lock else _STUDY, {"study_id": study_id})
        if row is None:
            raise NotFoundError(f"study {study_id} does not exist")
        if lock:
            self._locked.add(study_id)
        return self._remember_study(row)

    def _remember_study(self, row, prefix: str = "") -> StudyRecord:
        """A study from a row of `_MUTABLE` columns (named ``prefix`` + column in a joined row), kept
        for the rest of this transaction."""
        study_id = getattr(row, f"{prefix}id")
        record = self._study_record(self._fixed(study_id, getattr(row, f"{prefix}created_at")), row, prefix)
        self._studies[study_id] = record
        return record

    def _fixed(self, study_id: int, created_at: dt.datetime) -> _Fixed:
        fixed = self.store.fixed.get(study_id)
        if fixed is None or fixed.created_at != created_at:
            row = self._one(self._with_keys(select(*self._FIXED, *_problem_columns(), *_hardware_columns()))
                            .where(studies.c.id == study_id))
            if row is None:
                raise NotFoundError(f"study {study_id} does not exist")
            fixed = self.store.fixed[study_id] = _Fixed.of(row)
        return fixed

    @staticmethod
    def _study_record(fixed: _Fixed, row, prefix: str = "") -> StudyRecord:
        def get(name):
            return getattr(row, prefix + name)

        return StudyRecord(
            id=get("id"), problem=fixed.problem, hardware=fixed.hardware, settings=fixed.settings,
            protocol=fixed.protocol, space_size=fixed.space_size, state=StudyState(get("state")),
            created_at=fixed.created_at, stop_reason=get("stop_reason"), message=get("message"),
            started_at=get("started_at"), finished_at=get("finished_at"), trials_done=get("trials_done"),
            best_trial_id=get("best_trial_id"), best_ratio=get("best_ratio"), kind=fixed.kind, step=fixed.step,
            submission_id=fixed.submission_id)

    def trials(self, study_id: int, *, measurements: bool = False) -> list[TrialRecord]:
        rows = self._rows(_TRIALS_MEASURED if measurements else _TRIALS, {"study_id": study_id})
        return [_trial_record(row, measurements) for row in rows]

    def trial(self, trial_id: int, *, lock: bool = False) -> TrialRecord:
        row = self._first(_TRIAL_LOCKED if lock else _TRIAL_ONE, {"trial_id": trial_id})
        if row is None:
            raise NotFoundError(f"trial {trial_id} does not exist")
        return _trial_record(row, True)

    def add_trials(self, study_id, kind, candidates, now, *, after: int | None = None) -> list[TrialRecord]:
        if after is None:
            after = self.scalar(select(func.max(trials.c.number)).where(trials.c.study_id == study_id)) or 0
        records = []
        for number, configs in enumerate(candidates, start=after + 1):
            configs = tuple(configs)
            if kind == TrialKind.SEARCH and decomposition_of(configs[0].id) != configs[0]:
                raise ValueError(f"{configs[0]!r} does not round-trip through its id {configs[0].id!r}")
            records.append(TrialRecord(id=0, study_id=study_id, number=number, kind=kind, decompositions=configs,
                                       state=TrialState.PENDING, created_at=now))
        if not records:
            return []
        rows = [dict(study_id=study_id, number=r.number, kind=kind, decompositions=[
            d.model_dump(mode="json") for d in r.decompositions], decomposition_id=r.decomposition_id,
            state=TrialState.PENDING, attempts=0, created_at=now) for r in records]
        if len(rows) == 1:  # a refill's one proposal
            return [dataclasses.replace(records[0], id=self._first(_INSERT_TRIAL, rows[0]).id)]
        ids = {number: i for i, number in self._rows(_insert_trials(len(rows)), {
            f"{column}_{i}": value for i, row in enumerate(rows) for column, value in row.items()})}
        return [dataclasses.replace(r, id=ids[r.number]) for r in records]

    def claim_leased(self, *, hardware: Hardware, worker_id: int, now: dt.datetime, seconds: float,
                     ending: str | None = None) -> tuple[TrialRecord, LeaseInfo] | None:
        """`claim` the oldest pending trial on ``hardware`` for ``worker_id`` and lease it to the worker for
        ``seconds`` (on PostgreSQL one statement), or None; ``ending``: a lease that ends first, as by
        `end_lease` (in the same statement).  The caller's engine takes the claimed trial's study through
        its own transitions (`Engine.claimed`)."""
        lease_id, expires_at = str(uuid.uuid4()), now + dt.timedelta(seconds=seconds)
        if not self.store.db.is_postgres:
            if ending is not None:
                self.end_lease(ending)
            trial = self.claim(hardware=hardware, worker_id=worker_id, now=now)
            return (trial, self.add_lease(trial_id=trial.id, worker_id=worker_id, now=now, seconds=seconds,
                                          lease_id=lease_id)) if trial is not None else None
        parameters = {"claimer": worker_id, "hardware_key": hardware.identity().key, "lease_id": lease_id,
                      "now": now, "until": expires_at}
        if ending is not None:
            parameters["_lease_id"] = ending
        row = self._first(_claim_leased(ending is not None), parameters)
        if row is None:
            return None
        self._remember_study(row, "owner_")
        return _trial_record(row, False), LeaseInfo(id=lease_id, trial_id=row.id, worker_id=worker_id,
                                                    expires_at=expires_at, active=True)

    def claim(self, *, study_ids=None, hardware=None, worker_id=None, now) -> TrialRecord | None:
        parameters = {"claimer": worker_id}
        if study_ids is not None:
            parameters["study_ids"] = list(study_ids)
        if hardware is not None:
            parameters["hardware_key"] = hardware.identity().key
        with_study = self.store.db.is_postgres
        row = self._first(_claim(study_ids is not None, hardware is not None, with_study), parameters)
        if row is None:
            return None
        if with_study:
            self._remember_study(row, "owner_")
        return _trial_record(row, False)

    def update_study(self, study_id: int, **changes) -> None:
        self._studies.pop(study_id, None)
        self._rows(_UPDATE_STUDY, {"_study_id": study_id, **changes})

    def update_trial(self, trial_id: int, **changes) -> None:
        self._rows(_UPDATE_TRIAL, {"_trial_id": trial_id, **_trial_columns(changes)})

    def update_trial_and_study(self, trial_id: int, trial_changes: dict, study_id: int, study_changes: dict) -> None:
        if not self.store.db.is_postgres:  # SQLite: no writes inside WITH
            self.update_trial(trial_id, **trial_changes)
            self.update_study(study_id, **study_changes)
            return
        self._studies.pop(study_id, None)
        trial_changes = _trial_columns(trial_changes)
        self._rows(_update_trial_and_study(tuple(trial_changes), tuple(study_changes)),
                   {"_trial_id": trial_id, **{f"trial_{k}": v for k, v in trial_changes.items()},
                    "_study_id": study_id, **{f"study_{k}": v for k, v in study_changes.items()}})

    def waiting_step_studies(self, hardware: Hardware) -> list[StudyRecord]:
        return self._step_studies(hardware, [StudyState.PENDING], lock=True)

    def active_step_studies(self, hardware: Hardware) -> list[StudyRecord]:
        return self._step_studies(hardware, sorted(ACTIVE_STUDY_STATES), lock=False)

    def _step_studies(self, hardware: Hardware, states: Sequence[StudyState], *, lock: bool) -> list[StudyRecord]:
        ids = self.execute(select(studies.c.id).join(hardware_t, hardware_t.c.id == studies.c.hardware_id)
                           .where(studies.c.kind == StudyKind.STEP.value,
                                  studies.c.state.in_([state.value for state in states]),
                                  hardware_t.c.key == hardware.identity().key).order_by(studies.c.id)).scalars().all()
        return [self.study(i, lock=lock) for i in ids]

    def step_study_of(self, submission_id: int) -> StudyRecord | None:
        """The newest step study of a submission."""
        found = self.scalar(select(studies.c.id).where(studies.c.submission_id == submission_id,
                                                       studies.c.kind == StudyKind.STEP.value)
                            .order_by(studies.c.id.desc()).limit(1))
        return self.study(found) if found is not None else None

    def tuned_config(self, problem: Problem, hardware: Hardware) -> TunedConfig | None:
        found = self.tuned(problem, hardware)
        return found.config if found is not None else None

    def save_overrides(self, model: str, hardware: Hardware, overrides: Sequence[RoleOverride]) -> None:
        hardware_id = self.hardware_id(hardware, create=True)
        self.execute(delete(overrides_t).where(overrides_t.c.model == model, overrides_t.c.hardware_id == hardware_id))
        for o in overrides:
            self.execute(insert(overrides_t).values(
                model=model, role=o.role, hardware_id=hardware_id, configs=o.configs.model_dump(mode="json"),
                problems=None if o.problems is None else {s: p.model_dump(mode="json") for s, p in o.problems.items()},
                reason=o.reason, step_speedup=o.step_speedup, updated_at=dt.datetime.now(dt.UTC)))

    def overrides(self, *, model: str | None = None, hardware: Hardware | None = None, platform: str | None = None,
                  device_kind: str | None = None) -> list[RoleOverride]:
        query = select(overrides_t, *_hardware_columns()).join(hardware_t, hardware_t.c.id == overrides_t.c.hardware_id)
        if model is not None:
            query = query.where(overrides_t.c.model == model)
        if hardware is not None:
            query = query.where(hardware_t.c.key == hardware.identity().key)
        if platform:
            query = query.where(hardware_t.c.platform == platform)
        if device_kind:
            query = query.where(hardware_t.c.device_kind == device_kind)
        found = []
        for r in self.execute(query.order_by(overrides_t.c.model, overrides_t.c.role)):
            try:
                found.append(RoleOverride(
                    model=r.model, role=r.role, hardware=_hardware(r), configs=OpConfigs.model_validate(r.configs),
                    reason=r.reason, step_speedup=r.step_speedup,
                    problems=None if r.problems is None else {s: Problem.model_validate(p)
                                                              for s, p in r.problems.items()}))
            except ValidationError as exc:  # stored before its checks existed: never served
                log.warning("override of %s role %s on %s:%s does not fit its problems, not served: %s",
                            r.model, r.role, r.platform, r.device_kind, exc.errors()[0]["msg"])
        return found

    def save_tuned(self, config: TunedConfig, *, study_id: int | None) -> None:
        problem_id = self.problem_id(config.problem, create=True)
        hardware_id = self.hardware_id(config.hardware, create=True)
        values = dict(
            decomposition=config.decomposition.model_dump(mode="json"), time_s=config.time_s,
            baseline_s=config.baseline_s, speedup=config.speedup, speedup_iqr=config.speedup_iqr,
            trials=config.trials, invalid=config.invalid, failed=config.failed, space_size=config.space_size,
            software={"jax": config.jax_version, "jaxlib": config.jaxlib_version},
            updated_at=dt.datetime.now(dt.UTC), study_id=study_id,
        )
        existing = self._first(_TUNED_ID, {"problem_id": problem_id, "hardware_id": hardware_id})
        if existing is None:
            self._rows(_INSERT_TUNED, dict(problem_id=problem_id, hardware_id=hardware_id, **values))
        else:
            self._rows(_UPDATE_TUNED, {"_tuned_id": existing.id, **values})

    # --- studies for the API ------------------------------------------------------------------

    def find_study(self, problem: Problem, hardware: Hardware) -> StudyRecord | None:
        """The newest study of this (problem, hardware) that is active or completed."""
        problem_id, hardware_id = self.problem_id(problem), self.hardware_id(hardware)
        if problem_id is None or hardware_id is None:
            return None
        found = self._first(_FIND_STUDY, {"problem_id": problem_id, "hardware_id": hardware_id})
        return self.study(found.id) if found is not None else None

    def list_studies(self, *, state: StudyState | None, hardware: str | None, offset: int,
                     limit: int) -> tuple[list[StudyRecord], int]:
        """A page of studies, newest first, and the total; two queries whatever the page size."""
        query = self._with_keys(select(*_MUTABLE, *self._FIXED[:3], *self._FIXED[4:], *_problem_columns(),
                                       *_hardware_columns()))
        count = select(func.count()).select_from(studies)
        if state is not None:
            query, count = query.where(studies.c.state == state), count.where(studies.c.state == state)
        if hardware:
            query = query.where(hardware_t.c.key == hardware)
            count = count.join(hardware_t, hardware_t.c.id == studies.c.hardware_id).where(hardware_t.c.key == hardware)
        total = self.scalar(count)
        records = []
        for row in self.execute(query.order_by(studies.c.id.desc()).offset(offset).limit(limit)):
            fixed = self.store.fixed.get(row.id)
            if fixed is None or fixed.created_at != row.created_at:
                fixed = self.store.fixed[row.id] = _Fixed.of(row)
            records.append(self._study_record(fixed, row))
        return records, int(total or 0)

    def leased_counts(self, study_ids: Sequence[int]) -> dict[int, int]:
        """Trials currently leased, per study."""
        if not study_ids:
            return {}
        return dict(self.execute(
            select(trials.c.study_id, func.count()).where(trials.c.study_id.in_(list(study_ids)),
                                                          trials.c.state == TrialState.LEASED)
            .group_by(trials.c.study_id)).all())

    def trial_decompositions(self, trial_ids: Sequence[int]) -> dict[int, Decomposition]:
        """The candidates of search trials, by id (for the best-so-far of a page of studies)."""
        if not trial_ids:
            return {}
        rows = self.execute(select(trials.c.id, trials.c.decomposition_id)
                                    .where(trials.c.id.in_(list(trial_ids))))
        return {row.id: decomposition_of(row.decomposition_id) for row in rows}

    def tuned_of_studies(self, study_ids: Sequence[int]) -> dict[int, TunedConfig]:
        """The tuned configs written by these studies."""
        if not study_ids:
            return {}
        return {row.study_id: row.config for row in self._tuned(tuned_t.c.study_id.in_(list(study_ids)))}

    def count_studies_by_state(self) -> dict[str, int]:
        return {str(s): n for s, n in self.execute(
            select(studies.c.state, func.count()).group_by(studies.c.state)).all()}

    def count_trials_by_state(self) -> dict[str, int]:
        return {str(s): n for s, n in self.execute(
            select(trials.c.state, func.count()).group_by(trials.c.state)).all()}

    # --- tuned configs ------------------------------------------------------------------------

    def _tuned(self, *conditions) -> list[TunedRow]:
        rows = self.execute(
            select(tuned_t, *_problem_columns(), *_hardware_columns())
            .join(problems, problems.c.id == tuned_t.c.problem_id)
            .join(hardware_t, hardware_t.c.id == tuned_t.c.hardware_id)
            .where(*conditions).order_by(tuned_t.c.id))
        return [TunedRow(_tuned_config(row), row.study_id) for row in rows]

    def tuned(self, problem: Problem, hardware: Hardware) -> TunedRow | None:
        if self.problem_id(problem) is None:
            return None
        found = self._tuned(problems.c.key == problem.key, hardware_t.c.key == hardware.identity().key)
        return found[0] if found else None

    def list_tuned(self, *, platform: str | None = None, device_kind: str | None = None,
                   hardware: str | None = None) -> list[TunedConfig]:
        return [row.config for row in self.tuned_rows(platform=platform, device_kind=device_kind, hardware=hardware)]

    def tuned_rows(self, *, platform: str | None = None, device_kind: str | None = None,
                   hardware: str | None = None) -> list[TunedRow]:
        conditions = []
        if platform:
            conditions.append(hardware_t.c.platform == platform)
        if device_kind:
            conditions.append(hardware_t.c.device_kind == device_kind)
        if hardware:
            conditions.append(hardware_t.c.key == hardware)
        return self._tuned(*conditions)

    # --- workers and leases -------------------------------------------------------------------

    def add_worker(self, *, name: str, hardware: Hardware, software: dict, memory_bytes: int | None,
                   now: dt.datetime) -> tuple[int, str]:
        """A new worker and its credential (``cmw_<id>_<secret>``, shown once; only its hash is stored)."""
        worker_id = self.execute(insert(workers).values(
            name=name, hardware_id=self.hardware_id(hardware, create=True), software=software, registered_at=now,
            last_heartbeat=now, active=True, trials_done=0, memory_bytes=memory_bytes).returning(workers.c.id)
        ).scalar_one()
        credential = f"cmw_{worker_id}_{secrets.token_urlsafe(32)}"
        self.execute(update(workers).where(workers.c.id == worker_id).values(credential_hash=hash_token(credential)))
        return worker_id, credential

    def worker_of_credential(self, credential: str) -> int | None:
        """The active worker a credential belongs to, or None."""
        worker_id = credential_worker_id(credential)
        if worker_id is None:
            return None
        return self.scalar(select(workers.c.id).where(workers.c.id == worker_id, workers.c.active.is_(True),
                                                      workers.c.credential_hash == hash_token(credential)))

    def hardware_memory(self, hardware: Hardware) -> int | None:
        """The most device memory any worker of ``hardware`` (now or before) reported (None: none did).

        A problem that does not fit it fits no worker known to the service.
        """
        return self._first(_HARDWARE_MEMORY, {"key": hardware.identity().key})[0]

    def worker(self, worker_id: int) -> WorkerInfo:
        """An active worker; `NotFoundError` (register again) otherwise."""
        found = self.workers(worker_id=worker_id)
        if not found:
            raise NotFoundError(f"worker {worker_id} is not registered; register again with POST /v1/workers")
        return found[0]

    def workers(self, *, include_inactive: bool = False, worker_id: int | None = None) -> list[WorkerInfo]:
        query = select(workers, *_hardware_columns()).join(hardware_t, hardware_t.c.id == workers.c.hardware_id)
        if not include_inactive:
            query = query.where(workers.c.active.is_(True))
        if worker_id is not None:
            query = query.where(workers.c.id == worker_id)
        return [WorkerInfo(id=r.id, name=r.name, hardware=_hardware(r), software=r.software,
                           registered_at=r.registered_at, last_heartbeat=r.last_heartbeat, active=r.active,
                           trials_done=r.trials_done, memory_bytes=r.memory_bytes)
                for r in self.execute(query.order_by(workers.c.id))]

    def touch_worker(self, worker_id: int, now: dt.datetime, *, at_most_every_s: float = 0.0) -> WorkerInfo:
        """Mark an active worker alive and return it (one statement; its hardware is cached).

        Args:
            at_most_every_s: a worker this process marked alive more recently is not written again
                (a busy worker leases several times a second; "online" is judged over a minute).

        Raises:
            NotFoundError: the worker is not registered (or left).
        """
        touched = self.store.touched.get(worker_id)
        if touched is not None and time.monotonic() - touched[0] < at_most_every_s:
            return touched[1]
        row = self._first(_TOUCH_WORKER, {"_worker_id": worker_id, "now": now})
        if row is None:
            raise NotFoundError(f"worker {worker_id} is not registered; register again with POST /v1/workers")
        hardware = self.store.hardware.get(row.hardware_id)
        if hardware is None:
            hardware = _hardware(self._one(select(*_hardware_columns()).where(hardware_t.c.id == row.hardware_id)))
            self.store.hardware[row.hardware_id] = hardware
        worker = WorkerInfo(id=row.id, name=row.name, hardware=hardware, software=row.software,
                            registered_at=row.registered_at, last_heartbeat=row.last_heartbeat, active=row.active,
                            trials_done=row.trials_done, memory_bytes=row.memory_bytes)
        if len(self.store.touched) >= MAX_TOUCHED:
            self.store.touched.clear()
        self.store.touched[worker_id] = (time.monotonic(), worker)
        return worker

    def end_lease(self, lease_id: str) -> None:
        """The lease is no longer active and its worker has one more trial done (on PostgreSQL one
        statement)."""
        if self.store.db.is_postgres:
            self._rows(_END_LEASE_COUNTED, {"_lease_id": lease_id})
        else:
            (worker_id,) = self._first(_END_LEASE, {"_lease_id": lease_id})
            self._rows(_COUNT_WORKER_TRIAL, {"_worker_id": worker_id})

    def update_worker(self, worker_id: int, **changes) -> None:
        self.store.touched.pop(worker_id, None)  # a changed worker is read afresh by its next lease
        self.execute(update(workers).where(workers.c.id == worker_id).values(**changes))

    def count_workers_online(self, *, since: dt.datetime) -> int:
        return int(self.scalar(select(func.count()).select_from(workers).where(
            workers.c.active.is_(True), workers.c.last_heartbeat >= since)) or 0)

    def add_lease(self, *, trial_id: int, worker_id: int, now: dt.datetime, seconds: float,
                  lease_id: str | None = None) -> LeaseInfo:
        lease = LeaseInfo(id=lease_id or str(uuid.uuid4()), trial_id=trial_id, worker_id=worker_id,
                          expires_at=now + dt.timedelta(seconds=seconds), active=True)
        self._rows(_INSERT_LEASE, {"created_at": now, **dataclasses.asdict(lease)})
        return lease

    def lease(self, lease_id: str, *, lock: bool = False) -> LeaseInfo | None:
        row = self._first(_LEASE_LOCKED if lock else _LEASE, {"lease_id": lease_id})
        return LeaseInfo(**row._asdict()) if row is not None else None

    def lease_and_trial(self, lease_id: str, trial_id: int) -> tuple[LeaseInfo | None, TrialRecord]:
        """The lease and the trial a result names, both locked for this transaction, with the trial's
        study (one statement when the lease holds the trial).

        Raises:
            NotFoundError: there is no such trial.
        """
        row = self._first(_LEASE_AND_TRIAL, {"lease_id": lease_id, "trial_id": trial_id})
        if row is None:  # no such lease, or one of another trial: the caller says which
            return self.lease(lease_id, lock=True), self.trial(trial_id, lock=True)
        held = LeaseInfo(id=row.lease_id, trial_id=row.id, worker_id=row.lease_worker_id,
                         expires_at=row.lease_expires_at, active=row.lease_active)
        self._locked.add(self._remember_study(row, "owner_").id)
        return held, _trial_record(row, True)

    def update_lease(self, lease_id: str, **changes) -> None:
        self._rows(_UPDATE_LEASE, {"_lease_id": lease_id, **changes})

    def active_leases(self, *, expired_before: dt.datetime | None = None, worker_id: int | None = None,
                      study_id: int | None = None) -> list[LeaseInfo]:
        """Active leases (expired ones, a worker's, or a study's), locked for this transaction."""
        query = select(*_LEASE_COLUMNS).where(leases.c.active.is_(True))
        if expired_before is not None:
            query = query.where(leases.c.expires_at < expired_before)
        if worker_id is not None:
            query = query.where(leases.c.worker_id == worker_id)
        if study_id is not None:
            query = query.where(leases.c.trial_id.in_(select(trials.c.id).where(trials.c.study_id == study_id)))
        return [LeaseInfo(**row._mapping) for row in self.execute(
            query.order_by(leases.c.created_at).with_for_update(skip_locked=True))]

    def current_trials(self) -> dict[int, int]:
        """worker id -> the trial it holds an active lease on."""
        rows = self.execute(select(leases.c.worker_id, leases.c.trial_id).where(leases.c.active.is_(True)))
        return {worker_id: trial_id for worker_id, trial_id in rows}

    def count_active_leases(self) -> int:
        return int(self.scalar(select(func.count()).select_from(leases).where(leases.c.active.is_(True)))
                   or 0)

    # --- submissions --------------------------------------------------------------------------

    def lock_hardware(self, hardware: Hardware) -> None:
        """Serialise this transaction with every other that locks ``hardware`` (its row, made if missing)
        until it ends: submissions of one model on one hardware then see each other's step study.
        SQLite's write transactions are serial already."""
        hardware_id = self.hardware_id(hardware, create=True)
        self.execute(select(hardware_t.c.id).where(hardware_t.c.id == hardware_id).with_for_update())

    def add_submission(self, *, model: dict, mesh: dict, hardware: Hardware, now: dt.datetime) -> int:
        return self.execute(insert(Submission.__table__).values(
            model=model, mesh=mesh, hardware_id=self.hardware_id(hardware, create=True), created_at=now)
            .returning(Submission.__table__.c.id)).scalar_one()

    def link_submission(self, *, submission_id: int, study_id: int | None, problem: Problem, roles: Sequence[str],
                        count: int) -> None:
        self.execute(insert(SubmissionStudy.__table__).values(
            submission_id=submission_id, study_id=study_id, problem_id=self.problem_id(problem, create=True),
            roles=list(roles), count=count))

    def submissions(self, *, limit: int = 100, submission_id: int | None = None) -> list[dict]:
        """Submissions, newest first: id, model, mesh, hardware, created_at and entries."""
        sub, link = Submission.__table__, SubmissionStudy.__table__
        query = select(sub, *_hardware_columns()).join(hardware_t, hardware_t.c.id == sub.c.hardware_id)
        if submission_id is not None:
            query = query.where(sub.c.id == submission_id)
        rows = self.execute(query.order_by(sub.c.id.desc()).limit(limit)).all()
        if not rows:
            return []
        entries: dict[int, list[dict]] = {row.id: [] for row in rows}
        for e in self.execute(
                select(link.c.submission_id, link.c.study_id, link.c.roles, link.c.count, *_problem_columns())
                .join(problems, problems.c.id == link.c.problem_id)
                .where(link.c.submission_id.in_(list(entries))).order_by(link.c.id)):
            entries[e.submission_id].append({"study_id": e.study_id, "roles": list(e.roles), "count": e.count,
                                             "problem": _problem(e)})
        return [{"id": r.id, "model": r.model, "mesh": r.mesh, "hardware": _hardware(r), "created_at": r.created_at,
                 "entries": entries[r.id]} for r in rows]

    # --- tokens -------------------------------------------------------------------------------

    def add_token(self, *, name: str, role: Role, value: str | None = None) -> tuple[int, str]:
        """A new token (random unless ``value``); only its SHA-256 is stored.  Returns its id and the token."""
        plain = value or "cmt_" + secrets.token_urlsafe(32)
        token_id = self.execute(insert(tokens).values(
            name=name, role=role, hash=hash_token(plain), created_at=dt.datetime.now(dt.UTC), revoked=False)
            .returning(tokens.c.id)).scalar_one()
        return token_id, plain

    def tokens(self) -> list[TokenInfo]:
        return [TokenInfo(id=r.id, name=r.name, role=Role(r.role), revoked=r.revoked, created_at=r.created_at)
                for r in self.execute(select(tokens.c.id, tokens.c.name, tokens.c.role, tokens.c.revoked,
                                                     tokens.c.created_at).order_by(tokens.c.id))]

    def revoke_token(self, token_id: int) -> TokenInfo:
        """Mark a token revoked (kept for the record); `NotFoundError` if there is none."""
        if self.execute(update(tokens).where(tokens.c.id == token_id).values(revoked=True)).rowcount == 0:
            raise NotFoundError(f"token {token_id} does not exist; see 'cmtune token list'")
        return next(t for t in self.tokens() if t.id == token_id)

    def token(self, token: str) -> TokenInfo | None:
        """The token's record (revoked ones too), by its hash."""
        row = self._one(select(tokens.c.id, tokens.c.name, tokens.c.role, tokens.c.revoked, tokens.c.created_at)
                        .where(tokens.c.hash == hash_token(token)))
        return TokenInfo(id=row.id, name=row.name, role=Role(row.role), revoked=row.revoked,
                         created_at=row.created_at) if row is not None else None


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def credential_worker_id(credential: str) -> int | None:
    """The worker id a credential names (``cmw_<id>_<secret>``), or None if it is not one."""
    prefix, _, rest = credential.partition("_")
    worker_id, _, secret = rest.partition("_")
    if prefix != "cmw" or not secret or not worker_id.isdigit() or len(worker_id) > 18:
        return None
    return int(worker_id)


def _problem_columns():
    return (problems.c.collective, problems.c.m, problems.c.k, problems.c.n, problems.c.dtype, problems.c.axis_size)


def _hardware_columns():
    return (hardware_t.c.platform, hardware_t.c.device_kind, hardware_t.c.device_count, hardware_t.c.process_count)


def _problem(row) -> Problem:
    return Problem(collective=row.collective, m=row.m, k=row.k, n=row.n, dtype=row.dtype, axis_size=row.axis_size)


def _hardware(row) -> Hardware:
    return Hardware(platform=row.platform, device_kind=row.device_kind, device_count=row.device_count,
                    process_count=row.process_count)


def _trial_columns(changes: dict) -> dict:
    """A trial's changes as its columns hold them (measurements and a step result as JSON)."""
    changes = dict(changes)
    if changes.get("measurements") is not None:
        changes["measurements"] = [m.model_dump(mode="json") for m in changes["measurements"]]
    if changes.get("step") is not None:  # a step trial's result lives where the measurements do
        changes["measurements"] = [changes.pop("step").model_dump(mode="json")]
    changes.pop("step", None)
    return changes


def _trial_record(row, with_measurements: bool) -> TrialRecord:
    kind = TrialKind(row.kind)
    if kind == TrialKind.SEARCH:
        decompositions = (decomposition_of(row.decomposition_id),)
    else:
        decompositions = tuple(Decomposition.model_validate(d) for d in row.decompositions)
    measurements = step = None
    if with_measurements and row.measurements is not None:
        if kind == TrialKind.STEP:
            step = StepMeasurement.model_validate(row.measurements[0])
        else:
            measurements = tuple(Measurement.model_validate(m) for m in row.measurements)
    return TrialRecord(
        id=row.id, study_id=row.study_id, number=row.number, kind=kind, decompositions=decompositions,
        state=TrialState(row.state), created_at=row.created_at, attempts=row.attempts, status=row.status,
        ratio=row.ratio, measurements=measurements, message=row.message, worker_id=row.worker_id,
        result_lease_id=row.result_lease_id, finished_at=row.finished_at, step=step)


def _tuned_config(row) -> TunedConfig:
    return TunedConfig(
        problem=_problem(row), hardware=_hardware(row), decomposition=Decomposition.model_validate(row.decomposition),
        time_s=row.time_s, baseline_s=row.baseline_s, speedup=row.speedup, speedup_iqr=row.speedup_iqr,
        trials=row.trials, invalid=row.invalid, failed=row.failed, space_size=row.space_size,
        jax_version=row.software.get("jax", ""), jaxlib_version=row.software.get("jaxlib", ""),
        tuned_at=row.updated_at.isoformat(timespec="seconds"))
