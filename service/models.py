"""SQLAlchemy models: the service's tables (every change goes through an Alembic migration)."""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    MetaData,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from collective_matmul.wire import Status, StudyKind, StudyState, TrialKind, TrialState

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class TokenRole(StrEnum):
    """What a token may do (the tokens table's ``role``)."""

    ADMIN = "admin"
    WORKER = "worker"
    READER = "reader"


def enum_column(enum: type[StrEnum], name: str) -> Enum:
    """A string column holding an Enum's values, with a CHECK constraint on every backend."""
    return Enum(enum, name=name, native_enum=False, create_constraint=True, length=16,
                values_callable=lambda e: [member.value for member in e], validate_strings=True)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; use an aware UTC datetime")
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, dt.datetime: UTCDateTime()}


class HardwareRow(Base):
    __tablename__ = "hardware"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(300), unique=True)
    platform: Mapped[str] = mapped_column(String(64))
    device_kind: Mapped[str] = mapped_column(String(128))
    device_count: Mapped[int]  # the ring's
    process_count: Mapped[int]
    slice_devices: Mapped[int | None]  # the slice the ring is part of; None: the whole machine


class ProblemRow(Base):
    __tablename__ = "problems"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(200), unique=True)
    collective: Mapped[str] = mapped_column(String(32))
    m: Mapped[int]
    k: Mapped[int]
    n: Mapped[int]
    dtype: Mapped[str] = mapped_column(String(16))
    axis_size: Mapped[int]


class Submission(Base):
    """One model + mesh submitted; links the studies of its problems."""

    __tablename__ = "submissions"

    id: Mapped[int] = mapped_column(primary_key=True)
    model: Mapped[dict[str, Any]]
    mesh: Mapped[dict[str, Any]]
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    entries: Mapped[list[SubmissionStudy]] = relationship(back_populates="submission", order_by="SubmissionStudy.id")
    hardware: Mapped[HardwareRow] = relationship()


class Study(Base):
    """The search for one (problem, hardware)."""

    __tablename__ = "studies"

    id: Mapped[int] = mapped_column(primary_key=True)
    problem_id: Mapped[int | None] = mapped_column(ForeignKey("problems.id"), index=True, doc="None: a step study")
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"), index=True)
    kind: Mapped[StudyKind] = mapped_column(enum_column(StudyKind, "study_kind"), default=StudyKind.SEARCH,
                                            server_default="search")
    # a step study: the block, the mesh and the search studies it waits for (cmtune.tuner.store.StepStudySpec)
    step: Mapped[dict[str, Any] | None]
    # a completed step study: what its measurement decided (collective_matmul.wire.StepChoice)
    decision: Mapped[dict[str, Any] | None]
    # the software stack its trials run on (collective_matmul.planning.problem.Software; None: any worker of the
    # hardware), and its key, which the lease compares with a worker's
    software: Mapped[dict[str, Any] | None]
    software_key: Mapped[str | None] = mapped_column(String(64), index=True)
    # a re-confirmation study: the stored config it re-times on its stack (collective_matmul.wire.Reconfirmation)
    reconfirm: Mapped[dict[str, Any] | None]
    submission_id: Mapped[int | None] = mapped_column(ForeignKey("submissions.id", ondelete="SET NULL"))
    # the transitions: cmtune.tuner.states.STUDY_MOVES
    state: Mapped[StudyState] = mapped_column(enum_column(StudyState, "study_state"), index=True,
                                              default=StudyState.PENDING)
    settings: Mapped[dict[str, Any]]
    protocol: Mapped[dict[str, Any]]
    space_size: Mapped[int]
    stop_reason: Mapped[str | None] = mapped_column(String(64))
    message: Mapped[str | None] = mapped_column(String(2000))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    # progress, kept by the engine with each result (so listing studies reads no trials)
    trials_done: Mapped[int] = mapped_column(default=0)
    best_trial_id: Mapped[int | None]
    best_ratio: Mapped[float | None] = mapped_column(Float)

    problem: Mapped[ProblemRow | None] = relationship()
    hardware: Mapped[HardwareRow] = relationship()
    trials: Mapped[list[Trial]] = relationship(back_populates="study", order_by="Trial.number")


