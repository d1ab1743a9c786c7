"""The measurement protocol: time one candidate decomposition against the baseline, honestly.

1. Inputs from a seeded normal distribution, laid out as the problem says.
2. Ahead-of-time compile; compile seconds, the compiled memory estimate and the schedule's overlap verdict
   (`collective_matmul.programs.schedule`: is a product scheduled while each permute is in flight?) are recorded.
3. Validation against the baseline's result (relative error bound by dtype); a wrong candidate
   is ``invalid`` and can never win.
4. Warm-up, then candidate and baseline alternately (ABAB...), each sample K calls back to back
   synchronised with `block_until_ready` after the last (K chosen at warm-up so that a barrier and a
   dispatch cannot decide a sample: `calls_per_sample`; recorded as `Timing.calls`, the samples per
   call); with several processes a barrier precedes each sample and the slowest process's time
   counts.  Every sample is kept; median, spread and the median paired ratio to the baseline are
   derived from them.
5. Failures are results: ``compile_error``, ``oom``, ``invalid``, ``timeout``, ``error``.

The bounds of a problem (`OpSession.bounds`, `collective_matmul.wire.bounds`) follow the same protocol:
the local matmul alone and the collective alone (`bound_programs`), each on its own seeded
inputs, timed in turn with the baseline, round by round.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cmtune.workers.compare import relative_error
from cmtune.workers.rounds import Rounds, barrier, slowest_process, time_rounds
from collective_matmul.ops.collective import OPS as MATMULS
from collective_matmul.ops.collective import (
    allgather_grad_weight,
    input_shardings,
    reduce_scatter_grad_weight,
    weight_allgather_matmul,
)
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.models import ring_hardware
from collective_matmul.planning.problem import Collective, Hardware, Problem
from collective_matmul.planning.text import as_message
from collective_matmul.programs.schedule import overlap
from collective_matmul.programs.topology import mesh_of
from collective_matmul.wire import BoundsMeasurement, Measurement, MeasurementProtocol, Status, Timing, quartiles

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 1e-2}
RING_AXIS = "ring"
RINGS_AXIS = "rings"  # the rings of a problem smaller than the devices, side by side (`ring_mesh`)

# Builds the program for a candidate: (x, w) -> out, over the given mesh and axis.
Program = Callable[[jax.Array, jax.Array], jax.Array]
ProgramBuilder = Callable[[Problem, Decomposition, Mesh, str], Program]
OPS = {**MATMULS, Collective.ALLGATHER_GRAD_WEIGHT: allgather_grad_weight,
       Collective.WEIGHT_ALLGATHER_MATMUL_K: partial(weight_allgather_matmul, weight_dim="k"),
       Collective.WEIGHT_ALLGATHER_MATMUL_N: partial(weight_allgather_matmul, weight_dim="n"),
       Collective.REDUCE_SCATTER_GRAD_WEIGHT: reduce_scatter_grad_weight}
_CONTRACTING_ROWS = (Collective.ALLGATHER_GRAD_WEIGHT, Collective.REDUCE_SCATTER_GRAD_WEIGHT)  # u [m, k] and v [m, n]


def default_program(problem: Problem, config: Decomposition, mesh: Mesh, axis: str) -> Program:
    op = OPS[problem.collective]
    return lambda x, w: op(x, w, mesh=mesh, axis=axis, config=config)


def operand_shapes(problem: Problem) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global shapes of a problem's two operands: ``x [m, k], w [k, n]``; ``u [m, k], v [m, n]`` (the weight
    gradients)."""
    second = (problem.m, problem.n) if problem.collective in _CONTRACTING_ROWS else (problem.k, problem.n)
    return (problem.m, problem.k), second


@dataclass(frozen=True)
class BoundProgram:
    """One bound program (the matmul alone, or the collective alone) over a mesh: its body in `shard_map`, and
    the global shapes and partition specs of its operands."""

    body: Callable[..., jax.Array]
    operands: list[tuple[tuple[int, ...], P]]
    out_spec: P
    mesh: Mesh

    @property
    def program(self) -> Callable[..., jax.Array]:
        return jax.shard_map(self.body, mesh=self.mesh, in_specs=tuple(spec for _, spec in self.operands),
                             out_specs=self.out_spec)

    def inputs(self, key: jax.Array, dtype) -> list[jax.Array]:
        """Its operands from a seeded normal distribution, placed as its specs say."""
        keys = jax.random.split(key, len(self.operands))
        return [jax.jit(lambda k, shape=shape: jax.random.normal(k, shape, dtype),
                        out_shardings=NamedSharding(self.mesh, spec))(k)
                for k, (shape, spec) in zip(keys, self.operands, strict=True)]


