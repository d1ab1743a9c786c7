"""The wire contract: every type that crosses a process boundary, without JAX.

The service, the worker daemon, the command line, the `Tuned` client, the dashboard's API and the
tests all speak these types, so a field means the same thing everywhere:

- keys: `Problem`, `Hardware`, `Decomposition` (defined beside the ops, re-exported here);
- the measurement record: `Protocol`, `Timing`, `Measurement`, `Status`, a confirmation's `BoundsMeasurement`;
- the lifecycle: `StudyState`, `TrialState`, `TrialKind` (the database checks the same values), `StopReason`;
- tuned configs and bundles: `TunedConfig`, `Bundle`;
- the REST API's bodies: ``XCreate`` in, ``XPublic`` out, and the worker's lease and result.

Public bodies carry the derived values (problem keys, hardware keys, decomposition ids, time
saved) so that no client re-implements them.  Importing this module imports pydantic, not JAX.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from collective_matmul.bounds import StepBound
from collective_matmul.bundle import Bundle, RoleOverride, TunedConfig
from collective_matmul.decomposition import Decomposition, OpConfigs
from collective_matmul.lookup import Match
from collective_matmul.models import MAX_ROLE_LENGTH, MAX_ROLES, MODEL_NAME_LENGTH, ModelName, Role, TransformerBlock
from collective_matmul.problem import DeviceKind, Hardware, Platform, Problem, Software
from collective_matmul.text import label, message

__all__ = [
    "BoundsMeasurement", "Bundle", "Confirmation", "Decomposition", "Hardware", "Measurement", "OpConfigs", "Problem",
    "Protocol", "Reconfirmation", "RoleOverride", "Software", "Status", "StepMeasurement", "StepVariant", "StopReason",
    "StudyKind", "StudyState", "Timing",
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
    """What a trial times: one search candidate, the confirmation round of the top ones, or a whole
    training step (the step study of a submitted model)."""

    SEARCH = "search"
    CONFIRM = "confirm"
    STEP = "step"


class StudyKind(StrEnum):
    """A search over one problem's decompositions, or the step measurement of a submitted model."""

    SEARCH = "search"
    STEP = "step"


class StopReason(StrEnum):
    """Why a study stopped searching, or how it ended (a study's ``stop_reason``, stored as its value).

    A step study's search stops at its budget of rounds or after a full pass over the roles that changed nothing
    (`cmtune.tuner.stepsearch.StepSearch.plan` says which in words).
    """

    TRIAL_BUDGET = "trial budget"
    TIME_BUDGET = "time budget"
    NO_IMPROVEMENT = "no improvement"
    NEIGHBOURS_AGREE = "neighbours agree"  # a warm-started search learnt what its neighbours predicted
    EXHAUSTED = "exhausted"
    BASELINE_FAILED = "baseline failed"
    CANCELLED = "cancelled"
    MEASURED = "measured"  # a step study of one round, graded by its worker
    RECONFIRMED = "re-confirmed"  # a re-confirmation whose stored winner won again
    REPLACED = "replaced"  # a re-confirmation that a new winner decided
    STEP_BUDGET = "step budget"  # a step search that spent its rounds
    NOTHING_LEFT = "nothing left to try"  # a step search whose full pass over the roles changed nothing


class Status(StrEnum):
    """The outcome of timing one candidate (every failure is a result, never a crash)."""

    OK = "ok"
    INVALID = "invalid"
    COMPILE_ERROR = "compile_error"
    OOM = "oom"
    TIMEOUT = "timeout"
    ERROR = "error"


OverlapVerdict = Literal["overlaps", "partly", "serialised", "synchronous", "no permutes"]


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


# Free text (collective_matmul.text): bounded like the columns that store it
ShortText = label(64)  # a mesh axis, a package, a variant the others are checked against
Name = label(200)  # workers.name, tokens.name
LeaseId = label(36)  # leases.id (a UUID)
MAX_MESSAGE_LENGTH = 4000  # what a worker may say about a result; trials.message keeps the first 2000 characters
Message = message(MAX_MESSAGE_LENGTH)
MAX_VARIANT_NAME = MAX_ROLE_LENGTH + 16
VariantName = label(MAX_VARIANT_NAME)  # tuned-minus-<role>, r<round>-<role>-<change>
Source = label(400, min_length=0)  # file:line
PresetName = label(MODEL_NAME_LENGTH, min_length=0)  # (an empty one is an unknown model, as any other)
MeshAxes = dict[ShortText, Annotated[int, Field(ge=1, le=1 << 20)]]

