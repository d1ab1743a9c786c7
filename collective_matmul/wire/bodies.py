"""What the REST API takes: a study to create (a problem, a model and mesh, or a user's discovered step) and
what it holds, a re-confirmation, config look-ups, a token."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.models import MAX_ROLES, ModelName, Role, TransformerBlock
from collective_matmul.planning.problem import DeviceKind, Hardware, Platform, Problem, Software, check_slice
from collective_matmul.planning.text import message
from collective_matmul.wire.bounds import OverlapVerdict
from collective_matmul.wire.bundle import TunedConfig
from collective_matmul.wire.fields import (
    MAX_MESH_AXES,
    MeshAxes,
    Message,
    Name,
    PresetName,
    ProblemKey,
    ShortText,
    Source,
)

EXAMPLE_PROBLEM = {"collective": "allgather_matmul", "m": 1024, "k": 256, "n": 1024, "dtype": "float32",
                   "axis_size": 8}
EXAMPLE_HARDWARE = {"platform": "cpu", "device_kind": "cpu", "device_count": 8, "process_count": 1}


class HardwareIn(BaseModel):
    """The hardware to tune on (software versions are recorded from the workers)."""

    model_config = ConfigDict(extra="forbid")

    platform: Platform
    device_kind: DeviceKind
    device_count: int = Field(gt=0, le=1 << 20, description="the devices of the machine (or of one ring of it, "
                              "with slice_devices): a submission's rings must divide them")
    process_count: int = Field(default=1, gt=0, le=1 << 16)
    slice_devices: int | None = Field(default=None, gt=0, le=1 << 20, description=(
        "where device_count is one ring of a larger slice: the slice's devices (`Hardware.slice_devices`)"))

    @model_validator(mode="after")
    def _ring_of_the_slice(self) -> HardwareIn:
        check_slice(self.device_count, self.slice_devices)
        if self.process_count > self.device_count:
            raise ValueError(f"process_count={self.process_count} is more than device_count={self.device_count}: "
                             "every process holds at least one device of the machine (or ring)")
        return self

    def to_hardware(self) -> Hardware:
        return Hardware(**self.model_dump())

    @classmethod
    def of(cls, hardware: Hardware) -> HardwareIn:
        return cls(**hardware.identity().model_dump(include=set(cls.model_fields)))


class Seed(BaseModel):
    """A candidate a new study times right after the baseline (warm start): the winner or the best ring of a
    tuned neighbour, a problem of the same collective, dtype and ring size on the same hardware."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decomposition: Decomposition
    kind: Literal["winner", "best ring"] = Field(description="the neighbour's tuned config, or the fastest ring "
                                                             "among its search trials")
    neighbour: ProblemKey = Field(description="the neighbour's problem key")
    source: Literal["study", "bundle", "local"] = Field(
        description="study: a config this service tuned (study_id); bundle: an imported or bundled config; "
                    "local: an earlier study of the same `cmtune tune`")
    study_id: int | None = Field(default=None, ge=1, description="the neighbour's study (source 'study')")
    ratio: float = Field(gt=0, allow_inf_nan=False, description="its time over the baseline's on the neighbour "
                                                                "(a winner: 1 / speedup)")
    distance: float = Field(ge=0, allow_inf_nan=False, description="log-distance of the shapes over (m, k, n)")


_SCREEN_ORDER = {"overlaps": 0, "no permutes": 1, "partly": 2, "synchronous": 3, "serialised": 3, None: 4}


