"""The worker protocol: a worker registers, leases a trial (what it runs), beats its heart, and reports the
trial's result (one `TrialResult`, sent as a `ResultIn`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from collective_matmul.planning.decomposition import Decomposition, OpConfigs
from collective_matmul.planning.models import TransformerBlock
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire.bodies import EXAMPLE_HARDWARE, HardwareIn
from collective_matmul.wire.fields import MAX_MESH_AXES, LeaseId, MeshAxes, Name, ShortText
from collective_matmul.wire.records import (
    MAX_STEP_VARIANTS,
    BoundsMeasurement,
    Measurement,
    MeasurementProtocol,
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
    ring_keys: list[str] = Field(default_factory=list, description="the hardware keys it leases trials of: its "
                                 "own, then those of the rings its devices split into (`Hardware.rings`)")
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
    mesh: MeshAxes = Field(max_length=MAX_MESH_AXES, description="the submitted mesh")
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
    protocol: MeasurementProtocol
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


# --- a trial's result --------------------------------------------------------------------------------


class SearchResult(BaseModel):
    """A search trial's result: its one candidate, measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal[TrialKind.SEARCH] = TrialKind.SEARCH
    measurement: Measurement

    @property
    def measurements(self) -> list[Measurement]:
        """The candidates measured (the one), as a confirmation has them."""
        return [self.measurement]


class ConfirmResult(BaseModel):
    """A confirmation trial's result: every contender's measurement, then the problem's bounds rounds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal[TrialKind.CONFIRM] = TrialKind.CONFIRM
    measurements: list[Measurement] = Field(min_length=1, max_length=64)
    bounds: BoundsMeasurement | None = Field(default=None, description="None: not measured (a runner before "
                                                                       "bounds, or one that skips them)")


class StepResult(BaseModel):
    """A step trial's result: every variant of the training step, timed together."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal[TrialKind.STEP] = TrialKind.STEP
    step: StepMeasurement


TrialResult = Annotated[SearchResult | ConfirmResult | StepResult, Field(discriminator="kind")]


def result_of(kind: TrialKind, measurements: Sequence[Measurement], bounds: BoundsMeasurement | None = None,
              ) -> SearchResult | ConfirmResult:
    """A search or confirmation trial's result from its candidates' measurements, in the trial's order.

    Args:
        kind: the trial's kind (``search``: one candidate; ``confirm``: every contender, and the bounds).
        measurements: one per candidate of the trial.
        bounds: a confirmation's bounds rounds (None: not measured).

    Raises:
        ValueError: a step trial's kind, a search trial's result of more or less than one measurement, or bounds
            without a confirmation.
    """
    if kind == TrialKind.CONFIRM:
        return ConfirmResult(measurements=list(measurements), bounds=bounds)
    if kind != TrialKind.SEARCH or len(measurements) != 1 or bounds is not None:
        raise ValueError(f"a {kind} trial's result is not {len(measurements)} measurements"
                         + (" and bounds" if bounds is not None else ""))
    return SearchResult(measurement=measurements[0])


# the field of a result's body (`ResultIn`) that carries the result of each kind of trial
RESULT_FIELDS = {TrialKind.SEARCH: "measurement", TrialKind.CONFIRM: "measurements", TrialKind.STEP: "step"}


def what_to_send(kind: TrialKind, sent: TrialResult) -> str:
    """What a trial of ``kind`` takes, said to a worker that ``sent`` a result of another kind: its body's field."""
    bounds = sent.kind == TrialKind.CONFIRM and sent.bounds is not None
    return f"send '{RESULT_FIELDS[kind]}'" + (" (bounds come with a confirmation only)" if bounds else "")


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
    def of(cls, lease_id: str, result: TrialResult, *, lease_next: bool = False) -> ResultIn:
        """The body that carries ``result``: each result's fields are the body's fields of its kind."""
        fields = {name: value for name, value in result if name != "kind"}
        return cls(lease_id=lease_id, lease_next=lease_next, **fields)

    @property
    def result(self) -> TrialResult:
        """The trial's result this body carries."""
        if self.step is not None:
            return StepResult(step=self.step)
        if self.measurement is not None:
            return SearchResult(measurement=self.measurement)
        return ConfirmResult(measurements=self.measurements, bounds=self.bounds)


class ResultOut(BaseModel):
    trial_id: int
    state: TrialState
    duplicate: bool = False
    next: LeaseGranted | None = Field(default=None, description="the worker's next trial, when the result asked "
                                      "for it ('lease_next') and one was there to lease")