# Times and ratios a worker reports: finite, and times above zero (a result that is neither is refused)
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
MAX_SAMPLES = 100_000
_RELATIVE = 1e-6  # how far a reported summary may sit from the one its samples give (float rounding)


def _agrees(reported: float, computed: float) -> bool:
    return math.isclose(reported, computed, rel_tol=_RELATIVE, abs_tol=1e-12)


class Timing(BaseModel):
    """Samples of one program and their summary (seconds); the summary must be the samples'."""

    model_config = ConfigDict(extra="forbid")

    samples_s: list[Seconds] = Field(min_length=1, max_length=MAX_SAMPLES)
    median_s: Seconds
    iqr_s: float = Field(ge=0, allow_inf_nan=False)
    min_s: Seconds
    max_s: Seconds

    @model_validator(mode="after")
    def _summary_of_the_samples(self) -> Timing:
        q1, median, q3 = quartiles(self.samples_s)
        for name, computed in (("median_s", median), ("iqr_s", q3 - q1), ("min_s", min(self.samples_s)),
                               ("max_s", max(self.samples_s))):
            if not _agrees(getattr(self, name), computed):
                raise ValueError(f"{name}={getattr(self, name)!r} disagrees with samples_s, which give {computed!r}")
        return self

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        q1, median, q3 = quartiles(samples)
        return cls(samples_s=samples, median_s=median, iqr_s=q3 - q1, min_s=min(samples), max_s=max(samples))


class _Timed:
    """What a timed record (`Measurement`, `StepVariant`) says about its ``status`` and ``ratio``
    (its time over the reference's: the baseline's, or the step as written for a step)."""

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    @property
    def speedup(self) -> float | None:
        """Reference time over this record's (> 1: faster than the reference)."""
        return 1.0 / self.ratio if self.ratio else None

    @property
    def speedup_iqr(self) -> float:
        """IQR of the speedup, to first order from the ratio's IQR (d(1/r) = dr / r**2)."""
        return (self.ratio_iqr or 0.0) / self.ratio**2 if self.ratio else 0.0


class Measurement(_Timed, BaseModel):
    """The record of one candidate timed against the baseline; stored as is.

    Validated where it arrives (a worker's result): every number finite, times above zero, an
    ``ok`` record carries both timings and the ratio, and the ratio is the median of the paired
    candidate/baseline ratios of its samples.
    """

    model_config = ConfigDict(extra="forbid")

    problem: Problem
    decomposition: Decomposition
    hardware: Hardware
    status: Status
    message: Message = ""
    compile_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    memory_bytes: int | None = Field(default=None, ge=0, le=1 << 60)
    rel_error: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    candidate: Timing | None = None
    baseline: Timing | None = None
    ratio: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                description="median of candidate/baseline paired ratios")
    ratio_iqr: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    overlap: OverlapVerdict | None = Field(default=None, description="the compiled schedule's verdict "
                                           "(collective_matmul.schedule): does a product run while each permute "
                                           "is in flight?")
    overlap_note: Message = Field(default="", description="the verdict in words: how many permutes hide behind "
                                                          "a product")
    protocol: Protocol = Protocol()

    @model_validator(mode="after")
    def _consistent(self) -> Measurement:
        if self.status == Status.OK and (self.candidate is None or self.baseline is None or self.ratio is None):
            raise ValueError("an 'ok' measurement needs 'candidate' and 'baseline' timings and a 'ratio'")

        if self.ratio is not None and self.candidate is not None and self.baseline is not None:
            _check_ratio(self, self.candidate, self.baseline, "the candidate's", "the baseline's")
        return self


class CompiledCandidate(BaseModel):
    """One candidate compiled for devices it cannot run on (a TPU topology compiled ahead of time): its compile,
    its memory per device and its schedule's overlap verdict, never a time."""

    model_config = ConfigDict(extra="forbid")

    problem: Problem
    decomposition: Decomposition
    hardware: Hardware
    status: Literal["compiled", "compile_error", "oom"]
    message: Message = ""
    compile_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    memory_bytes: int | None = Field(default=None, ge=0, le=1 << 60)
    overlap: OverlapVerdict | None = None
    overlap_note: Message = ""
    xla_options: dict[ShortText, bool | int] = Field(default_factory=dict, description="the compile options it "
                                                     "needs (method 'xla': XLA's windowed einsum on)")


