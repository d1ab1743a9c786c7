"""The measurement records a worker reports and the service stores as they are: one candidate against the
baseline, a problem's bounds, a training step's variants, and what a step measurement decided."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from collective_matmul.planning.decomposition import Decomposition, OpConfigs
from collective_matmul.planning.models import MAX_ROLES, ModelName, Role, TransformerBlock
from collective_matmul.planning.problem import Hardware, Problem
from collective_matmul.wire.bounds import OverlapVerdict, StepBound
from collective_matmul.wire.fields import MAX_MESH_AXES, MAX_SAMPLES, MeshAxes, Message, Seconds, ShortText, VariantName
from collective_matmul.wire.states import Status
from collective_matmul.wire.stats import Quartiles, agrees, check_ratio, check_rounds, quartiles


class MeasurementProtocol(BaseModel):
    """How one trial is measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    warmup: int = Field(default=2, ge=0, le=100)
    repeats: int = Field(default=7, ge=1, le=1000)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    timeout_s: float = Field(default=300.0, gt=0, le=24 * 3600)
    calls: int | None = Field(default=None, ge=1, le=1 << 20, description="calls timed back to back per sample; "
                              "None: chosen at warm-up, so that a sample lasts at least 20 times a barrier and a "
                              "dispatch (and 1 ms on an accelerator)")

    @model_serializer(mode="wrap")
    def _omit_default_calls(self, handler):  # the JSON of a protocol that leaves K to warm-up is what it was before
        data = handler(self)
        if self.calls is None:
            data.pop("calls", None)
        return data


class Timing(BaseModel):
    """Samples of one program and their summary (seconds); the summary must be the samples'."""

    model_config = ConfigDict(extra="forbid")

    samples_s: list[Seconds] = Field(min_length=1, max_length=MAX_SAMPLES, description="per call: each sample is "
                                     "the time of `calls` calls back to back, divided by them")
    median_s: Seconds
    iqr_s: float = Field(ge=0, allow_inf_nan=False)
    min_s: Seconds
    max_s: Seconds
    calls: int = Field(default=1, ge=1, le=1 << 20, description="calls timed back to back per sample")

    @model_serializer(mode="wrap")
    def _omit_one_call(self, handler):  # one call per sample: the JSON it was before there were more
        data = handler(self)
        if self.calls == 1:
            data.pop("calls", None)
        return data

    @model_validator(mode="after")
    def _summary_of_the_samples(self) -> Timing:
        q1, median, q3 = quartiles(self.samples_s)
        for name, computed in (("median_s", median), ("iqr_s", q3 - q1), ("min_s", min(self.samples_s)),
                               ("max_s", max(self.samples_s))):
            if not agrees(getattr(self, name), computed):
                raise ValueError(f"{name}={getattr(self, name)!r} disagrees with samples_s, which give {computed!r}")
        return self

    @classmethod
    def of(cls, samples: list[float], calls: int = 1) -> Timing:
        q1, median, q3 = quartiles(samples)
        return cls(samples_s=samples, median_s=median, iqr_s=q3 - q1, min_s=min(samples), max_s=max(samples),
                   calls=calls)


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
                                           "(collective_matmul.programs.schedule): does a product run while each "
                                           "permute is in flight?")
    overlap_note: Message = Field(default="", description="the verdict in words: how many permutes hide behind "
                                                          "a product")
    protocol: MeasurementProtocol = MeasurementProtocol()

    @model_validator(mode="after")
    def _consistent(self) -> Measurement:
        if self.status == Status.OK and (self.candidate is None or self.baseline is None or self.ratio is None):
            raise ValueError("an 'ok' measurement needs 'candidate' and 'baseline' timings and a 'ratio'")

        if self.ratio is not None and self.candidate is not None and self.baseline is not None:
            check_ratio(self, self.candidate, self.baseline, "the candidate's", "the baseline's")
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
    xla_options: dict[ShortText, bool | int | ShortText] = Field(
        default_factory=dict, description="the compile options it needs (method 'xla': XLA's windowed einsum on)")


class BoundsMeasurement(BaseModel):
    """One problem's bounds rounds (`collective_matmul.wire.bounds`): the local matmul alone, the collective alone
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
    protocol: MeasurementProtocol = MeasurementProtocol()

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


class StepMeasurement(BaseModel):
    """Every variant of one training step (the reference block's, or a user's own), timed together on one mesh."""

    model_config = ConfigDict(extra="forbid")

    block: TransformerBlock | None = Field(default=None, description="the reference block as measured "
                                                                     "(global_batch: the batch measured)")
    model: ModelName | None = Field(default=None,
                                   description="a user's step: the name it was verified under (no block)")
    mesh: MeshAxes = Field(max_length=MAX_MESH_AXES, description="mesh axes as measured, in order")
    tensor_axis: ShortText
    batch_axes: list[ShortText] = Field(default_factory=list, max_length=8,
                                        description="the mesh axes sharding the batch")
    hardware: Hardware
    protocol: MeasurementProtocol
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
            check_rounds(getattr(self, field), self.reference, field)
        return self

    @property
    def name(self) -> str:
        """The model's name: the block's, or the user's step's."""
        return self.block.name if self.block is not None else self.model

    def variant(self, name: str) -> StepVariant:
        """The variant called ``name``.

        Raises:
            KeyError: if there is none.
        """
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"no variant {name!r}; measured: {[v.name for v in self.variants]}")


class Speedup(BaseModel):
    """A step time ratio, as a speedup: median of paired rounds and its interquartile range."""

    median: float
    low: float = Field(description="lower quartile of the speedup")
    high: float = Field(description="upper quartile of the speedup")

    @classmethod
    def of(cls, quartiles_: Quartiles | None) -> Speedup | None:
        """The speedup of a time ratio's quartiles (None: none)."""
        if quartiles_ is None:
            return None
        q1, median, q3 = quartiles_
        return cls(median=1 / median, low=1 / q3, high=1 / q1)

    def __str__(self) -> str:
        return f"{self.median:.2f}x (IQR {self.low:.2f}-{self.high:.2f})"


class StepChoice(BaseModel):
    """What a step measurement decided (`cmtune.tuner.decision.step_decision`), stored with its step study and
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