def bound_programs(problem: Problem, mesh: Mesh, axis: str) -> dict[str, BoundProgram]:
    """The programs a problem's bounds time: ``compute``, each device's local product of the baseline with no
    collective, and ``communication``, the baseline's collective on the same bytes with no matmul.

    Per device (P the ring size; the layouts of docs/decompositions.md):

    - ``allgather_matmul``: compute ``x [m, k] @ w [k, n/P]`` (x as gathered, held whole); communication
      the all-gather of ``x [m/P, k]``;
    - ``matmul_reduce_scatter``: compute ``x [m, k/P] @ w [k/P, n]`` (each device's partial sum, kept as
      its own block of the output); communication the reduce-scatter of a partial sum ``[m, n]`` to
      ``[m/P, n]``;
    - ``allgather_grad_weight``: compute ``u [m, k]ᵀ @ v [m, n/P]`` (u as gathered); communication the
      all-gather of ``u [m/P, k]``;
    - ``weight_allgather_matmul_k`` / ``_n``: compute ``x [m/P, k] @ w [k, n]`` (w as gathered); communication
      the all-gather of ``w [k/P, n]`` / ``w [k, n/P]``;
    - ``reduce_scatter_grad_weight``: compute ``u [m/P, k]ᵀ @ v [m/P, n]`` (each device's partial sum, kept as its
      own block); communication the reduce-scatter of a partial sum ``[k, n]`` to ``[k/P, n]``.

    Every output is each device's own block (a gathered copy is not declared replicated: nothing is
    assumed of it).
    """
    m, k, n, size = problem.m, problem.k, problem.n, problem.axis_size

    def gather(x):
        return lax.all_gather(x, axis, axis=0, tiled=True)

    def scatter(y):
        return lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)

    if problem.collective == Collective.ALLGATHER_MATMUL:
        compute = BoundProgram(jnp.matmul, [((m, k), P(None, None)), ((k, n), P(None, axis))], P(None, axis), mesh)
        communication = BoundProgram(gather, [((m, k), P(axis, None))], P(axis, None), mesh)
    elif problem.collective == Collective.MATMUL_REDUCE_SCATTER:
        compute = BoundProgram(jnp.matmul, [((m, k), P(None, axis)), ((k, n), P(axis, None))], P(axis, None), mesh)
        communication = BoundProgram(scatter, [((size * m, n), P(axis, None))], P(axis, None), mesh)
    elif problem.collective == Collective.ALLGATHER_GRAD_WEIGHT:
        def contract(u, v):
            return jnp.tensordot(u, v, axes=((0,), (0,)))

        compute = BoundProgram(contract, [((m, k), P(None, None)), ((m, n), P(None, axis))], P(None, axis), mesh)
        communication = BoundProgram(gather, [((m, k), P(axis, None))], P(axis, None), mesh)
    elif problem.collective in (Collective.WEIGHT_ALLGATHER_MATMUL_K, Collective.WEIGHT_ALLGATHER_MATMUL_N):
        dim = 0 if problem.collective.endswith("_k") else 1
        compute = BoundProgram(jnp.matmul, [((m, k), P(axis, None)), ((k, n), P(None, None))], P(axis, None), mesh)
        w_spec = P(axis, None) if dim == 0 else P(None, axis)
        communication = BoundProgram(lambda w: lax.all_gather(w, axis, axis=dim, tiled=True), [((k, n), w_spec)],
                                     w_spec, mesh)
    elif problem.collective == Collective.REDUCE_SCATTER_GRAD_WEIGHT:
        def partial_sum(u, v):
            return jnp.tensordot(u, v, axes=((0,), (0,)))

        compute = BoundProgram(partial_sum, [((m, k), P(axis, None)), ((m, n), P(axis, None))], P(axis, None), mesh)
        communication = BoundProgram(scatter, [((size * k, n), P(axis, None))], P(axis, None), mesh)
    else:
        raise ValueError(f"no bound programs for the collective {str(problem.collective)!r}")
    return {"compute": compute, "communication": communication}


def ring_mesh(devices=None, size: int | None = None) -> Mesh:
    """The rings of ``size`` devices (default: one of all) over ``devices`` (default: every global device), the ring
    axis named ``ring`` and Explicit: one ring of them all is a 1-D mesh, smaller rings the last axis of
    `ring_mesh_of`'s mesh (each of them runs every program at once).

    Raises:
        ValueError: ``size`` does not divide the devices.
    """
    devices = list(devices) if devices is not None else jax.devices()
    if size is None or size == len(devices):
        return mesh_of(devices, (len(devices),), (RING_AXIS,), axis_types=AxisType.Explicit)
    return ring_mesh_of(devices, size, axis_types=AxisType.Explicit)