class BoundsMeasurement(BaseModel):
    """One problem's bounds rounds (`collective_matmul.bounds`): the local matmul alone, the collective alone
    and the baseline, timed in turn each round; stored as is.

    Validated where it arrives, like a `Measurement`: an ``ok`` record carries the three timings, and
    timings that are there have one sample per round each.
    """

    model_config = ConfigDict(extra="forbid")

    problem: Problem
    hardware: Hardware
    status: Status
    message: Message = ""
    compute: Timing | None = Field(default=None, description="each device's local product alone (no collective)")
    communication: Timing | None = Field(default=None, description="the collective alone: the same bytes, no matmul")
    baseline: Timing | None = Field(default=None, description="the baseline op, in the same rounds")
    protocol: Protocol = Protocol()

    @model_validator(mode="after")
    def _consistent(self) -> BoundsMeasurement:
        timed = {name: t for name in ("compute", "communication", "baseline") if (t := getattr(self, name))}
        if self.status == Status.OK and len(timed) < 3:
            raise ValueError("an 'ok' bounds measurement needs 'compute', 'communication' and 'baseline' timings")
        counts = {name: len(t.samples_s) for name, t in timed.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"the bounds rounds time each program once per round: sample counts {counts} differ")
        return self

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    @property
    def medians(self) -> dict[str, float] | None:
        """The fields a `TunedConfig` keeps (compute_s, communication_s, bounds_baseline_s); None unless ok."""
        if not self.ok:
            return None
        return {"compute_s": self.compute.median_s, "communication_s": self.communication.median_s,
                "bounds_baseline_s": self.baseline.median_s}


class Confirmation(BaseModel):
    """A confirmation trial's result: every contender's measurement, then the problem's bounds rounds."""

    model_config = ConfigDict(extra="forbid")

    measurements: list[Measurement] = Field(min_length=1, max_length=64)
    bounds: BoundsMeasurement | None = Field(default=None, description="None: not measured (a runner before "
                                                                       "bounds, or one that skips them)")


def _check_ratio(record: Measurement | StepVariant, timing: Timing, reference: Timing, name: str, against: str,
                 ) -> None:
    """``record.ratio`` (and ``ratio_iqr``) must be what its samples give, paired one to one with the reference's.

    Raises:
        ValueError: if they are not (the service computes nothing twice: it believes only what it can check).
    """
    if len(timing.samples_s) != len(reference.samples_s):
        raise ValueError(f"{name} {len(timing.samples_s)} samples cannot be paired with {against} "
                         f"{len(reference.samples_s)}: a ratio needs one sample of each per round")
    q1, median, q3 = quartiles([t / r for t, r in zip(timing.samples_s, reference.samples_s, strict=True)])
    if not _agrees(record.ratio, median):
        raise ValueError(f"ratio={record.ratio!r} disagrees with the samples: {name} over {against}, paired, have "
                         f"median {median!r}")
    if record.ratio_iqr is not None and not _agrees(record.ratio_iqr, q3 - q1):
        raise ValueError(f"ratio_iqr={record.ratio_iqr!r} disagrees with the samples ({q3 - q1!r})")


# --- the training step ------------------------------------------------------------------------

MAX_STEP_VARIANTS = 2 * MAX_ROLES + 8  # the standard menu of a step of MAX_ROLES roles, and the alternatives
StepSetting = Annotated[dict[Role, OpConfigs], Field(max_length=MAX_ROLES)]  # one variant's configs, per role
StepVariants = dict[VariantName, StepSetting | None]  # name -> per-role configs (None: the step as written)


