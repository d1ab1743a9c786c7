"""The wire contract: every type that crosses a process boundary, without JAX.

The service, the worker daemon, the command line, the `Tuned` client, the dashboard's API and the
tests all speak these types, so a field means the same thing everywhere:

- keys: `Problem`, `Hardware`, `Decomposition` (defined beside the ops, re-exported here);
- the measurement record: `Protocol`, `Timing`, `Measurement`, `Status`;
- the lifecycle: `StudyState`, `TrialState`, `TrialKind` (the database checks the same values);
- tuned configs and bundles: `TunedConfig`, `Bundle`;
- the REST API's bodies: ``XCreate`` in, ``XPublic`` out, and the worker's lease and result.

Public bodies carry the derived values (problem keys, hardware keys, decomposition ids, time
saved) so that no client re-implements them.  Importing this module imports pydantic, not JAX.
"""

from __future__ import annotations

import datetime as dt
import statistics
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from collective_matmul.bundle import Bundle, TunedConfig
from collective_matmul.decomposition import Decomposition
from collective_matmul.models import TransformerBlock
from collective_matmul.problem import Hardware, Problem

__all__ = [
    "Bundle", "Decomposition", "Hardware", "Measurement", "Problem", "Protocol", "Status", "StudyState", "Timing",
    "TrialKind", "TrialState", "TunedConfig",
]

# --- states -----------------------------------------------------------------------------------


class StudyState(StrEnum):
    """pending → running → confirming → completed; or failed / cancelled (final)."""

    PENDING = "pending"
    RUNNING = "running"
    CONFIRMING = "confirming"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        return self in ACTIVE_STUDY_STATES


ACTIVE_STUDY_STATES = frozenset({StudyState.PENDING, StudyState.RUNNING, StudyState.CONFIRMING})


class TrialState(StrEnum):
    """pending → leased → completed | failed; cancelled with its study."""

    PENDING = "pending"
    LEASED = "leased"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def in_flight(self) -> bool:
        return self in (TrialState.PENDING, TrialState.LEASED)


class TrialKind(StrEnum):
    """What a trial times: one search candidate, or the confirmation round of the top ones."""

    SEARCH = "search"
    CONFIRM = "confirm"


class Status(StrEnum):
    """The outcome of timing one candidate (every failure is a result, never a crash)."""

    OK = "ok"
    INVALID = "invalid"
    COMPILE_ERROR = "compile_error"
    OOM = "oom"
    TIMEOUT = "timeout"
    ERROR = "error"


# --- the measurement record -------------------------------------------------------------------


class Protocol(BaseModel):
    """How one trial is measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    warmup: int = Field(default=2, ge=0, le=100)
    repeats: int = Field(default=7, ge=1, le=1000)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    timeout_s: float = Field(default=300.0, gt=0, le=24 * 3600)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3), inclusive method; one value is its own quartiles."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


class Timing(BaseModel):
    """Samples of one program and their summary (seconds)."""

    samples_s: list[float]
    median_s: float
    iqr_s: float
    min_s: float
    max_s: float

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        q1, median, q3 = quartiles(samples)
        return cls(samples_s=samples, median_s=median, iqr_s=q3 - q1, min_s=min(samples), max_s=max(samples))


class Measurement(BaseModel):
    """The record of one candidate timed against the baseline; stored as is."""

    problem: Problem
    decomposition: Decomposition
    hardware: Hardware
    status: Status
    message: str = ""
    compile_s: float | None = None
    memory_bytes: int | None = None
    rel_error: float | None = None
    candidate: Timing | None = None
    baseline: Timing | None = None
    ratio: float | None = Field(default=None, description="median of candidate/baseline paired ratios")
    ratio_iqr: float | None = None
    protocol: Protocol = Protocol()

    @property
    def speedup(self) -> float | None:
        """Baseline time over candidate time (> 1 is faster than the baseline)."""
        return 1.0 / self.ratio if self.ratio else None

    @property
    def speedup_iqr(self) -> float:
        """IQR of the speedup, to first order from the ratio's IQR (d(1/r) = dr / r**2)."""
        return (self.ratio_iqr or 0.0) / self.ratio**2 if self.ratio else 0.0

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


# --- request and response bodies --------------------------------------------------------------

EXAMPLE_PROBLEM = {"collective": "allgather_matmul", "m": 1024, "k": 256, "n": 1024, "dtype": "float32",
                   "axis_size": 8}
EXAMPLE_HARDWARE = {"platform": "cpu", "device_kind": "cpu", "device_count": 8, "process_count": 1}


