"""The worker protocol: a worker registers, leases a trial (what it runs), beats its heart, and reports the
trial's result (a `ResultIn`)."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, ConfigDict, Field, model_validator

from collective_matmul.decomposition import Decomposition, OpConfigs
from collective_matmul.models import TransformerBlock
from collective_matmul.problem import Hardware, Problem, Software
from collective_matmul.wire.bodies import EXAMPLE_HARDWARE, HardwareIn
from collective_matmul.wire.fields import LeaseId, MeshAxes, Name, ShortText
from collective_matmul.wire.records import (
    MAX_STEP_VARIANTS,
    BoundsMeasurement,
    Confirmation,
    Measurement,
    Protocol,
    StepMeasurement,
    StepVariants,
)
from collective_matmul.wire.states import TrialKind, TrialState

WORKER_HEADER = "X-Cmtune-Worker"  # the header that carries a worker's own credential


class WorkerCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"name": "tpu-vm-0", "hardware": EXAMPLE_HARDWARE, "software": {"jax": "0.10.2", "jaxlib": "0.10.2",
                                                                        "platform_version": "cpu", "flags": ""},
         "memory_bytes": 17179869184}]})

    name: Name
    hardware: HardwareIn
    software: Software = Field(default_factory=Software, description="the worker's stack (`Software.detect`): "
                               "configs the service holds only for other stacks of this hardware are re-confirmed "
                               "on it, and only workers of a study's stack lease its trials")
    memory_bytes: int | None = Field(default=None, gt=0, le=1 << 50,
                                     description="memory of one device (what a trial's inputs must fit)")


class WorkerPublic(BaseModel):
    id: int
    name: str
    hardware: Hardware
    hardware_key: str
    software: Software
    software_key: str
    registered_at: dt.datetime
    last_heartbeat: dt.datetime
    online: bool
    active: bool
    current_trial_id: int | None
    trials_done: int
    memory_bytes: int | None = Field(default=None, description="memory of one device, as the worker reported it")


class WorkerRegistered(WorkerPublic):
    """A new worker, with its own credential: send it as ``X-Cmtune-Worker`` on every later call."""

    credential: str = Field(description="shown once; only its hash is stored")


class LeasePublic(BaseModel):
    id: str
    expires_at: dt.datetime


class StepTask(BaseModel):
    """What a step trial measures: the block's step on one ring of the submitted mesh, per-role configs."""

    model_config = ConfigDict(extra="forbid")

    block: TransformerBlock
    mesh: MeshAxes = Field(max_length=8, description="the submitted mesh")
    tensor_axis: ShortText = "model"
    configs: dict[str, OpConfigs] = Field(description="per role, the tuned forward / grad_input / grad_weight")
    ablation: bool = Field(default=True, description="also time each role set back to the baseline, and each "
                                                     "ring weight gradient fused")
    variants: StepVariants | None = Field(
        default=None, max_length=MAX_STEP_VARIANTS,
        description="exactly the variants to time, in order, each with its per-role configs (None: the step as "
                    "written), and nothing more: a round of the step search.  Absent: the standard menu of "
                    "'configs', graded by the worker in fresh rounds")


class TrialTask(BaseModel):
    """What a worker runs: one candidate (search), all contenders together (confirm), or a step (step)."""

    id: int
    study_id: int
    kind: TrialKind
    problem: Problem | None = Field(description="the problem of a search or confirmation trial")
    decomposition: Decomposition | None = Field(description="the candidate of a search trial")
    decompositions: list[Decomposition]
    protocol: Protocol
    step: StepTask | None = None


class LeaseGranted(BaseModel):
    lease: LeasePublic
    trial: TrialTask


class HeartbeatIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_id: LeaseId | None = Field(default=None, description="extend this lease too")


class HeartbeatOut(BaseModel):
    worker_id: int
    lease: LeasePublic | None = None


# the field of a result's body (`ResultIn`) that carries the result of each kind of trial
RESULT_FIELDS = {TrialKind.SEARCH: "measurement", TrialKind.CONFIRM: "measurements", TrialKind.STEP: "step"}


class ResultIn(BaseModel):
    """A trial's result: ``measurement`` (search trial), ``measurements`` (confirmation) or ``step`` (step)."""

    model_config = ConfigDict(extra="forbid")

    lease_id: LeaseId
    measurement: Measurement | None = None
    measurements: list[Measurement] | None = Field(default=None, min_length=1, max_length=64)
    bounds: BoundsMeasurement | None = Field(default=None, description="a confirmation's bounds rounds (with "
                                             "'measurements' only; optional)")
    step: StepMeasurement | None = None
    lease_next: bool = Field(default=False, description="also lease this worker's next trial, answered as 'next' "
                             "(one request instead of a result and a lease)")

    @model_validator(mode="after")
    def _one(self) -> ResultIn:
        if sum(v is not None for v in (self.measurement, self.measurements, self.step)) != 1:
            raise ValueError("give 'measurement' (search trial), 'measurements' (confirmation) or 'step' (step "
                             "trial)")
        if self.bounds is not None and self.measurements is None:
            raise ValueError("'bounds' come with a confirmation's 'measurements' only")
        return self

    @classmethod
    def of(cls, lease_id: str, kind: TrialKind, results: list[Measurement] | Confirmation | StepMeasurement, *,
           lease_next: bool = False) -> ResultIn:
        """The body for a trial of ``kind``."""
        if kind == TrialKind.STEP:
            return cls(lease_id=lease_id, step=results, lease_next=lease_next)
        if kind == TrialKind.SEARCH:
            return cls(lease_id=lease_id, measurement=results[0], lease_next=lease_next)
        if isinstance(results, Confirmation):
            return cls(lease_id=lease_id, measurements=results.measurements, bounds=results.bounds,
                       lease_next=lease_next)
        return cls(lease_id=lease_id, measurements=results, lease_next=lease_next)

    @property
    def kind(self) -> TrialKind:
        if self.step is not None:
            return TrialKind.STEP
        return TrialKind.SEARCH if self.measurement is not None else TrialKind.CONFIRM

    @property
    def results(self) -> list[Measurement] | Confirmation | StepMeasurement:
        """What the engine records: a search trial's measurement (as a list), a confirmation (its measurements and
        bounds) or a step measurement."""
        if self.step is not None:
            return self.step
        if self.measurement is not None:
            return [self.measurement]
        return Confirmation(measurements=self.measurements, bounds=self.bounds)


class ResultOut(BaseModel):
    trial_id: int
    state: TrialState
    duplicate: bool = False
    next: LeaseGranted | None = Field(default=None, description="the worker's next trial, when the result asked "
                                      "for it ('lease_next') and one was there to lease")