class StepVariant(_Timed, BaseModel):
    """One variant of the training step, measured (validated like a `Measurement` where it arrives)."""

    model_config = ConfigDict(extra="forbid")

    name: VariantName = Field(description="as-written, baseline, tuned, or an alternative such as tuned-minus-<role>")
    status: Status
    message: Message = ""
    configs: dict[Role, OpConfigs] = Field(
        default_factory=dict, max_length=MAX_ROLES,
        description="per role, the forward / grad_input / grad_weight configs used (of its first call; empty: "
                    "the step as written)",
    )
    compile_s: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                    description="ahead-of-time compile of the step")
    memory_bytes: int | None = Field(default=None, ge=0, le=1 << 60, description="compiled memory estimate")
    loss: float | None = Field(default=None, allow_inf_nan=False)
    rel_error: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                    description="largest relative error of the loss and gradients against the "
                                                "reference variant")
    timing: Timing | None = None
    ratio: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                description="median of time / reference time, paired by round")
    ratio_iqr: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ok_has_timings(self) -> StepVariant:
        if self.status == Status.OK and (self.timing is None or self.ratio is None):
            raise ValueError(f"an 'ok' step variant ({self.name}) needs its timing and ratio")
        return self


def _check_rounds(variants: list[StepVariant], reference: str, field: str) -> None:
    """One set of interleaved rounds: names unique, and every ratio the one its samples give against
    ``reference``'s, paired by round.

    Raises:
        ValueError: if not.
    """
    if not variants:
        return
    names = [v.name for v in variants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{field}: each variant is measured once; {twice} appear more than once")
    ref = next((v for v in variants if v.name == reference), None)
    if ref is None:
        raise ValueError(f"{field}: the reference variant {reference!r} is missing (measured: {names})")
    for v in variants:
        if v.ratio is None:
            continue
        if v.timing is None or ref.timing is None:
            raise ValueError(f"{field}: {v.name} has a ratio, but it or the reference {reference!r} has no timing "
                             "to compute it from")
        _check_ratio(v, v.timing, ref.timing, f"{v.name}'s", f"{reference}'s")


class StepMeasurement(BaseModel):
    """Every variant of one training step (the reference block's, or a user's own), timed together on one mesh."""

    model_config = ConfigDict(extra="forbid")

    block: TransformerBlock | None = Field(default=None, description="the reference block as measured "
                                                                     "(global_batch: the batch measured)")
    model: ModelName | None = Field(default=None,
                                   description="a user's step: the name it was verified under (no block)")
    mesh: MeshAxes = Field(max_length=8, description="mesh axes as measured, in order")
    tensor_axis: ShortText
    batch_axes: list[ShortText] = Field(default_factory=list, max_length=8,
                                        description="the mesh axes sharding the batch")
    hardware: Hardware
    protocol: Protocol
    reference: ShortText = Field(
        default="as-written", description="the variant every other is checked and timed against: the step as written "
                                       "(records before 0.3 call it 'autodiff')")
    variants: list[StepVariant] = Field(min_length=1, max_length=MAX_STEP_VARIANTS)
    confirmation: list[StepVariant] = Field(
        default_factory=list, max_length=8,
        description="fresh rounds, timed after the decision, of the reference, the all-baseline step and the "
                    "variant chosen: the speedups reported come from these, never from the rounds that chose "
                    "(empty: none were run)")

    @model_validator(mode="after")
    def _names_its_step(self) -> StepMeasurement:
        if (self.block is None) == (self.model is None):
            raise ValueError("a step measurement names its step: the reference 'block', or a user's step 'model'")
        for field in ("variants", "confirmation"):
            _check_rounds(getattr(self, field), self.reference, field)
        return self

    @property
    def name(self) -> str:
        """The model's name: the block's, or the user's step's."""
        return self.block.name if self.block is not None else self.model

    def graded(self, chosen: str) -> StepMeasurement:
        """The rounds to report ``chosen`` from: the confirmation where it timed both the reference and
        ``chosen``, else the rounds that decided (this measurement itself)."""
        timed = {v.name for v in self.confirmation if v.ok}
        if {self.reference, chosen} <= timed:
            return self.model_copy(update={"variants": self.confirmation, "confirmation": []})
        return self

    def variant(self, name: str) -> StepVariant:
        """The variant called ``name``.

        Raises:
            KeyError: if there is none.
        """
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"no variant {name!r}; measured: {[v.name for v in self.variants]}")


    def paired(self, name: str, against: str) -> tuple[float, float, float] | None:
        """Quartiles (q1, median, q3) of ``name``'s time over ``against``'s, paired by round; None if either
        has no timing."""
        a, b = self.variant(name), self.variant(against)
        if a.timing is None or b.timing is None or len(a.timing.samples_s) != len(b.timing.samples_s):
            return None
        return quartiles([x / y for x, y in zip(a.timing.samples_s, b.timing.samples_s, strict=True)])