class HardwareIn(BaseModel):
    """The hardware to tune on (software versions are recorded from the workers)."""

    model_config = ConfigDict(extra="forbid")

    platform: str = Field(min_length=1, max_length=64)
    device_kind: str = Field(min_length=1, max_length=128)
    device_count: int = Field(gt=0, le=1 << 20)
    process_count: int = Field(default=1, gt=0, le=1 << 16)

    def to_hardware(self) -> Hardware:
        return Hardware(**self.model_dump())

    @classmethod
    def of(cls, hardware: Hardware) -> HardwareIn:
        return cls(**hardware.identity().model_dump(include={"platform", "device_kind", "device_count",
                                                             "process_count"}))


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trials: int | None = Field(default=None, ge=1, le=10_000, description="default: a quarter of the space (>= 4)")
    minutes: float | None = Field(default=None, gt=0, le=7 * 24 * 60)
    patience: int | None = Field(default=None, ge=1, le=10_000)


class MeshIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    axes: dict[str, int] = Field(description="mesh axis names and sizes, in order")
    tensor_axis: str = "model"


Sampler = Literal["auto", "enumerate", "tpe", "random"]


class StudyCreate(BaseModel):
    """A problem, or a model + mesh, to tune on some hardware."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            {"problem": EXAMPLE_PROBLEM, "hardware": EXAMPLE_HARDWARE, "budget": {"trials": 12}},
            {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}, "tensor_axis": "model"},
             "hardware": EXAMPLE_HARDWARE, "budget": {"trials": 8}, "sampler": "auto"},
        ]},
    )

    problem: Problem | None = None
    model: str | TransformerBlock | None = Field(default=None, description="preset name or block shape")
    mesh: MeshIn | None = None
    hardware: HardwareIn
    budget: Budget = Budget()
    sampler: Sampler = "auto"
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    repeats: int = Field(default=7, ge=1, le=1000)
    confirm_top: int = Field(default=3, ge=0, le=20)
    force: bool = Field(default=False, description="tune again even if tuned or under study")

    @model_validator(mode="after")
    def _one_target(self) -> StudyCreate:
        if (self.problem is None) == (self.model is None):
            raise ValueError("give either 'problem' or 'model' (with 'mesh')")
        if self.model is not None and self.mesh is None:
            raise ValueError("'model' needs 'mesh', e.g. {\"axes\": {\"data\": 1, \"model\": 8}}")
        return self


class BestSoFar(BaseModel):
    decomposition: Decomposition
    decomposition_id: str
    ratio: float
    speedup: float
    trial_id: int


class StudyPublic(BaseModel):
    id: int
    state: StudyState
    problem: Problem
    problem_key: str
    hardware: Hardware
    hardware_key: str
    settings: dict[str, Any]
    space_size: int
    trials_done: int
    trials_budget: int
    trials_running: int
    best: BestSoFar | None
    tuned: TunedConfig | None = None
    tuned_decomposition_id: str | None = None
    stop_reason: str | None
    message: str | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None


class Skipped(BaseModel):
    problem: str
    study_id: int | None
    reason: Literal["under study", "already tuned"]


class StudyCreated(BaseModel):
    studies: list[StudyPublic]
    submission_id: int | None = None
    skipped: list[Skipped] = Field(default_factory=list, description="problems already tuned or under study")


class StudyPage(BaseModel):
    items: list[StudyPublic]
    total: int
    offset: int
    limit: int


class TrialPublic(BaseModel):
    id: int
    study_id: int
    number: int
    kind: TrialKind
    decompositions: list[Decomposition]
    decomposition_id: str = Field(description="the candidate's id (search) or confirm:N (confirmation)")
    state: TrialState
    attempts: int
    status: Status | None
    ratio: float | None
    speedup: float | None
    median_s: float | None
    iqr_s: float | None
    baseline_s: float | None
    message: str | None
    worker_id: int | None
    created_at: dt.datetime
    finished_at: dt.datetime | None


class WorkerCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"name": "tpu-vm-0", "hardware": EXAMPLE_HARDWARE, "software": {"jax": "0.10.2", "jaxlib": "0.10.2"}}]})

    name: str = Field(min_length=1, max_length=200)
    hardware: HardwareIn
    software: dict[str, str] = Field(default_factory=dict)


class WorkerPublic(BaseModel):
    id: int
    name: str
    hardware: Hardware
    hardware_key: str
    software: dict[str, str]
    registered_at: dt.datetime
    last_heartbeat: dt.datetime
    online: bool
    active: bool
    current_trial_id: int | None
    trials_done: int


class LeasePublic(BaseModel):
    id: str
    expires_at: dt.datetime


class TrialTask(BaseModel):
    """What a worker runs: one candidate (search) or all contenders together (confirm)."""

    id: int
    study_id: int
    kind: TrialKind
    problem: Problem
    decomposition: Decomposition | None = Field(description="the candidate of a search trial")
    decompositions: list[Decomposition]
    protocol: Protocol


class LeaseGranted(BaseModel):
    lease: LeasePublic
    trial: TrialTask


class HeartbeatIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_id: str | None = Field(default=None, description="extend this lease too")


class HeartbeatOut(BaseModel):
    worker_id: int
    lease: LeasePublic | None = None


class ResultIn(BaseModel):
    """A trial's result: ``measurement`` for a search trial, ``measurements`` for a confirmation."""

    model_config = ConfigDict(extra="forbid")

    lease_id: str
    measurement: Measurement | None = None
    measurements: list[Measurement] | None = None

    @model_validator(mode="after")
    def _one(self) -> ResultIn:
        if (self.measurement is None) == (self.measurements is None):
            raise ValueError("give 'measurement' (search trial) or 'measurements' (confirmation)")
        return self

    @classmethod
    def of(cls, lease_id: str, kind: TrialKind, measurements: list[Measurement]) -> ResultIn:
        """The body for a trial of ``kind``."""
        if kind == TrialKind.SEARCH:
            return cls(lease_id=lease_id, measurement=measurements[0])
        return cls(lease_id=lease_id, measurements=measurements)

    @property
    def kind(self) -> TrialKind:
        return TrialKind.SEARCH if self.measurement is not None else TrialKind.CONFIRM

    @property
    def results(self) -> list[Measurement]:
        return [self.measurement] if self.measurement is not None else list(self.measurements or [])