class Screened(BaseModel):
    """One candidate's compiled schedule on a study's hardware (the compile screen, `cmtune.workers.aot.screen`):
    the search proposes the forms whose permutes all hide behind a product before the others."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decomposition: Decomposition
    overlap: OverlapVerdict | None = Field(description="the compiled schedule's verdict (None: it did not compile)")
    note: Message = Field(default="", description="the verdict in words, or why it did not compile")

    @property
    def rank(self) -> int:
        """Where the search takes it: overlapping forms first, then those without permutes, partly overlapped,
        serialised or synchronous, and last what did not compile."""
        return _SCREEN_ORDER[self.overlap]


class ProblemScreen(BaseModel):
    """The compile screen of one submitted problem, compiled where it was submitted (`cmtune submit --screen`):
    its study proposes the forms that overlap first."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    problem: ProblemKey = Field(description="the problem's key, one of the submission's")
    device_kind: ShortText = Field(description="the devices it was compiled for, as JAX names them")
    screen: list[Screened] = Field(min_length=1, max_length=1024)


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trials: int | None = Field(default=None, ge=1, le=10_000, description="default: a quarter of the space (>= 4)")
    minutes: float | None = Field(default=None, gt=0, le=7 * 24 * 60)
    patience: int | None = Field(default=None, ge=1, le=10_000)


class MeshIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    axes: MeshAxes = Field(min_length=1, max_length=MAX_MESH_AXES, description="mesh axis names and sizes, in order")
    tensor_axis: ShortText = "model"


Sampler = Literal["auto", "enumerate", "tpe", "random"]
STEP_SEARCH_ROUNDS = 3  # the default budget of the step search: the seeds, then two roles improved
STEP_ROUND_VARIANTS = 3


class StepOptions(BaseModel):
    """The step measurement of a submitted model (ignored for a lone problem)."""

    model_config = ConfigDict(extra="forbid")

    measure: bool = Field(default=True, description="measure the whole step once every study is done")
    ablation: bool = Field(default=True, description="in one round of the standard menu (search_rounds 0 or 1), "
                                                     "also each role set back, and each ring weight gradient fused "
                                                     "(the search's rounds try both as changes of a role)")
    repeats: int = Field(default=7, ge=1, le=1000, description="rounds of the interleaved step variants")
    search_rounds: int = Field(
        default=STEP_SEARCH_ROUNDS, ge=0, le=50,
        description="step trials of the step search (cmtune.tuner.stepsearch), the seeds' round included, before "
                    "the choice is graded in fresh rounds; 0 or 1: one round of the standard menu (the op-level "
                    "winners, the whole-step alternatives and, with 'ablation', each role set back), graded by the "
                    "worker")
    round_variants: int = Field(default=STEP_ROUND_VARIANTS, ge=1, le=16,
                                description="changes of one role a search round times beside the incumbent")


class StepProblem(BaseModel):
    """One collective matmul of a user's step, as discovery found it: where (role, slot) and how often."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    slot: Literal["forward", "grad_input", "grad_weight"]
    problem: Problem
    count: int = Field(ge=1, le=1 << 30, description="runs per step")
    axis: ShortText | None = Field(default=None, description="the mesh axis of the ring, where known")
    source: Source = Field(default="", description="file:line of the call")
    xla: message(400) | None = Field(default=None, description="how XLA's own windowed einsum decomposes it in the "
                                     "step as compiled, where it does (the contender of a ring)")


class DiscoveredStep(BaseModel):
    """A user's own step, discovered on the client (`cmtune submit --step`): the service never runs it."""

    model_config = ConfigDict(extra="forbid")

    name: ModelName = Field(description="the name the step is verified under (its overrides' model)")
    mesh: MeshAxes = Field(min_length=1, max_length=MAX_MESH_AXES)
    problems: list[StepProblem] = Field(min_length=1, max_length=3 * MAX_ROLES)