def ring_mesh_of(devices, ring: int, *, axis_types: AxisType = AxisType.Auto) -> Mesh:
    """The devices as ``len(devices) // ring`` rings of ``ring`` neighbours (axes ``rings``, ``ring``), laid as
    `collective_matmul.programs.topology.mesh_of` lays a mesh's last axis (a TPU slice's physical order, else the
    devices' own).

    Raises:
        ValueError: ``ring`` does not divide the devices.
    """
    devices = list(devices)
    if ring < 1 or len(devices) % ring:
        raise ValueError(f"a ring of {ring} does not divide the {len(devices)} devices")
    return mesh_of(devices, (len(devices) // ring, ring), (RINGS_AXIS, RING_AXIS), axis_types=axis_types)


def failure(problem: Problem, config: Decomposition, protocol: MeasurementProtocol, status: Status,
            message: str) -> Measurement:
    """The record of a candidate that could not be timed (on the hardware of its rings here, where they fit)."""
    try:
        hardware = ring_hardware(ring_mesh(None, problem.axis_size), RING_AXIS)
    except ValueError:  # no ring of its size divides the devices here
        hardware = Hardware.detect()
    return Measurement(problem=problem, decomposition=config, hardware=hardware, status=status,
                       message=as_message(message, 2000), protocol=protocol)


def device_memory(device=None) -> int | None:
    """Bytes one device may use: what the runtime reports, else (CPU) this process's share of the host.

    On CPU the virtual devices share the host: the physical memory, or the address-space limit
    (RLIMIT_AS) if lower, divided among this process's devices.  None if nothing is known.
    """
    import os
    import resource

    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform != "cpu":
        return None
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft - _address_space_in_use())  # the runtime itself already holds part of it
    return max(min(limits), 0) // jax.local_device_count()


def _address_space_in_use() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def classify_failure(exc: BaseException) -> Status:
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, MemoryError) or "resource_exhausted" in text or "out of memory" in text \
            or "oom" in text.split():
        return Status.OOM
    return Status.ERROR


