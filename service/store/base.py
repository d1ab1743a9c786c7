"""What the store's rooms share: the tables, one transaction's state (`Tx`: its connection, key ids, the
studies it has read) and the mapping of rows to domain records.

A study's problem, hardware, settings and protocol never change after it is created, so each process keeps
them in memory (`Fixed`, in `SqlStore.fixed`) and a study read fetches only its mutable columns
(`MUTABLE`); within a transaction a study is read once, until the transaction changes it.
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, insert, select

from cmtune.service.models import HardwareRow, Lease, ProblemRow, Study, Trial, TunedConfigRow, Worker
from cmtune.service.store.prepared import Prepared
from cmtune.tuner.errors import NotFoundError
from cmtune.tuner.search import SearchSettings
from cmtune.tuner.store import StepStudySpec, StudyRecord, TrialRecord, step_variants_of
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import (
    BoundsMeasurement,
    Measurement,
    MeasurementProtocol,
    Reconfirmation,
    StepChoice,
    StepMeasurement,
    StudyKind,
    StudyState,
    TrialKind,
    TrialState,
)
from collective_matmul.wire.bundle import TunedConfig

studies, trials, leases, workers = Study.__table__, Trial.__table__, Lease.__table__, Worker.__table__
problems, hardware_t, tuned_t = ProblemRow.__table__, HardwareRow.__table__, TunedConfigRow.__table__
P = bindparam  # the hot statements take their values as parameters (`Prepared`)

# a study's mutable columns; created_at tells a cached study from a row that reused its id after a rollback
MUTABLE = (studies.c.id, studies.c.created_at, studies.c.state, studies.c.stop_reason, studies.c.message,
           studies.c.started_at, studies.c.finished_at, studies.c.trials_done, studies.c.best_trial_id,
           studies.c.best_ratio, studies.c.decision)
OWNER = tuple(c.label(f"owner_{c.name}") for c in MUTABLE)  # a trial's study beside it, in one row
# what `Fixed.of` reads (with `PROBLEM` and `HARDWARE`): a study's columns that never change
FIXED = (studies.c.settings, studies.c.protocol, studies.c.space_size, studies.c.created_at, studies.c.kind,
         studies.c.step, studies.c.submission_id, studies.c.hardware_id, studies.c.problem_id, studies.c.software,
         studies.c.reconfirm)
PROBLEM = (problems.c.collective, problems.c.m, problems.c.k, problems.c.n, problems.c.dtype, problems.c.axis_size)
HARDWARE = (hardware_t.c.platform, hardware_t.c.device_kind, hardware_t.c.device_count, hardware_t.c.process_count,
            hardware_t.c.slice_devices)
TRIAL = (trials.c.id, trials.c.study_id, trials.c.number, trials.c.kind, trials.c.decompositions,
         trials.c.decomposition_id, trials.c.state, trials.c.created_at, trials.c.attempts, trials.c.status,
         trials.c.ratio, trials.c.message, trials.c.worker_id, trials.c.result_lease_id, trials.c.finished_at,
         trials.c.variants)
MEASURED = (trials.c.measurements, trials.c.bounds)  # a trial's results, read with the measurements only

_HARDWARE_ID = Prepared(select(hardware_t.c.id).where(hardware_t.c.key == P("key")))
_INSERT_HARDWARE = Prepared(insert(hardware_t).returning(hardware_t.c.id))
_PROBLEM_ID = Prepared(select(problems.c.id).where(problems.c.key == P("key")))
_INSERT_PROBLEM = Prepared(insert(problems).returning(problems.c.id))


def with_keys(query):
    """``query`` over studies, joined to its problem (if any) and hardware."""
    return query.outerjoin(problems, problems.c.id == studies.c.problem_id) \
        .join(hardware_t, hardware_t.c.id == studies.c.hardware_id)


@dataclass(frozen=True)
class Fixed:
    """The parts of a study that never change after it is created."""

    problem: Problem | None
    hardware: Hardware
    hardware_id: int
    problem_id: int | None
    settings: SearchSettings
    protocol: MeasurementProtocol
    space_size: int
    created_at: dt.datetime
    kind: StudyKind
    step: StepStudySpec | None
    submission_id: int | None
    software: Software | None = None
    reconfirm: Reconfirmation | None = None

    @classmethod
    def of(cls, row) -> Fixed:
        """From a row of the `FIXED`, `PROBLEM` and `HARDWARE` columns above."""
        return cls(problem_of(row) if row.problem_id is not None else None, hardware_of(row), row.hardware_id,
                   row.problem_id, SearchSettings.model_validate(row.settings),
                   MeasurementProtocol.model_validate(row.protocol),
                   row.space_size, row.created_at, StudyKind(row.kind),
                   StepStudySpec.from_json(row.step) if row.step else None, row.submission_id,
                   Software.of(row.software) if row.software is not None else None,
                   Reconfirmation.model_validate(row.reconfirm) if row.reconfirm is not None else None)


class Tx:
    """What the rooms of one transaction share: its connection and what it has read."""

    def __init__(self, connection: Connection, store):
        """``store``: the `SqlStore` whose caches this transaction reads and fills."""
        self.connection = connection  # Core statements in one transaction (no ORM unit of work)
        self.store = store
        self.is_postgres = store.db.is_postgres
        # studies read in this transaction, until it changes them; those it has locked are in `locked`
        self.studies: dict[int, StudyRecord] = {}
        self.locked: set[int] = set()
        self.ids: dict[tuple[str, str], int | None] = {}  # (table, key) -> id, as this transaction found it

    def execute(self, statement, parameters=None):
        return self.connection.execute(statement, parameters)

    def scalar(self, statement, parameters=None):
        return self.connection.execute(statement, parameters).scalar()

    def one(self, statement, parameters=None):
        return self.connection.execute(statement, parameters).one_or_none()

    def rows(self, prepared: Prepared, parameters=None) -> list:
        return prepared.rows(self.connection, parameters)

    def first(self, prepared: Prepared, parameters=None):
        return prepared.one(self.connection, parameters)

    # --- key ids ------------------------------------------------------------------------------

    def hardware_id(self, hardware: Hardware, *, create: bool = False) -> int | None:
        hw = hardware.identity()
        return self._key_id("hardware", hw.key, _HARDWARE_ID, _INSERT_HARDWARE, dict(
            key=hw.key, platform=hw.platform, device_kind=hw.device_kind, device_count=hw.device_count,
            process_count=hw.process_count, slice_devices=hw.slice_devices) if create else None)

    def problem_id(self, problem: Problem, *, create: bool = False) -> int | None:
        return self._key_id("problems", problem.key, _PROBLEM_ID, _INSERT_PROBLEM,
                            {"key": problem.key, **problem.model_dump()} if create else None)

    def _key_id(self, table: str, key: str, find: Prepared, add: Prepared, values: dict | None) -> int | None:
        """The id of the row of ``table`` with ``key``, inserted from ``values`` if there is none (and they
        are given); a transaction looks each key up once (such rows are never changed or deleted)."""
        if (table, key) in self.ids:
            found = self.ids[table, key]
        else:
            row = self.first(find, {"key": key})
            found = row.id if row is not None else None
        if found is None and values is not None:
            found = self.first(add, values).id
        self.ids[table, key] = found
        return found

    # --- studies ------------------------------------------------------------------------------

    def remember_study(self, row, prefix: str = "") -> StudyRecord:
        """A study from a row of `MUTABLE` columns (named ``prefix`` + column in a joined row, as `OWNER`),
        kept for the rest of this transaction."""
        study_id = getattr(row, f"{prefix}id")
        record = study_record(self.fixed(study_id, getattr(row, f"{prefix}created_at")), row, prefix)
        self.studies[study_id] = record
        return record

    def fixed(self, study_id: int, created_at: dt.datetime, row=None) -> Fixed:
        """What never changes of a study, from the process's cache, else from ``row`` (of `FIXED` columns)
        or the database."""
        fixed = self.store.fixed.get(study_id)
        if fixed is None or fixed.created_at != created_at:
            if row is None:
                row = self.one(with_keys(select(*FIXED, *PROBLEM, *HARDWARE)).where(studies.c.id == study_id))
            if row is None:
                raise NotFoundError(f"study {study_id} does not exist")
            fixed = self.store.fixed[study_id] = Fixed.of(row)
        return fixed


# --- rows -> records --------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def decomposition_of(decomposition_id: str) -> Decomposition:
    """A search trial's candidate from its stored id (ids round-trip; checked when stored)."""
    return Decomposition.from_id(decomposition_id)