class SubmissionStudy(Base):
    __tablename__ = "submission_studies"

    id: Mapped[int] = mapped_column(primary_key=True)
    submission_id: Mapped[int] = mapped_column(ForeignKey("submissions.id", ondelete="CASCADE"), index=True)
    study_id: Mapped[int | None] = mapped_column(ForeignKey("studies.id", ondelete="SET NULL"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id"))
    roles: Mapped[list[Any]]
    count: Mapped[int]

    submission: Mapped[Submission] = relationship(back_populates="entries")
    study: Mapped[Study | None] = relationship()
    problem: Mapped[ProblemRow] = relationship()


class Trial(Base):
    """One candidate timed once (``kind='search'``), or the confirmation round (``'confirm'``)."""

    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("study_id", "number"),
        # the lease claim's scan: pending trials in study and number order
        Index("ix_trials_pending", "study_id", "number", postgresql_where=text("state = 'pending'"),
              sqlite_where=text("state = 'pending'")),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id", ondelete="CASCADE"), index=True)
    number: Mapped[int]
    kind: Mapped[TrialKind] = mapped_column(enum_column(TrialKind, "trial_kind"), default=TrialKind.SEARCH)
    # the candidate (search) or the contenders (confirm), as Decomposition JSON objects
    decompositions: Mapped[list[Any]]
    decomposition_id: Mapped[str] = mapped_column(String(64))
    # the transitions: cmtune.tuner.states.TRIAL_MOVES
    state: Mapped[TrialState] = mapped_column(enum_column(TrialState, "trial_state"), index=True,
                                              default=TrialState.PENDING)
    attempts: Mapped[int] = mapped_column(default=0)
    status: Mapped[Status | None] = mapped_column(enum_column(Status, "trial_status"))
    ratio: Mapped[float | None] = mapped_column(Float)
    measurements: Mapped[list[Any] | None]
    # a confirmation's bounds rounds (collective_matmul.wire.BoundsMeasurement)
    bounds: Mapped[dict[str, Any] | None]
    # a step trial's variants: name -> role -> OpConfigs JSON (None: the standard menu of its configs)
    variants: Mapped[dict[str, Any] | None]
    message: Mapped[str | None] = mapped_column(String(2000))
    worker_id: Mapped[int | None] = mapped_column(ForeignKey("workers.id", ondelete="SET NULL"))
    result_lease_id: Mapped[str | None] = mapped_column(String(36), doc="the lease whose report completed it")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None]

    study: Mapped[Study] = relationship(back_populates="trials")


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    software: Mapped[dict[str, Any]]
    registered_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_heartbeat: Mapped[dt.datetime] = mapped_column(default=utcnow)
    active: Mapped[bool] = mapped_column(Boolean, default=True, index=True)
    trials_done: Mapped[int] = mapped_column(default=0)
    # SHA-256 of the credential registration returned; every call of the worker carries it
    credential_hash: Mapped[str | None] = mapped_column(String(64))
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger, doc="memory of one device, as reported")

    hardware: Mapped[HardwareRow] = relationship()


class Lease(Base):
    __tablename__ = "leases"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"), index=True)
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(index=True)
    active: Mapped[bool] = mapped_column(Boolean, default=True, index=True)


class TunedConfigRow(Base):
    """The tuned config of one (problem, hardware, software stack)."""

    __tablename__ = "tuned_configs"
    __table_args__ = (UniqueConstraint("problem_id", "hardware_id", "software_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("problems.id"))
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"), index=True)
    study_id: Mapped[int | None] = mapped_column(ForeignKey("studies.id", ondelete="SET NULL"))
    decomposition: Mapped[dict[str, Any]]
    time_s: Mapped[float]
    baseline_s: Mapped[float]
    speedup: Mapped[float]
    speedup_iqr: Mapped[float] = mapped_column(default=0.0)
    trials: Mapped[int] = mapped_column(default=0)
    invalid: Mapped[int] = mapped_column(default=0)
    failed: Mapped[int] = mapped_column(default=0)
    space_size: Mapped[int] = mapped_column(default=0)
    # the bounds (collective_matmul.wire.bounds): the local matmul alone, the collective alone, and the
    # baseline timed with them (None: not measured)
    compute_s: Mapped[float | None] = mapped_column(Float)
    communication_s: Mapped[float | None] = mapped_column(Float)
    bounds_baseline_s: Mapped[float | None] = mapped_column(Float)
    software: Mapped[dict[str, Any]]  # the stack that measured it (collective_matmul.planning.problem.Software)
    software_key: Mapped[str] = mapped_column(String(64))  # Software.key of ``software``
    # the winner's compiled schedule verdict (collective_matmul.programs.schedule) and memory per device
    # (None: not recorded)
    overlap: Mapped[str | None] = mapped_column(String(16))
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    problem: Mapped[ProblemRow] = relationship()
    hardware: Mapped[HardwareRow] = relationship()


class RoleOverrideRow(Base):
    """What one role of one model runs on one hardware, decided by a step measurement (and why)."""

    __tablename__ = "role_overrides"
    __table_args__ = (UniqueConstraint("model", "role", "hardware_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(200))  # the block's roles, or a user's projection (open labels)
    hardware_id: Mapped[int] = mapped_column(ForeignKey("hardware.id"))
    configs: Mapped[dict[str, Any]]
    problems: Mapped[dict[str, Any] | None]  # the role's forward / grad_input / grad_weight problems
    reason: Mapped[str] = mapped_column(String(2000))
    step_speedup: Mapped[float | None] = mapped_column(Float)
    software: Mapped[dict[str, Any] | None]  # the stack of the step measurement that decided it
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Token(Base):
    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[TokenRole] = mapped_column(enum_column(TokenRole, "token_role"))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)


def __getattr__(name: str):
    """``Role``, the tokens' roles' old name, for one release (it shared the name of the library's role label)."""
    if name == "Role":
        import warnings

        warnings.warn("cmtune.service.models.Role is cmtune.service.models.TokenRole now; the old name goes in the "
                      "next release", DeprecationWarning, stacklevel=2)
        return TokenRole
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
