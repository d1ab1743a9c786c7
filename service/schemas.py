"""API bodies: ``XCreate`` in, ``XPublic`` out (pydantic)."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from collective_matmul import Decomposition, Hardware, Problem, TransformerBlock
from collective_matmul.bundle import TunedConfig
from tuner.measure import Measurement, Protocol

EXAMPLE_PROBLEM = {"collective": "allgather_matmul", "m": 1024, "k": 256, "n": 1024, "dtype": "float32",
                   "axis_size": 8}
EXAMPLE_HARDWARE = {"platform": "cpu", "device_kind": "cpu", "device_count": 8, "process_count": 1}


class HardwareIn(BaseModel):
    """The hardware to tune on (versions are recorded from the workers)."""

    model_config = ConfigDict(extra="forbid")

    platform: str = Field(min_length=1, max_length=64)
    device_kind: str = Field(min_length=1, max_length=128)
    device_count: int = Field(gt=0, le=1 << 20)
    process_count: int = Field(default=1, gt=0, le=1 << 16)

    def to_hardware(self) -> Hardware:
        return Hardware(**self.model_dump())


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trials: int | None = Field(default=None, ge=1, le=10_000, description="default: a quarter of the space (>= 4)")
    minutes: float | None = Field(default=None, gt=0, le=7 * 24 * 60)
    patience: int | None = Field(default=None, ge=1, le=10_000)


class MeshIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    axes: dict[str, int] = Field(description="mesh axis names and sizes, in order")
    tensor_axis: str = "model"


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
    sampler: Literal["auto", "enumerate", "tpe", "random"] = "auto"
    seed: int = 0
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
    ratio: float
    speedup: float
    trial_id: int


class StudyPublic(BaseModel):
    id: int
    state: str
    problem: Problem
    hardware: Hardware
    settings: dict[str, Any]
    space_size: int
    trials_done: int
    trials_budget: int
    trials_running: int
    best: BestSoFar | None
    tuned: TunedConfig | None = None
    stop_reason: str | None
    message: str | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None


class StudyCreated(BaseModel):
    studies: list[StudyPublic]
    submission_id: int | None = None
    skipped: list[dict[str, Any]] = Field(default_factory=list, description="problems already tuned or under study")


class StudyPage(BaseModel):
    items: list[StudyPublic]
    total: int
    offset: int
    limit: int


class TrialPublic(BaseModel):
    id: int
    study_id: int
    number: int
    kind: str
    decompositions: list[Decomposition]
    decomposition_id: str
    state: str
    attempts: int
    status: str | None
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
    kind: Literal["search", "confirm"]
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


class ResultOut(BaseModel):
    trial_id: int
    state: str
    duplicate: bool = False


class ConfigQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    problem: Problem
    platform: str
    device_kind: str
    device_count: int | None = None
    process_count: int = 1


class ConfigAnswer(BaseModel):
    """A config look-up's answer and which fallback produced it."""

    problem: Problem
    hardware: Hardware
    decomposition: Decomposition
    match: Literal["exact", "nearest", "model", "baseline"]
    time_s: float | None = None
    baseline_s: float | None = None
    speedup: float | None = None
    source_problem: Problem | None = Field(default=None, description="the tuned problem a 'nearest' answer came from")
    software: dict[str, str] = Field(default_factory=dict)


class ConfigQueryBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queries: list[ConfigQuery] = Field(max_length=10_000)


class SubmissionEntry(BaseModel):
    role: str
    roles: list[str]
    count: int
    problem: Problem
    study_id: int
    study_state: str
    speedup: float | None
    time_s: float | None
    baseline_s: float | None
    decomposition: Decomposition | None


class SubmissionSummary(BaseModel):
    id: int
    name: str
    mesh: dict[str, Any]
    hardware: Hardware
    problems: int
    created_at: dt.datetime


class SubmissionPublic(BaseModel):
    id: int
    model: dict[str, Any]
    mesh: dict[str, Any]
    hardware: Hardware
    created_at: dt.datetime
    entries: list[SubmissionEntry]
    layers: int
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