def problem_of(row) -> Problem:
    return Problem(collective=row.collective, m=row.m, k=row.k, n=row.n, dtype=row.dtype, axis_size=row.axis_size)


def hardware_of(row) -> Hardware:
    return Hardware(platform=row.platform, device_kind=row.device_kind, device_count=row.device_count,
                    process_count=row.process_count, slice_devices=row.slice_devices)


def study_record(fixed: Fixed, row, prefix: str = "") -> StudyRecord:
    def get(name):
        return getattr(row, prefix + name)

    return StudyRecord(
        id=get("id"), problem=fixed.problem, hardware=fixed.hardware, settings=fixed.settings,
        protocol=fixed.protocol, space_size=fixed.space_size, state=StudyState(get("state")),
        created_at=fixed.created_at, stop_reason=get("stop_reason"), message=get("message"),
        started_at=get("started_at"), finished_at=get("finished_at"), trials_done=get("trials_done"),
        best_trial_id=get("best_trial_id"), best_ratio=get("best_ratio"), kind=fixed.kind, step=fixed.step,
        submission_id=fixed.submission_id, decision=_decision(get("decision")), software=fixed.software,
        reconfirm=fixed.reconfirm)


def _decision(stored: dict | None) -> StepChoice | None:
    return StepChoice.model_validate(stored) if stored is not None else None