# --- request and response bodies --------------------------------------------------------------

EXAMPLE_PROBLEM = {"collective": "allgather_matmul", "m": 1024, "k": 256, "n": 1024, "dtype": "float32",
                   "axis_size": 8}
EXAMPLE_HARDWARE = {"platform": "cpu", "device_kind": "cpu", "device_count": 8, "process_count": 1}


class HardwareIn(BaseModel):
    """The hardware to tune on (software versions are recorded from the workers)."""

    model_config = ConfigDict(extra="forbid")

    platform: Platform
    device_kind: DeviceKind
    device_count: int = Field(gt=0, le=1 << 20)
    process_count: int = Field(default=1, gt=0, le=1 << 16)

    def to_hardware(self) -> Hardware:
        return Hardware(**self.model_dump())

    @classmethod
    def of(cls, hardware: Hardware) -> HardwareIn:
        return cls(**hardware.identity().model_dump(include={"platform", "device_kind", "device_count",
                                                             "process_count"}))


ProblemKey = label(200)  # problems.key


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


class SeedPublic(Seed):
    """A study's seed as the API shows it."""

    decomposition_id: str


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    trials: int | None = Field(default=None, ge=1, le=10_000, description="default: a quarter of the space (>= 4)")
    minutes: float | None = Field(default=None, gt=0, le=7 * 24 * 60)
    patience: int | None = Field(default=None, ge=1, le=10_000)


class MeshIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    axes: MeshAxes = Field(min_length=1, max_length=8, description="mesh axis names and sizes, in order")
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
    mesh: MeshAxes = Field(min_length=1, max_length=8)
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


Outcome = Literal["waiting", "re-confirmed", "replaced", "failed", "cancelled"]


def reconfirm_outcome(state: StudyState, stop_reason: str | None) -> Outcome:
    """What became of a re-confirmation: still waiting (for a worker of its stack), the same config
    re-confirmed, replaced by a new winner, or failed / cancelled."""
    if state.active:
        return "waiting"
    if state == StudyState.COMPLETED:
        return "replaced" if stop_reason == StopReason.REPLACED else "re-confirmed"
    return "failed" if state == StudyState.FAILED else "cancelled"


class BestSoFar(BaseModel):
    decomposition: Decomposition
    decomposition_id: str
    ratio: float
    speedup: float
    trial_id: int


class StudyPublic(BaseModel):
    id: int
    kind: StudyKind = StudyKind.SEARCH
    state: StudyState
    problem: Problem | None = Field(description="None for a step study")
    problem_key: str = Field(description="the problem's key, or 'step:<model>' for a step study")
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
    decision: StepChoice | None = Field(default=None, description="a completed step study's decision")
    seeds: list[SeedPublic] = Field(default_factory=list, description="what the search times first, after the "
                                                                      "baseline, and where each came from (warm start)")
    software: Software | None = Field(default=None, description="the software stack its trials run on (only "
                                      "workers of that stack lease them); None: any worker of the hardware")
    reconfirm: Reconfirmation | None = Field(default=None, description="a re-confirmation study: the stored config "
                                             "it re-times on its stack")
    outcome: Outcome | None = Field(default=None, description="a re-confirmation's: waiting, re-confirmed, "
                                    "replaced, failed or cancelled")


class Skipped(BaseModel):
    problem: str = Field(description="the problem's key, or 'step:<model>' for a model's step study")
    study_id: int | None
    reason: Literal["under study", "already tuned", "nothing to tune"] = Field(
        description="'nothing to tune': no ring decomposition fits the problem (a ring of one device, or shapes "
                    "no chunking divides), so the baseline runs")


class StudyCreated(BaseModel):
    studies: list[StudyPublic]
    submission_id: int | None = None
    skipped: list[Skipped] = Field(default_factory=list, description="problems already tuned or under study")
    joined: bool = Field(default=False, description="the same model, mesh and hardware is being measured already: "
                                                    "this submission joined that one (submission_id is its)")


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
    step: StepMeasurement | None = Field(default=None, description="a step trial's every variant")
    variants: list[str] = Field(default_factory=list, description="a step search round's variants, by name (empty: "
                                                                  "the standard menu)")
    bounds: BoundsMeasurement | None = Field(default=None, description="a confirmation's bounds rounds")


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