class OpSession:
    """The op measurement session: inputs, the compiled baseline and its result for one problem; measure many
    candidates.

    The problem runs on every ring of ``mesh`` along ``axis`` at once (default: the rings of its size over
    ``devices``, `ring_mesh`): the inputs are sharded over the ring axis only and replicated over the others, and
    a program's time is the whole program's (the slowest ring's).  Its hardware is the first ring's, part of a
    slice of the mesh's devices (`collective_matmul.planning.models.ring_hardware`).

    Works in one process or across a `jax.distributed` cluster (every process must call the
    same methods in the same order, as in any SPMD program).

    Raises:
        ValueError: the problem's ring size does not divide the devices (or is not the size of ``axis``).
    """

    def __init__(
        self,
        problem: Problem,
        *,
        protocol: MeasurementProtocol = MeasurementProtocol(),
        mesh: Mesh | None = None,
        axis: str | None = None,
        devices=None,
        build: ProgramBuilder = default_program,
    ):
        self.problem = problem
        self.protocol = protocol
        self.mesh = mesh or ring_mesh(devices, problem.axis_size)
        self.axis = axis or self.mesh.axis_names[-1]
        if self.mesh.shape[self.axis] != problem.axis_size:
            raise ValueError(
                f"problem needs a ring of {problem.axis_size} devices but the mesh has "
                f"{self.mesh.shape[self.axis]}"
            )
        self.build = build
        self.hardware = ring_hardware(self.mesh, self.axis)
        self.x, self.w = self._inputs()
        self._baseline_program, _, _ = self._compile(Decomposition.baseline())
        self.expected = self._baseline_program(self.x, self.w).block_until_ready()  # what a candidate must equal

    def _inputs(self) -> tuple[jax.Array, jax.Array]:
        p = self.problem
        sx, sw = input_shardings(p.collective, self.mesh, self.axis)
        kx, kw = jax.random.split(jax.random.key(self.protocol.seed))
        dtype = jnp.dtype(p.dtype)
        x_shape, w_shape = operand_shapes(p)
        x = jax.jit(lambda k: jax.random.normal(k, x_shape, dtype), out_shardings=sx)(kx)
        w = jax.jit(lambda k: jax.random.normal(k, w_shape, dtype), out_shardings=sw)(kw)
        return x, w

    def _compile(self, config: Decomposition):
        program = self.build(self.problem, config, self.mesh, self.axis)
        start = time.perf_counter()
        options = compiler_options_of(config, self.mesh)
        compiled = jax.jit(program).lower(self.x, self.w).compile(compiler_options=options)
        seconds = time.perf_counter() - start
        return compiled, seconds, compiled_memory(compiled)

    def measure(self, config: Decomposition, protocol: MeasurementProtocol | None = None) -> Measurement:
        """Run the protocol for ``config``; failures come back as a `Measurement` status.

        ``protocol`` may change the warm-up, repeats and timeout (not the seed: the inputs are
        this session's).
        """
        protocol = protocol or self.protocol
        started = time.monotonic()
        record = dict(problem=self.problem, decomposition=config, hardware=self.hardware, protocol=protocol)
        try:
            self.problem.check(config)
        except ValueError as exc:
            return Measurement(**record, status="compile_error", message=f"invalid decomposition: {exc}")
        try:
            compiled, compile_s, memory = self._compile(config)
        except Exception as exc:  # noqa: BLE001 - any compile failure is a result
            status = classify_failure(exc)
            return Measurement(**record, status="oom" if status == "oom" else "compile_error",
                               message=error_message(exc))
        verdict = overlap(compiled.as_text())
        record |= dict(compile_s=compile_s, memory_bytes=memory, overlap=verdict.verdict,
                       overlap_note=verdict.summary())
        try:
            out = compiled(self.x, self.w).block_until_ready()
            rel_error = relative_error(out, self.expected)
            del out
        except Exception as exc:  # noqa: BLE001
            return Measurement(**record, status=classify_failure(exc), message=error_message(exc))
        record["rel_error"] = rel_error
        tolerance = TOLERANCE[self.problem.dtype]
        if not np.isfinite(rel_error) or rel_error > tolerance:
            return Measurement(
                **record, status="invalid",
                message=f"relative error {rel_error:.3g} against the baseline exceeds {tolerance:g}",
            )
        try:
            rounds = self._rounds({"candidate": lambda: compiled(self.x, self.w), "baseline": self._run_baseline},
                                  started, protocol)
        except Exception as exc:  # noqa: BLE001
            return Measurement(**record, status=classify_failure(exc), message=error_message(exc))
        cand, base = rounds.samples["candidate"], rounds.samples["baseline"]
        ratios = [c / b for c, b in zip(cand, base, strict=True)]
        q1, ratio, q3 = quartiles(ratios)
        return Measurement(
            **record,
            status="timeout" if rounds.timed_out else "ok",
            message=rounds.message,
            candidate=Timing.of(cand, rounds.calls),
            baseline=Timing.of(base, rounds.calls),
            ratio=ratio,
            ratio_iqr=q3 - q1,
        )

    def _rounds(self, runs: dict[str, Callable[[], jax.Array]], started: float, protocol: MeasurementProtocol
                ) -> Rounds:
        """`time_rounds` of ``runs`` in a fixed order, K ``protocol.calls`` or chosen at warm-up by
        `calls_per_sample` against this session's `overhead_s`."""
        platform = self.mesh.devices.flat[0].platform
        calls = protocol.calls if protocol.calls is not None else (
            lambda single: calls_per_sample(single, self.overhead_s, platform))
        return time_rounds(runs, started=started, protocol=protocol, calls=calls)

    @functools.cached_property
    def overhead_s(self) -> float:
        """A barrier and a dispatch on this session's mesh (`overhead_s`), measured once: every candidate's K is
        chosen against it (every process reads it at the same call, the first trial's warm-up)."""
        return overhead_s(self.mesh)

    def _run_baseline(self) -> jax.Array:
        return self._baseline_program(self.x, self.w)

    def bounds(self, protocol: MeasurementProtocol | None = None) -> BoundsMeasurement:
        """Time the problem's bounds (`bound_programs`): compute, communication and the baseline in turn, each
        round, by the protocol; failures come back as the record's status.

        The bound programs get their own inputs, seeded from this session's seed, and free them when done.
        """
        protocol = protocol or self.protocol
        started = time.monotonic()
        record = dict(problem=self.problem, hardware=self.hardware, protocol=protocol)
        try:
            programs = bound_programs(self.problem, self.mesh, self.axis)
            key = jax.random.fold_in(jax.random.key(protocol.seed), 1)
            dtype = jnp.dtype(self.problem.dtype)
            runs = []
            for i, bound in enumerate(programs.values()):
                inputs = bound.inputs(jax.random.fold_in(key, i), dtype)
                compiled = jax.jit(bound.program).lower(*inputs).compile()
                runs.append(lambda compiled=compiled, inputs=inputs: compiled(*inputs))
        except Exception as exc:  # noqa: BLE001 - a bound program that does not build is a result
            status = classify_failure(exc)
            return BoundsMeasurement(**record, status="oom" if status == "oom" else "compile_error",
                                     message=error_message(exc))
        try:
            rounds = self._rounds({**dict(zip(programs, runs, strict=True)), "baseline": self._run_baseline},
                                  started, protocol)
        except Exception as exc:  # noqa: BLE001
            return BoundsMeasurement(**record, status=classify_failure(exc), message=error_message(exc))
        return BoundsMeasurement(
            **record, status="timeout" if rounds.timed_out else "ok", message=rounds.message,
            **{name: Timing.of(samples, rounds.calls) for name, samples in rounds.samples.items()})


