"""Compiling candidates for devices that cannot run them here (a TPU slice or a GPU node compiled ahead of time).

`CompileSession` is the measurement protocol without its timing: each candidate of a problem is lowered for
abstract inputs laid out as the problem says, compiled by the backend's real compiler, and recorded as a
`collective_matmul.wire.CompiledCandidate`: compile seconds, memory per device
(``Compiled.memory_analysis()``) and the compiled schedule's overlap verdict (`collective_matmul.programs.schedule`).
Beside cmtune's candidates it compiles the product as a user writes it, with XLA's own windowed einsum off
and on (`collective_matmul.planning.xla_options`), where the backend has one: what a ring is up against there.
`compile_user_step` does the same for a user's whole step (`cmtune verify --step --compile-only`): the step as
written and through the drop-in, each a `CompiledVariant`.  Nothing runs; nothing here is a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cmtune.tuner.variants import REFERENCE
from cmtune.workers.measure import (
    classify_failure,
    compiled_memory,
    compiler_options_of,
    default_program,
    error_message,
    operand_shapes,
    ring_mesh_of,
)
from cmtune.workers.userstep import Built, step_variants, unshared
from collective_matmul.client.report import Report
from collective_matmul.ops.collective import input_shardings
from collective_matmul.planning.costmodel import HardwareProfile, profile_of_kind
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.models import ring_hardware
from collective_matmul.planning.problem import Collective, Problem
from collective_matmul.planning.text import as_message
from collective_matmul.planning.xla_options import windowed_einsum
from collective_matmul.programs.gpus import compile_options, deviceless_options
from collective_matmul.programs.hlo import parse_module
from collective_matmul.programs.predict import Prediction, predict
from collective_matmul.programs.schedule import Overlap, overlap
from collective_matmul.wire import CompiledCandidate, ProblemScreen, Screened


class CompileSession:
    """One problem's candidates compiled for ``mesh`` (``axis`` the ring, by default its last: every ring of the
    mesh runs the program at once), never run."""

    def __init__(self, problem: Problem, mesh: Mesh, axis: str | None = None):
        self.problem, self.mesh = problem, mesh
        self.axis = axis or mesh.axis_names[-1]
        if mesh.shape[self.axis] != problem.axis_size:
            raise ValueError(f"{problem.key} needs a ring of {problem.axis_size} devices, the mesh has "
                             f"{mesh.shape[self.axis]}")
        self.platform = mesh.devices.flat[0].platform
        self.hardware = ring_hardware(mesh, self.axis)
        shapes, dtype = operand_shapes(problem), jnp.dtype(problem.dtype)
        self.args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, sharding in
                     zip(shapes, input_shardings(problem.collective, mesh, self.axis), strict=True)]

    def compile(self, config: Decomposition) -> CompiledCandidate:
        """Compile ``config``'s program; a failure is the record's status, never an exception."""
        return self.compile_predicted(config).candidate

    def as_written(self, windowed: str | None = None) -> CompiledCandidate:
        """The product as a user writes it (a plain ``jnp`` product, GSPMD placing the collective), with XLA's
        windowed einsum ``off`` or ``on`` (None: the backend's default, its size threshold)."""
        return self.as_written_predicted(windowed).candidate

    def compile_predicted(self, config: Decomposition) -> PredictedCandidate:
        """`compile`, with the compiled schedule's predicted time (`collective_matmul.programs.predict`)."""
        record = dict(problem=self.problem, decomposition=config, hardware=self.hardware)
        try:
            self.problem.check(config)
        except ValueError as exc:
            return PredictedCandidate(CompiledCandidate(**record, status="compile_error",
                                                        message=f"invalid decomposition: {exc}"))
        return self._compiled(record, default_program(self.problem, config, self.mesh, self.axis),
                              compiler_options_of(config, self.mesh) or {})

    def as_written_predicted(self, windowed: str | None = None) -> PredictedCandidate:
        """`as_written`, with the compiled schedule's predicted time."""
        options = windowed_einsum(self.platform, windowed) if windowed else {}
        record = dict(problem=self.problem, decomposition=Decomposition.baseline(), hardware=self.hardware)
        return self._compiled(record, plain_program(self.problem, self.mesh, self.axis), options or {})

    def _compiled(self, record: dict, program, options: dict) -> PredictedCandidate:
        options = compile_options(self.mesh.devices.flat, options)
        started = time.perf_counter()
        try:
            compiled = jax.jit(program).lower(*self.args).compile(compiler_options=options or None)
        except Exception as exc:  # noqa: BLE001 - any compile failure is a result
            oom = classify_failure(exc) == "oom"
            return PredictedCandidate(CompiledCandidate(**record, status="oom" if oom else "compile_error",
                                                        message=as_message(error_message(exc), 2000),
                                                        xla_options=options))
        seconds = time.perf_counter() - started
        module = parse_module(compiled.as_text())  # read once: the verdict and the prediction share it
        verdict = overlap(module)
        profile = accelerator_profile(self.mesh.devices.flat[0])
        candidate = CompiledCandidate(**record, status="compiled", compile_s=seconds,
                                      memory_bytes=compiled_memory(compiled), overlap=verdict.verdict,
                                      overlap_note=verdict.summary(), xla_options=options)
        return PredictedCandidate(candidate, predict(module, profile) if profile is not None else None)


def accelerator_profile(device) -> HardwareProfile | None:
    """The published figures a prediction for ``device``'s kind uses (None: a kind without figures, or virtual CPU
    devices, whose profile orders candidates but predicts nothing worth printing)."""
    return None if device.platform == "cpu" else profile_of_kind(device.device_kind)


@dataclass(frozen=True)
class PredictedCandidate:
    """A compiled candidate and its predicted time (None: it did not compile, or no profile has figures for its
    device kind).  The prediction is the cost model's, never a measurement; it stays off the wire."""

    candidate: CompiledCandidate
    prediction: Prediction | None = None


def plain_program(problem: Problem, mesh: Mesh, axis: str):
    """The problem's product as a user writes it: one ``jnp`` product of the sharded operands, its result laid out
    as the problem's op lays it (XLA's partitioner places the collective, and may decompose it itself)."""
    out = {Collective.ALLGATHER_MATMUL: P(None, axis), Collective.MATMUL_REDUCE_SCATTER: P(axis, None),
           Collective.ALLGATHER_GRAD_WEIGHT: P(None, axis)}.get(problem.collective, P(axis, None))  # FSDP's: rows kept
    sharding = NamedSharding(mesh, out)
    if problem.collective in (Collective.ALLGATHER_GRAD_WEIGHT, Collective.REDUCE_SCATTER_GRAD_WEIGHT):
        return lambda u, v: jax.lax.with_sharding_constraint(jnp.tensordot(u, v, axes=((0,), (0,))), sharding)
    return lambda x, w: jax.lax.with_sharding_constraint(x @ w, sharding)


def compile_all(problem: Problem, mesh: Mesh, configs: Sequence[Decomposition]) -> list[CompiledCandidate]:
    """The product as written (at XLA's default, and with its windowed einsum off where the backend has one), then
    every one of ``configs`` (``method="xla"`` among them: the windowed einsum on), compiled for ``mesh``."""
    return [p.candidate for p in compile_all_predicted(problem, mesh, configs)]


def compile_all_predicted(problem: Problem, mesh: Mesh, configs: Sequence[Decomposition]) -> list[PredictedCandidate]:
    """`compile_all`, each with its compiled schedule's predicted time."""
    session = CompileSession(problem, mesh)
    written = [session.as_written_predicted()]
    if windowed_einsum(session.platform, "off") is not None:
        written.append(session.as_written_predicted("off"))  # "on" is the candidate method="xla"
    return written + [session.compile_predicted(config) for config in configs]


def screen(problem: Problem, mesh: Mesh, axis: str | None = None) -> tuple[Screened, ...]:
    """The compile screen of a study: every ring candidate of ``problem`` (and XLA's windowed einsum, where the
    platform has it) compiled for ``mesh``, each with its schedule's verdict, for the search to propose the forms
    that overlap first (`cmtune.tuner.search.SearchSettings.screen`).  Seconds on a GPU node (about half a second
    a candidate for H100 and B200 in the GPU compile bench), nothing run."""
    from collective_matmul.planning.space import candidates

    session = CompileSession(problem, mesh, axis)
    screened = []
    for config in candidates(problem, include_baseline=False, platform=session.platform):
        compiled = session.compile(config)
        ok = compiled.status == "compiled"
        screened.append(Screened(decomposition=config, overlap=compiled.overlap if ok else None,
                                 note=compiled.overlap_note if ok else as_message(compiled.message, 200)))
    return tuple(screened)


def screen_problems(problems: Sequence[Problem], devices: Sequence) -> list[ProblemScreen]:
    """The compile screen (`screen`) of each unique problem of ``problems`` with a ring, on rings of ``devices``:
    what `cmtune submit --screen` sends (a problem without a ring has none: the service says there is nothing to
    tune).

    Raises:
        ValueError: where a problem's ring does not divide the devices (the message names the problem).
    """
    from collective_matmul.planning.space import has_ring

    kind, screens = devices[0].device_kind, {}
    for problem in problems:
        if problem.key in screens or not has_ring(problem):
            continue
        try:
            mesh = ring_mesh_of(devices, problem.axis_size)
        except ValueError as exc:
            raise ValueError(f"{problem.key}: {exc} of the {len(devices)} devices") from None
        screens[problem.key] = ProblemScreen(problem=problem.key, device_kind=kind, screen=list(screen(problem, mesh)))
    return list(screens.values())


@dataclass(frozen=True, kw_only=True)
class ProductPrediction:
    """One problem's programs compiled and predicted (seconds, predicted, never measured): the product as written
    (XLA's windowed einsum at its default, off where the backend has it, on as ``method="xla"``) and the ring
    candidate the prediction puts first."""

    problem: Problem
    cost_model: str
    as_written_s: float
    windowed_off_s: float | None  # None: the backend has no windowed einsum to turn off
    windowed_einsum_s: float | None  # method="xla": None where the backend has none, or it did not compile
    best: Decomposition | None  # the fastest ring predicted (None: no ring compiled)
    best_s: float | None
    compiled: int  # programs compiled and predicted, of those tried
    tried: int


def predict_problem(problem: Problem, mesh: Mesh) -> ProductPrediction | None:
    """Every candidate of ``problem`` and the product as written compiled for ``mesh`` and predicted (None: no
    figures for the devices' kind, or the product as written did not compile)."""
    from collective_matmul.planning.space import candidates

    if accelerator_profile(mesh.devices.flat[0]) is None:
        return None
    platform = mesh.devices.flat[0].platform
    results = compile_all_predicted(problem, mesh, candidates(problem, platform=platform))
    written = results[0].prediction
    if written is None:
        return None
    has_off = windowed_einsum(platform, "off") is not None
    off = results[1].prediction if has_off else None
    configs = results[2 if has_off else 1:]
    xla = next((r.prediction for r in configs if r.candidate.decomposition.method == "xla"), None)
    rings = [r for r in configs if r.candidate.decomposition.method == "ring" and r.prediction is not None]
    best = min(rings, key=lambda r: r.prediction.seconds, default=None)
    return ProductPrediction(problem=problem, cost_model=written.cost_model, as_written_s=written.seconds,
                             windowed_off_s=off.seconds if off else None,
                             windowed_einsum_s=xla.seconds if xla else None,
                             best=best.candidate.decomposition if best else None,
                             best_s=best.prediction.seconds if best else None,
                             compiled=sum(r.prediction is not None for r in results), tried=len(results))


COUNTED = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")  # a step's collectives, as counted


@dataclass(frozen=True, kw_only=True)
class CompiledVariant:
    """One variant of a step compiled for its mesh, never run; a variant that does not compile has its ``error``."""

    label: str  # `REFERENCE` (as written), baseline, tuned, tuned-no-share (`cmtune.workers.userstep.step_variants`)
    windowed_einsum: str | None = None  # as written: XLA's windowed einsum default, off or on (where it has one)
    compile_s: float | None = None
    memory_bytes: int | None = None  # per device (``Compiled.memory_analysis()``)
    collectives: Mapping[str, int] = field(default_factory=dict)  # each of `COUNTED`: its ops, async or not
    overlap: Overlap | None = None
    prediction: Prediction | None = None  # the compiled schedule's predicted time (None: no figures for its kind)
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class CompiledStep:
    """A user's step compiled as written and through the drop-in (`compile_user_step`)."""

    mesh: Mapping[str, int]
    platform: str
    variants: tuple[CompiledVariant, ...]
    sites: Report  # the call sites the tuned variant traced (`collective_matmul.Tuned.report`)
    device_options: Mapping[str, object]  # the options every compile for these devices set (deviceless GPUs')


def compile_user_step(fn: Callable, spec: str, tuned, *, devices=None) -> CompiledStep:
    """NAME's step compiled, never run: as written (with XLA's windowed einsum at its default, off and on, where the
    backend has it), through the drop-in at the baseline and with ``tuned``'s configs, and, where the tuned step
    shared a gather, with every call gathering for itself.

    Args:
        fn: the spec's NAME (`cmtune.workers.userstep.SpecRef.load`).
        spec: the spec as given, for its messages.
        tuned: the `collective_matmul.Tuned` client of the tuned variant (its ``share`` as asked).
        devices: a compile-only target's devices (a TPU slice's, a GPU node's); None: this process's.

    Returns:
        The `CompiledStep`: one `CompiledVariant` per variant (a compile that fails is one with its error).

    Raises:
        cmtune.workers.userstep.SpecError: where NAME breaks the step spec's contract.
    """
    reference = Built.of(fn, None, spec=spec, devices=devices)
    platform = reference.mesh.devices.flat[0].platform
    settings = [s for s in ("off", "on") if windowed_einsum(platform, s) is not None]
    variants = [(REFERENCE, None, reference, {})] if not settings else [
        (REFERENCE, s or "default", reference, windowed_einsum(platform, s) if s else {}) for s in (None, *settings)]
    variants += [(label, None, Built.of(fn, source, spec=spec, devices=devices), {})
                 for label, source in step_variants(tuned).items() if source is not None]
    compiled = [_compiled_variant(*variant) for variant in variants]
    sites = tuned.report()  # the tuned step was traced by its compile: did it share a gather?
    if sites.groups:
        compiled.append(_compiled_variant("tuned-no-share", None, Built.of(fn, unshared(tuned), spec=spec,
                                                                            devices=devices), {}))
    return CompiledStep(mesh={str(n): int(s) for n, s in reference.mesh.shape.items()}, platform=platform,
                        variants=tuple(compiled), sites=sites,
                        device_options=deviceless_options(reference.mesh.devices.flat))


def _compiled_variant(label: str, windowed: str | None, built: Built, options: dict) -> CompiledVariant:
    """One variant of `compile_user_step`; a step that does not compile is a variant with the reason."""
    options = compile_options(built.mesh.devices.flat, options)
    started = time.monotonic()
    try:
        compiled = built.step.lower(*built.args).compile(compiler_options=options or None)
    except Exception as exc:  # noqa: BLE001 - a variant with the reason
        return CompiledVariant(label=label, windowed_einsum=windowed, error=f"{type(exc).__name__}: {exc}"[:300])
    seconds, text = time.monotonic() - started, compiled.as_text()
    module = parse_module(text)
    opcodes = [inst.opcode for comp in module.computations.values() for inst in comp.instructions.values()]
    profile = accelerator_profile(built.mesh.devices.flat[0])
    return CompiledVariant(label=label, windowed_einsum=windowed, compile_s=seconds,
                           memory_bytes=compiled_memory(compiled), overlap=overlap(module),
                           prediction=predict(module, profile) if profile is not None else None,
                           collectives={op: opcodes.count(op) + opcodes.count(f"{op}-start") for op in COUNTED})