def trial_record(row, with_measurements: bool) -> TrialRecord:
    kind = TrialKind(row.kind)
    if kind == TrialKind.SEARCH:
        decompositions = (decomposition_of(row.decomposition_id),)
    else:
        decompositions = tuple(Decomposition.model_validate(d) for d in row.decompositions)
    measurements = step = bounds = None
    if with_measurements and row.measurements is not None:
        if kind == TrialKind.STEP:
            step = StepMeasurement.model_validate(row.measurements[0])
        else:
            measurements = tuple(Measurement.model_validate(m) for m in row.measurements)
    if with_measurements and row.bounds is not None:
        bounds = BoundsMeasurement.model_validate(row.bounds)
    return TrialRecord(
        id=row.id, study_id=row.study_id, number=row.number, kind=kind, decompositions=decompositions,
        state=TrialState(row.state), created_at=row.created_at, attempts=row.attempts, status=row.status,
        ratio=row.ratio, measurements=measurements, message=row.message, worker_id=row.worker_id,
        result_lease_id=row.result_lease_id, finished_at=row.finished_at, step=step, bounds=bounds,
        variants=step_variants_of(row.variants) if kind == TrialKind.STEP else None)


def tuned_config_of(row) -> TunedConfig:
    return TunedConfig(
        problem=problem_of(row), hardware=hardware_of(row),
        decomposition=Decomposition.model_validate(row.decomposition),
        time_s=row.time_s, baseline_s=row.baseline_s, speedup=row.speedup, speedup_iqr=row.speedup_iqr,
        trials=row.trials, invalid=row.invalid, failed=row.failed, space_size=row.space_size,
        software=Software.of(row.software), tuned_at=row.updated_at.isoformat(timespec="seconds"),
        compute_s=row.compute_s, communication_s=row.communication_s, bounds_baseline_s=row.bounds_baseline_s,
        overlap=row.overlap, memory_bytes=row.memory_bytes)


def tuned_select(*conditions):
    """Tuned configs (with their problem and hardware columns) that meet ``conditions``, in id order."""
    return select(tuned_t, *PROBLEM, *HARDWARE).join(problems, problems.c.id == tuned_t.c.problem_id) \
        .join(hardware_t, hardware_t.c.id == tuned_t.c.hardware_id).where(*conditions).order_by(tuned_t.c.id)