SAMPLE_OVER_OVERHEAD = 50  # a sample lasts at least this many times a barrier and a dispatch (bench/short_programs.py:
# at 20, K of 4-7 left the spread of a pair's ratio over runs at 0.4-1.0 of one call's; at 50, K of 15-20, 0.35-0.43)
ACCELERATOR_SAMPLE_S = 1e-3  # and on an accelerator at least this long
# XLA's CPU client runs every virtual device's part of a collective program on one shared thread pool: a few dozen
# collective programs queued back to back leave a rendezvous short of threads, which aborts the process after 40 s
# (seen at 40 calls of an all-gather matmul on 8 devices of 2 cores).  On CPU a sample queues at most this many.
MAX_CPU_CALLS = 20


def calls_per_sample(run_s: float, overhead_s: float, platform: str) -> int:
    """K: how many calls of a program of ``run_s`` seconds one sample times back to back, so that a barrier and a
    dispatch (``overhead_s``) cannot decide it: the sample lasts at least `SAMPLE_OVER_OVERHEAD` times the
    overhead, and `ACCELERATOR_SAMPLE_S` on an accelerator; at most `MAX_CPU_CALLS` on CPU."""
    floor = max(SAMPLE_OVER_OVERHEAD * overhead_s, ACCELERATOR_SAMPLE_S if platform != "cpu" else 0.0)
    calls = max(1, math.ceil(floor / max(run_s, 1e-9)))
    return min(calls, MAX_CPU_CALLS) if platform == "cpu" else calls


def overhead_s(mesh: Mesh | None = None, repeats: int = 20) -> float:
    """What a sample costs beyond its calls: a barrier across the processes and one dispatch of a trivial program
    over the devices of ``mesh`` (default: every device), the median of ``repeats`` (the slowest process's: every
    process must call this together)."""
    trivial = _trivial(mesh or ring_mesh())
    trivial().block_until_ready()
    times = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        trivial().block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(slowest_process(times)))


@functools.lru_cache(maxsize=8)
def _trivial(mesh: Mesh):
    """A program that does next to nothing on every device of ``mesh``: what a dispatch costs there."""
    axes = tuple(mesh.axis_names)
    return jax.jit(lambda: jnp.zeros((mesh.size,), jnp.float32), out_shardings=NamedSharding(mesh, P(axes)))


def measure(problem: Problem, config: Decomposition,
            protocol: MeasurementProtocol = MeasurementProtocol()) -> Measurement:
    """Measure one candidate on all devices, as rings of its size (a one-off `OpSession`)."""
    return OpSession(problem, protocol=protocol).measure(config)


def compiler_options_of(config: Decomposition, mesh: Mesh) -> dict | None:
    """The compile options ``config`` needs: XLA's windowed einsum on for ``method="xla"`` (None otherwise, and on a
    backend without one)."""
    if config.method != "xla":
        return None
    from collective_matmul.planning.xla_options import windowed_einsum

    return windowed_einsum(mesh.devices.flat[0].platform, "on")


def compiled_memory(compiled) -> int | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return None
    if stats is None:
        return None
    return int(
        stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
    )


def error_message(exc: BaseException) -> str:
    """What a failure says: its type and text, as a valid message (an error's text may hold anything)."""
    return as_message(f"{type(exc).__name__}: {exc}", 2000)


def __getattr__(name: str):
    if name == "Session":  # the name before `OpSession`: one more release
        import warnings

        warnings.warn("cmtune.workers.measure.Session is now cmtune.workers.measure.OpSession: the old name goes in "
                      "the next release", DeprecationWarning, stacklevel=2)
        return OpSession
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