WORKER_HEADER = "X-Cmtune-Worker"  # the header that carries a worker's own credential


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


# --- messages within a multi-process group (process 0 to the others; `cmtune.workers.cluster.Group`) ---------


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


class ConfigQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    problem: Problem
    platform: Platform
    device_kind: DeviceKind
    device_count: int | None = Field(default=None, gt=0, le=1 << 20)
    process_count: int = Field(default=1, gt=0, le=1 << 16)
    software: Software | None = Field(default=None, description="the caller's stack: a config measured on another "
                                      "is 'stale' (None: the newest of any stack answers 'exact', and the answer's "
                                      "note says so)")

    def hardware(self) -> Hardware:
        return Hardware(platform=self.platform, device_kind=self.device_kind,
                        device_count=self.device_count or self.problem.axis_size, process_count=self.process_count)




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
    software: Software | None = Field(default=None, description="the stack that measured the answer's config")
    note: str | None = Field(default=None, description="what the answer says of the stacks: the look-up named none, "
                             "or the config was measured on another (a 'stale' answer)")
    compute_s: float | None = Field(default=None, description="the local matmul alone (bounds rounds)")
    communication_s: float | None = Field(default=None, description="the collective alone (bounds rounds)")
    bounds_baseline_s: float | None = Field(default=None, description="the baseline in the bounds rounds")
    bound_s: float | None = Field(default=None, description="max(compute_s, communication_s)")
    hidden_fraction: float | None = Field(default=None, description="(baseline − tuned) / (baseline − bound), "
                                          "each against its own round's baseline; None: nothing to hide or no "
                                          "bounds")
    reason: str | None = Field(default=None, description="how much the ring hid, or why no ring won")


class TunedPublic(TunedConfig):
    """A stored tuned config with its keys and id spelled out (`GET /v1/tuned`; bundles hold `TunedConfig`)."""

    problem_key: str
    hardware_key: str
    software_key: str
    decomposition_id: str
    study_id: int | None = Field(description="the study that tuned it (None: imported from a bundle)")

    @classmethod
    def of(cls, config: TunedConfig, study_id: int | None) -> TunedPublic:
        return cls(**dict(config), problem_key=config.problem.key, hardware_key=config.hardware.key,
                   software_key=config.software.key, decomposition_id=config.decomposition.id, study_id=study_id)


MAX_BATCH = 1_000  # look-ups per batch: about 0.1-0.4 s of one core at most (cost-model choices of unseen shapes)


class ConfigQueryBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queries: list[ConfigQuery] = Field(max_length=MAX_BATCH, description=f"at most {MAX_BATCH}; one batch is "
                                       "answered at a time per server process, the others wait their turn")


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
    compute_s: float | None = Field(default=None, description="the local matmul alone (bounds rounds)")
    communication_s: float | None = Field(default=None, description="the collective alone (bounds rounds)")
    bounds_baseline_s: float | None = Field(default=None, description="the baseline in the bounds rounds")
    bound_s: float | None = Field(default=None, description="max(compute_s, communication_s)")
    hidden_fraction: float | None = Field(default=None, description="(baseline − tuned) / (baseline − bound); None: "
                                          "nothing to hide or no bounds")
    reason: str | None = Field(default=None, description="how much the ring hid, or why no ring won")


class SubmissionSummary(BaseModel):
    id: int
    name: str
    mesh: dict[str, Any]
    hardware: Hardware
    hardware_key: str
    problems: int
    created_at: dt.datetime


class Speedup(BaseModel):
    """A step time ratio, as a speedup: median of paired rounds and its interquartile range."""

    median: float
    low: float = Field(description="lower quartile of the speedup")
    high: float = Field(description="upper quartile of the speedup")

    @classmethod
    def of(cls, quartiles_: tuple[float, float, float] | None) -> Speedup | None:
        if quartiles_ is None:
            return None
        q1, median, q3 = quartiles_
        return cls(median=1 / median, low=1 / q3, high=1 / q1)

    def __str__(self) -> str:
        return f"{self.median:.2f}x (IQR {self.low:.2f}-{self.high:.2f})"