class StudyCreate(BaseModel):
    """A problem, a model + mesh, or a user's discovered step, to tune on some hardware."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [
            {"problem": EXAMPLE_PROBLEM, "hardware": EXAMPLE_HARDWARE, "budget": {"trials": 12}},
            {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}, "tensor_axis": "model"},
             "hardware": EXAMPLE_HARDWARE, "budget": {"trials": 8}, "sampler": "auto"},
        ]},
    )

    problem: Problem | None = None
    model: PresetName | TransformerBlock | None = Field(
        default=None, description="a preset name, or the block's shape inline (never a file on the server)")
    discovered: DiscoveredStep | None = Field(default=None, description="the problems of a user's own step, "
                                                                        "with their roles (cmtune submit --step)")
    mesh: MeshIn | None = None
    hardware: HardwareIn
    budget: Budget = Budget()
    sampler: Sampler = "auto"
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    repeats: int = Field(default=7, ge=1, le=1000)
    timeout_s: float = Field(default=300.0, gt=0, le=24 * 3600,
                             description="timing budget of one candidate; a trial twice over it counts as hung")
    confirm_top: int = Field(default=3, ge=0, le=20)
    force: bool = Field(default=False, description="tune again even if tuned or under study")
    warm_start: bool = Field(default=True, description="seed each new study with the winners and best rings of "
                                                       "the nearest problems tuned on this hardware")
    step: StepOptions = Field(default_factory=lambda: StepOptions(),
                              description="a model's step measurement, once its studies are done")
    screens: list[ProblemScreen] = Field(
        default_factory=list, max_length=3 * MAX_ROLES,
        description="each problem's candidates compiled for the hardware (cmtune submit --screen): its study times "
                    "the forms that overlap first")

    @model_validator(mode="after")
    def _one_target(self) -> StudyCreate:
        if sum(target is not None for target in (self.problem, self.model, self.discovered)) != 1:
            raise ValueError("give one of 'problem', 'model' (with 'mesh') or 'discovered'")
        if self.model is not None and self.mesh is None:
            raise ValueError("'model' needs 'mesh', e.g. {\"axes\": {\"data\": 1, \"model\": 8}}")
        if self.discovered is not None and self.mesh is not None:
            raise ValueError("'discovered' carries its own mesh: leave out 'mesh'")
        return self


class Reconfirmation(BaseModel):
    """What a re-confirmation study re-times on a new software stack: a stored config of another stack, its
    runner-up and the baseline, in one confirmation round (`cmtune.tuner.engine.Engine.create_reconfirmation`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: TunedConfig = Field(description="the stored config, as it was (with the stack that measured it)")
    decomposition_id: str = Field(max_length=64, description="the stored winner's id")
    runner_up: Decomposition | None = Field(
        default=None, description="the best other candidate of the study that tuned it (None: none is known, e.g. "
                                  "a config imported from a bundle; the cost model's first ring runs instead)")
    contenders: list[Decomposition] = Field(max_length=8, description="what the round times, the baseline first")
    study_id: int | None = Field(default=None, description="the study that tuned the stored config")

    @model_validator(mode="after")
    def _of_the_config(self) -> Reconfirmation:
        if self.decomposition_id != self.config.decomposition.id:
            raise ValueError(f"decomposition_id={self.decomposition_id!r} is not the stored winner's "
                             f"({self.config.decomposition.id!r})")
        return self


class ConfigQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    problem: Problem
    platform: Platform
    device_kind: DeviceKind
    device_count: int | None = Field(default=None, gt=0, le=1 << 20)
    process_count: int = Field(default=1, gt=0, le=1 << 16)
    slice_devices: int | None = Field(default=None, gt=0, le=1 << 20, description="the devices of the slice the "
                                      "ring is part of (`Hardware.slice_devices`; None: the ring is the whole machine)")
    software: Software | None = Field(default=None, description="the caller's stack: a config measured on another "
                                      "is 'stale' (None: the newest of any stack answers 'exact', and the answer's "
                                      "note says so)")

    def hardware(self) -> Hardware:
        return Hardware(platform=self.platform, device_kind=self.device_kind,
                        device_count=self.device_count or self.problem.axis_size, process_count=self.process_count,
                        slice_devices=self.slice_devices)


MAX_BATCH = 1_000  # look-ups per batch: about 0.1-0.4 s of one core at most (cost-model choices of unseen shapes)


class ConfigQueryBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queries: list[ConfigQuery] = Field(max_length=MAX_BATCH, description=f"at most {MAX_BATCH}; one batch is "
                                       "answered at a time per server process, the others wait their turn")


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    role: Literal["admin", "worker", "reader"]