class ResultOut(BaseModel):
    trial_id: int
    state: TrialState
    duplicate: bool = False


class ConfigQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    problem: Problem
    platform: str = Field(min_length=1, max_length=64)
    device_kind: str = Field(min_length=1, max_length=128)
    device_count: int | None = Field(default=None, gt=0, le=1 << 20)
    process_count: int = Field(default=1, gt=0, le=1 << 16)

    def hardware(self) -> Hardware:
        return Hardware(platform=self.platform, device_kind=self.device_kind,
                        device_count=self.device_count or self.problem.axis_size, process_count=self.process_count)


Match = Literal["exact", "nearest", "model", "baseline"]


class ConfigAnswer(BaseModel):
    """A config look-up's answer and which fallback produced it."""

    problem: Problem
    problem_key: str
    hardware: Hardware
    decomposition: Decomposition
    decomposition_id: str
    match: Match
    time_s: float | None = None
    baseline_s: float | None = None
    speedup: float | None = None
    source_problem: Problem | None = Field(default=None, description="the tuned problem a 'nearest' answer came from")
    software: dict[str, str] = Field(default_factory=dict)


class TunedPublic(TunedConfig):
    """A stored tuned config with its keys and id spelled out (`GET /v1/tuned`; bundles hold `TunedConfig`)."""

    problem_key: str
    hardware_key: str
    decomposition_id: str
    study_id: int | None = Field(description="the study that tuned it (None: imported from a bundle)")

    @classmethod
    def of(cls, config: TunedConfig, study_id: int | None) -> TunedPublic:
        return cls(**dict(config), problem_key=config.problem.key, hardware_key=config.hardware.key,
                   decomposition_id=config.decomposition.id, study_id=study_id)


class ConfigQueryBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queries: list[ConfigQuery] = Field(max_length=10_000)


class SubmissionEntry(BaseModel):
    """One unique problem of a submitted model: its roles, its study and its tuned config."""

    role: str
    roles: list[str]
    count: int = Field(description="occurrences per layer")
    problem: Problem
    problem_key: str
    study_id: int | None
    study_state: StudyState | None = Field(description="None: tuned before (imported or an earlier study)")
    decomposition: Decomposition | None
    decomposition_id: str | None
    speedup: float | None
    speedup_iqr: float | None
    time_s: float | None
    baseline_s: float | None
    trials: int | None
    space_size: int | None
    saved_s_per_layer: float | None = Field(description="count × (baseline − tuned time)")
    saved_s_per_step: float | None = Field(description="saved_s_per_layer × layers")


class SubmissionSummary(BaseModel):
    id: int
    name: str
    mesh: dict[str, Any]
    hardware: Hardware
    hardware_key: str
    problems: int
    created_at: dt.datetime


class SubmissionPublic(BaseModel):
    id: int
    name: str
    model: dict[str, Any]
    mesh: dict[str, Any]
    hardware: Hardware
    hardware_key: str
    created_at: dt.datetime
    entries: list[SubmissionEntry]
    layers: int
    complete: bool = Field(description="every problem has a tuned config")
    saved_s_per_step: float | None = Field(description="estimated time saved per training step, all layers")


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    role: Literal["admin", "worker", "reader"]


class TokenCreated(BaseModel):
    id: int
    name: str
    role: str
    token: str = Field(description="shown once; only its hash is stored")
