"""Messages within a multi-process group: what process 0 of a worker's or `cmtune tune`'s group tells the others
(`cmtune.workers.cluster.Group`), so that every process runs the same programs and only process 0 decides."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.wire.protocol import TrialTask
from collective_matmul.wire.records import MAX_STEP_VARIANTS, StepVariants


class GroupMessage(BaseModel):
    """What process 0 of a worker's or `cmtune tune`'s group tells the others: run this trial together,
    nothing to run yet, or stop."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["trial", "idle", "stop"]
    task: TrialTask | None = None


class ChosenVariant(BaseModel):
    """The step variant process 0 decided on (None: no decision could be made)."""

    variant: str | None


class StepRound(BaseModel):
    """What process 0's step search (`cmtune.tuner.stepsearch`) has every process time next: a search round,
    the grading of its choice in fresh rounds, or nothing more (the search could not go on)."""

    kind: Literal["search", "grade", "done"]
    round: int = Field(ge=0)
    variants: StepVariants = Field(default_factory=dict, max_length=MAX_STEP_VARIANTS)


class Resolved(BaseModel):
    """What one slot of one role resolved to, for the table every process prints alike."""

    problem: str
    decomposition: str
    match: str
    source: str


class BlockConfigs(BaseModel):
    """The reference block's per-role configs as process 0 looked them up (`cmtune verify --model`)."""

    configs: dict[str, OpConfigs]
    resolved: dict[str, dict[str, Resolved]]


class Pin(BaseModel):
    """One call's configs as process 0's `Tuned` resolved them, replayed by `Tuned.pinned` elsewhere."""

    configs: OpConfigs
    match: dict[str, str] = Field(default_factory=dict, description="slot -> how process 0's look-up answered")


class StepCalls(BaseModel):
    """What process 0's drop-in resolved in a user's step (`cmtune verify --step`): the pins (keyed
    ``role|forward problem``), each role's configs in call order, and the mesh axis of the rings."""

    pins: dict[str, Pin]
    per_role: dict[str, list[OpConfigs]]
    axis: str | None = None
    shared: bool = False  # some call reused another's gather (collective_matmul.ops.share): time the step without too