class StepChoice(BaseModel):
    """What a step measurement decided (`cmtune.tuner.stepsearch.step_decision`), stored with its step study and
    served as stored: the variant that runs, graded in the fresh rounds after the decision where the
    worker ran them."""

    model_config = ConfigDict(extra="forbid")

    variant: VariantName = Field(description="the configuration that runs: tuned, a whole-step alternative, one "
                                             "change of tuned, or what the step search found "
                                             "(r<round>-<role>-<change>)")
    ratio: float = Field(gt=0, allow_inf_nan=False, description="its step time over the step as written "
                                                                "(median of paired rounds)")
    vs_reference: Speedup | None = Field(description="against the step as written (GSPMD)")
    vs_baseline: Speedup | None = Field(default=None, description="against the all-baseline custom VJP")
    saved_s: float | None = Field(default=None, allow_inf_nan=False,
                                  description="the all-baseline step's median minus the chosen one's (one layer)")
    fresh_rounds: bool = Field(description="graded in fresh rounds after the decision (else in the rounds that "
                                           "decided)")
    overrides: dict[Role, Message] = Field(default_factory=dict, max_length=MAX_ROLES,
                                           description="the roles it runs otherwise than their tuned configs, "
                                                       "each with the reason")
    summary: Message = Field(description="the decision in one line")
    rounds: int = Field(default=1, ge=1, le=1000, description="rounds of the step search that chose it (the seeds' "
                                                              "round included; 1: one round of the standard menu)")
    variants_tried: int | None = Field(default=None, ge=0, le=1 << 20,
                                       description="distinct variants the rounds timed (the step as written aside)")
    seed: VariantName | None = Field(default=None, description="the first round's choice: the best fixed setting "
                                                               "(tuned, or a whole-step alternative)")
    vs_seed: Speedup | None = Field(default=None, description="the choice against the first round's, in the rounds "
                                                              "that graded it: what the search rounds gained")
    vs_fixed: dict[VariantName, Speedup] = Field(
        default_factory=dict, max_length=8,
        description="the choice against each other fixed setting (the seeds: baseline, tuned, costmodel, "
                    "tuned-ring-fill, always-ring) in the rounds that graded it; ahead of one beyond the spread "
                    "where its low is above 1")
    search_s: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                   description="wall seconds of the search rounds after the first: what the search "
                                               "cost beside its gain")
    time_s: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                 description="the chosen step's median (one layer), in the rounds that graded it")
    bound: StepBound | None = Field(default=None, description="the step against the sum of its collective matmuls' "
                                                              "bounds: how far it is from overlap-perfect, and why "
                                                              "the op-level estimate and the measured saving differ")


class StepPublic(BaseModel):
    """A submitted model's step, measured: what runs, and how much faster it is."""

    study_id: int
    state: StudyState
    message: str | None
    decision: StepChoice | None = Field(default=None, description="what the measurement decided, as stored")
    variant: str | None = Field(description="the configuration that runs: tuned, or one change of it")
    vs_reference: Speedup | None = Field(description="against the step as written (GSPMD): what a user has "
                                                    "without cmtune")
    vs_baseline: Speedup | None = Field(description="against the custom VJP with every role at the baseline")
    measured_saved_s_per_step: float | None = Field(
        description="the all-baseline step's median minus the chosen one's, times the model's layers")
    reference: str | None = Field(default=None, description="the variant the speedups are against: the step "
                                                             "as written")
    mesh: dict[str, int] | None = Field(description="the mesh measured (one ring of the submitted one)")
    batch: int | None = Field(description="the batch measured")
    variants: list[StepVariant] = Field(
        default_factory=list, description="the rounds that chose the variant: of a step search, every variant its "
                                          "rounds timed, each once, from the round that first timed it (its speedup "
                                          "against that round's step as written)")
    confirmation: list[StepVariant] = Field(
        default_factory=list, description="fresh rounds after the decision (reference, all-baseline, the search's "
                                          "seed, chosen): the speedups above come from these where present")


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
    step: StepPublic | None = Field(default=None, description="the step measured (once every study is done)")
    overrides: list[RoleOverride] = Field(default_factory=list, description="roles this model runs otherwise "
                                                                           "than their problems' tuned configs")


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    role: Literal["admin", "worker", "reader"]


class TokenCreated(BaseModel):
    id: int
    name: str
    role: str
    token: str = Field(description="shown once; only its hash is stored")
