"""The step measurement: the whole training step of one block, tuned configs against the block as written.

What users buy cmtune for is a faster step, so each *variant* of the step (a `ConfigSource` for
the block's four op calls, or `AS_WRITTEN`, the block as a user writes it without cmtune: GSPMD
einsums and JAX's autodiff) is timed whole:
``value_and_grad`` of the block's loss and the SGD update, jitted.  The protocol follows
`cmtune.workers.measure`:

1. Parameters from `init_params` and inputs (x, target) from a seeded normal distribution, laid
   out as the block expects (seq over the tensor axis, batch over the data axes).
2. Each variant's `train_step` is compiled ahead of time, with the learning rate an argument;
   compile seconds and the compiled memory estimate are recorded.
3. The very program that is timed is checked: one step at a learning rate large enough that
   the update dwarfs every parameter (found from one step of the reference), so ``p - new``
   carries ``lr * grad`` to the last bits.  Every variant's loss and gradients are compared
   with the reference variant's (the block as written) by dtype (relative error in norm: float32
   <= 1e-5, bfloat16 <= 2e-2); a variant that disagrees is ``invalid`` and is not timed.
4. Warm-up, then the variants in rounds, each variant once a round, every round in its own order
   (a shuffle seeded by the protocol's seed and the round, the same on every process: no variant
   always runs right after the same neighbour, at the same place in the round), each run
   synchronised with `block_until_ready`; with several processes a barrier precedes each run and the slowest
   process's time counts.  Every sample is kept; per variant the median, the IQR and the median
   of its time over the reference's in the same round (paired by round) with that ratio's IQR.
5. Failures are results per variant (``compile_error``, ``oom``, ``invalid``, ``error``); the
   protocol's timeout is checked between rounds (every process agrees to stop together).

`standard_variants` builds the usual set (as-written, baseline, tuned, two whole-step
alternatives and a per-role ablation) and `step_layout` the mesh and batch to measure a submission on.
`search_step` runs the step search (`cmtune.tuner.stepsearch`) over a session: process 0 plans each
round, every process times it.  The result types (`StepVariant`, `StepMeasurement`) are part of the
wire contract (`collective_matmul.wire`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from cmtune.tuner.variants import REFERENCE, variant_configs
from collective_matmul.decomposition import OpConfigs
from collective_matmul.models import MeshSpec, TransformerBlock
from collective_matmul.problem import Hardware
from collective_matmul.wire import ChosenVariant, Protocol, Status, StepMeasurement, StepVariant, Timing, quartiles

if TYPE_CHECKING:
    from jax.sharding import Mesh

AUTO = "auto"

# ---- the variants ------------------------------------------------------------------------


def standard_variants(tuned: Mapping[str, OpConfigs], *, ablation: bool = True) -> dict:
    """`variant_configs` as config sources for `StepSession.measure` (`AS_WRITTEN` or `FixedConfigs`)."""
    from collective_matmul.block import AS_WRITTEN, FixedConfigs

    return {name: AS_WRITTEN if configs is None else FixedConfigs(configs)
            for name, configs in variant_configs(tuned, ablation=ablation).items()}


# ---- a step trial, as a worker or the local runner runs it -------------------------------


def run_step(task, session: StepSession | None = None) -> StepMeasurement:
    """A step trial, as a worker runs it: the submitted block on one ring of its mesh.

    ``task`` is a `collective_matmul.wire.TrialTask` of kind ``step``: a round of the step search
    times exactly the variants it names; a task without them times the standard menu of its
    configs, then grades the choice of `step_decision` in fresh rounds (`confirm`).  ``session``:
    one `step_session` made for an earlier round of the same step, whose compiled programs are
    reused.  Failures (a block that does not fit the devices, out of memory, a compile error)
    come back as variant statuses.
    """
    step = task.step
    session = session or step_session(task)
    if step.variants is not None:
        return session.measure(fixed_sources(step.variants), protocol=task.protocol)
    variants = standard_variants(step.configs, ablation=step.ablation)
    measured = session.measure(variants, protocol=task.protocol)
    return confirm(session, measured, variants, step.configs)


def step_session(task) -> StepSession:
    """The session a step trial runs in: the submitted block on one ring of its mesh, with the trial's seed."""
    step = task.step
    layout = step_layout(step.block, MeshSpec(axes=step.mesh, tensor_axis=step.tensor_axis))
    return StepSession(layout.block, layout.mesh, axis=layout.axis, batch_axis=layout.batch_axis,
                       protocol=task.protocol)


def step_session_key(task) -> tuple:
    """What makes two step trials run in the same `step_session` (the block, the mesh, the inputs' seed)."""
    step = task.step
    return step.block, tuple(step.mesh.items()), step.tensor_axis, task.protocol.seed


def fixed_sources(variants: Mapping[str, Mapping[str, OpConfigs] | None]) -> dict:
    """A search round's variants (name -> per-role configs, None: the block as written) as config sources."""
    from collective_matmul.block import AS_WRITTEN, FixedConfigs

    return {name: AS_WRITTEN if setting is None else FixedConfigs(dict(setting)) for name, setting in variants.items()}


def failed_step(task, status: Status, message: str) -> StepMeasurement:
    """The record of a step trial that could not be measured at all (the block did not fit, the worker
    failed around it): the reference and the tuned step, each with ``status`` and ``message``."""
    from collective_matmul.text import as_message

    step, message = task.step, as_message(message, 2000)  # an error's text may hold anything
    return StepMeasurement(block=step.block, mesh=step.mesh, tensor_axis=step.tensor_axis, hardware=Hardware.detect(),
                           protocol=task.protocol, variants=[StepVariant(name=name, status=status, message=message)
                                                             for name in (REFERENCE, "tuned")])


def confirm(session: StepSession, measured: StepMeasurement, variants: Mapping, tuned: Mapping[str, OpConfigs],
            ) -> StepMeasurement:
    """``measured`` with a confirmation: the reference, the all-baseline step and the variant that
    `step_decision` chooses, timed again in fresh interleaved rounds, so that the speedup reported
    is not read from the rounds that picked the winner (those favour it).

    Process 0 decides and the others follow (`Group`), so every process compiles the same
    programs.  Nothing is re-timed when the decision could not be made.
    """
    from cmtune.tuner.engine import step_decision
    from cmtune.workers.cluster import Group

    group, message = Group(), None
    if group.leader:
        decision = step_decision(measured, tuned)
        message = ChosenVariant(variant=decision.variant if decision.ok else None)
    chosen = group.share(message, ChosenVariant).variant
    if chosen is None:
        return measured
    names = dict.fromkeys([measured.reference, "baseline", chosen])
    again = session.measure({name: variants[name] for name in names if name in variants},
                            reference=measured.reference)
    return measured.model_copy(update={"confirmation": again.variants})


def search_step(search, measure: Callable[[dict], StepMeasurement], *, group=None,
                say: Callable[[str], None] | None = None) -> tuple[StepMeasurement | None, list[StepMeasurement]]:
    """Run a step search (`cmtune.tuner.stepsearch.StepSearch`, held by process 0 alone) to its grading.

    Process 0 plans each round and shares it (`collective_matmul.wire.StepRound`); every process
    then times it with ``measure`` (name -> per-role configs, None for the step as written, to a
    `StepMeasurement`; every process must make the same calls), and process 0 records it.  The
    search's extra wall time is what its rounds after the first took here.

    Args:
        search: the search (on processes other than 0: None, or anything; it is not read there).
        measure: times one round's variants.
        group: the process group (`cmtune.workers.cluster.Group`; default: this process's).
        say: called on process 0 with one line per round.

    Returns:
        ``(grading, rounds)``: the grading round's measurement (None if the search failed; its
        decision is ``search.decide(grading)`` on process 0) and every search round's.
    """
    from cmtune.workers.cluster import Group
    from collective_matmul.wire import StepRound

    group = group or Group()
    say = say if group.leader and say is not None else (lambda _line: None)
    rounds: list[StepMeasurement] = []
    while True:
        message = None
        if group.leader:
            plan = search.plan()
            message = StepRound(kind="done" if plan.kind == "failed" else plan.kind, round=plan.round,
                                variants=plan.variants)
            if plan.kind != "search":
                say(f"the step search stops: {plan.reason}")
        message = group.share(message, StepRound)
        if message.kind == "done":
            return None, rounds
        started = time.monotonic()
        result = measure(message.variants)
        if message.kind == "grade":
            return result, rounds
        rounds.append(result)
        if group.leader:
            search.record(message.variants, result, wall_s=time.monotonic() - started)
            say(search.summary())


# ---- the layout: where a step is measured ------------------------------------------------


@dataclass(frozen=True)
class StepLayout:
    """Where a submission's step is measured: one ring of its tensor axis, its data axes cut down."""

    block: TransformerBlock  # global_batch: per_shard_batch x the data shards measured
    mesh: Mesh
    axis: str
    batch_axis: str | tuple[str, ...] | None
    per_shard_batch: int
    submitted: MeshSpec

    @property
    def data_shards(self) -> int:
        return self.block.global_batch // self.per_shard_batch


def step_layout(block: TransformerBlock, spec: MeshSpec, devices=None) -> StepLayout:
    """The mesh and batch on which to measure ``block`` as submitted on ``spec``, with the devices at hand.

    The tensor axis keeps its size (one ring, as tuned); each data axis is cut down, in order,
    to what the remaining devices hold; every data shard keeps the submitted per-shard batch
    (``global_batch / spec.batch_shards``), so the measured batch is that times the data shards
    measured.  The mesh uses the first devices, with Explicit axes in the order of ``spec``.

    Raises:
        ValueError: if the devices cannot hold one ring or the block does not shard as submitted.
    """
    import jax
    from jax.sharding import AxisType

    from collective_matmul.block import check_block

    devices = list(devices) if devices is not None else jax.devices()
    ring = spec.tensor_size
    if len(devices) < ring:
        raise ValueError(
            f"the tensor axis {spec.tensor_axis}={ring} needs {ring} devices for one ring but {len(devices)} "
            f"are present; use --devices virtual:{ring} (or processes:N with N dividing {ring})"
        )
    check_block(block, tensor_size=ring, batch_shards=spec.batch_shards)
    per_shard = block.global_batch // spec.batch_shards
    capacity = len(devices) // ring
    sizes: dict[str, int] = {}
    for name, size in spec.axes.items():
        if name == spec.tensor_axis:
            sizes[name] = ring
        else:
            sizes[name] = max(1, min(size, capacity))
            capacity //= sizes[name]
    data_axes = tuple(name for name in sizes if name != spec.tensor_axis)
    shards = math.prod(sizes[name] for name in data_axes)
    measured = block.model_copy(update={"global_batch": per_shard * shards})
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Explicit,) * len(sizes),
                         devices=devices[: ring * shards])
    return StepLayout(block=measured, mesh=mesh, axis=spec.tensor_axis, batch_axis=_one_or_many(data_axes),
                      per_shard_batch=per_shard, submitted=spec)


def _one_or_many(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


# ---- the session -------------------------------------------------------------------------


class _Recorder:
    """A `ConfigSource` that remembers what ``source`` gave each role."""

    def __init__(self, source):
        self.source = source
        self.used: dict[str, OpConfigs] = {}

    def configs(self, role, collective, x, w, *, mesh, axis, batch_axis=None):
        configs = self.source.configs(role, collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
        self.used[role] = configs
        return configs


class StepSession:
    """Parameters and inputs of one block on one mesh: measure variants of its training step.

    Works in one process or across a `jax.distributed` cluster (every process must make the
    same calls in the same order, with the same variants).

    Args:
        block: the shapes; ``global_batch`` is the batch measured.
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis (the ring).
        batch_axis: the mesh axis (or axes) sharding the batch; ``"auto"``: every other axis.
        protocol: warm-up, repeats (rounds), seed and timeout.
        lr: the SGD learning rate of the step.

    Raises:
        ValueError: if the block does not fit the mesh.
    """

    def __init__(self, block: TransformerBlock, mesh, *, axis: str = "model", batch_axis=AUTO,
                 protocol: Protocol = Protocol(), lr: float = 1e-3):
        import jax
        import jax.numpy as jnp

        from collective_matmul.block import activation_sharding, check_block, init_params

        if axis not in mesh.shape:
            raise ValueError(f"axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
        if batch_axis == AUTO:
            batch_axis = _one_or_many(tuple(name for name in mesh.axis_names if name != axis))
        self.block, self.mesh, self.axis, self.batch_axis = block, mesh, axis, batch_axis
        unknown = [name for name in self.batch_axes if name not in mesh.shape or name == axis]
        if unknown:
            raise ValueError(f"batch_axis {unknown} must name mesh axes {list(mesh.shape)} other than {axis!r}")
        check_block(block, tensor_size=mesh.shape[axis],
                    batch_shards=math.prod(mesh.shape[name] for name in self.batch_axes))
        self.protocol, self.lr = protocol, lr
        self.hardware = Hardware.detect(mesh.devices.flat)
        key_params, key_x, key_target = jax.random.split(jax.random.key(protocol.seed), 3)
        self.params = init_params(key_params, block, mesh, axis=axis)
        shape, dtype = (block.global_batch, block.seq_len, block.d_model), jnp.dtype(block.dtype)
        normal = jax.jit(lambda k: jax.random.normal(k, shape, dtype),
                         out_shardings=activation_sharding(mesh, axis=axis, batch_axis=batch_axis))
        self.x, self.target = normal(key_x), normal(key_target)
        # program (`_program`) -> (source, executable, record fields): a variant measured again (the
        # confirmation after a decision, the incumbent of every search round) is not compiled again
        self._compiled: dict[object, tuple[object, object, dict]] = {}

    @property
    def batch_axes(self) -> list[str]:
        if self.batch_axis is None:
            return []
        return [self.batch_axis] if isinstance(self.batch_axis, str) else list(self.batch_axis)

    def measure(self, variants: Mapping, *, reference: str = REFERENCE, protocol: Protocol | None = None,
                on_event: Callable[[str], None] | None = None) -> StepMeasurement:
        """Run the protocol for every variant; failures come back as variant statuses.

        Args:
            variants: name -> `ConfigSource` (or `AS_WRITTEN`), in the order to run them.
            reference: the variant every other one is checked and timed against.
            protocol: changes the warm-up, repeats and timeout (not the seed: the inputs are
                this session's).
            on_event: called with a line of progress (compiles, checks, timing).

        Raises:
            ValueError: if ``reference`` is not one of ``variants``.
        """
        if reference not in variants:
            raise ValueError(f"the reference variant {reference!r} is not among {list(variants)}")
        protocol = protocol or self.protocol
        say = on_event or (lambda _line: None)
        started = time.monotonic()
        order = [reference, *(name for name in variants if name != reference)]
        records: dict[str, dict] = {name: {"name": name} for name in order}
        steps = {name: step for name in order
                 if (step := self._compile(name, variants[name], records[name], say)) is not None}
        expected = check_lr = None
        if reference in steps:
            check_lr = self._check_lr(steps[reference], records[reference])
            expected = None if check_lr is None else self._run_check(steps[reference], check_lr, records[reference])
        for name in order:
            if name not in steps:
                continue
            if expected is None:
                records[name].setdefault("status", Status.ERROR)
                records[name].setdefault("message", f"not checked: the reference variant {reference!r} failed")
                del steps[name]
            elif name != reference:
                got = self._run_check(steps[name], check_lr, records[name])
                if got is None or not self._agrees(records[name], got, expected, reference):
                    del steps[name]
                del got
        say(f"checked {len(steps)} of {len(order)} variants against {reference!r}")
        del expected
        if steps:
            self._time(steps, records, reference, started, protocol, say)
        results = [StepVariant(**records[name]) for name in variants]
        return StepMeasurement(
            block=self.block, mesh={name: int(size) for name, size in self.mesh.shape.items()},
            tensor_axis=self.axis, batch_axes=self.batch_axes, hardware=self.hardware, protocol=protocol,
            reference=reference, variants=results,
        )

    def _scalar(self, value: float):
        """``value`` as a float32 scalar replicated over the mesh (an input every process agrees on)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.jit(lambda: jnp.float32(value), out_shardings=NamedSharding(self.mesh, PartitionSpec()))()

    def _compile(self, name: str, source, record: dict, say):
        """Compile one variant's `train_step` (``lr`` an argument) ahead of time; None if it fails.

        A variant this session compiled before from the same source object is reused, with the
        compile time and memory recorded then.
        """
        cached = self._compiled.get(_program(source))
        if cached is not None:
            record.update(cached[2])
            say(f"{name}: compiled before in {record['compile_s']:.1f}s")
            return cached[1]
        import jax

        from cmtune.workers.measure import classify_failure, compiled_memory, error_message
        from collective_matmul.block import AsWritten, train_step

        recorder = source if isinstance(source, AsWritten) else _Recorder(source)
        kwargs = dict(block=self.block, mesh=self.mesh, axis=self.axis, source=recorder, batch_axis=self.batch_axis)
        try:
            start = time.perf_counter()
            step = jax.jit(lambda params, x, target, lr: train_step(params, x, target, lr=lr, **kwargs))
            step = step.lower(self.params, self.x, self.target, self._scalar(self.lr)).compile()
            record["compile_s"] = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - any compile failure is a result
            oom = classify_failure(exc) == Status.OOM
            prefix = "invalid decomposition: " if isinstance(exc, ValueError) else ""
            record.update(status=Status.OOM if oom else Status.COMPILE_ERROR, message=prefix + error_message(exc),
                          configs=getattr(recorder, "used", {}))
            say(f"{name}: {record['status']}")
            return None
        record.update(memory_bytes=compiled_memory(step), configs=getattr(recorder, "used", {}))
        say(f"{name}: compiled in {record['compile_s']:.1f}s")
        if len(self._compiled) >= MAX_COMPILED:  # the oldest program goes first (a long search times many)
            self._compiled.pop(next(iter(self._compiled)))
        self._compiled[_program(source)] = (source, step, {key: record[key] for key in ("compile_s", "memory_bytes",
                                                                                        "configs")})
        return step

    def _check_lr(self, step, record: dict):
        """A learning rate whose update dwarfs every parameter, so ``p - new`` carries the gradient
        to the last bits (a power of two, from one step of the reference at lr=1); None if it fails."""
        import jax
        import jax.numpy as jnp

        from cmtune.workers.measure import classify_failure, error_message

        try:
            new, _ = step(self.params, self.x, self.target, self._scalar(1.0))
            norms = jax.jit(lambda p, n: jax.tree.map(
                lambda a, b: (jnp.linalg.norm(a.astype(jnp.float32)),
                              jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32))), p, n))(self.params, new)
            ratio = max(float(size) / max(float(change), 1e-30) for size, change in jax.tree.leaves(
                norms, is_leaf=lambda v: isinstance(v, tuple)))
        except Exception as exc:  # noqa: BLE001
            record.update(status=classify_failure(exc), message=error_message(exc))
            return None
        return self._scalar(2.0 ** math.ceil(math.log2(max(1e3 * ratio, 1.0))))

    def _run_check(self, step, lr, record: dict):
        """One step of a variant at the check learning rate: ``(new_params, loss)``, or None if it fails."""
        import jax

        from cmtune.workers.measure import classify_failure, error_message

        try:
            new, loss = jax.block_until_ready(step(self.params, self.x, self.target, lr))
        except Exception as exc:  # noqa: BLE001
            record.update(status=classify_failure(exc), message=error_message(exc))
            return None
        record["loss"] = float(loss)
        return new, loss

    def _agrees(self, record: dict, got, expected, reference: str) -> bool:
        """Compare a variant's loss and gradients with the reference's; mark it ``invalid`` if they differ.

        The gradient of a parameter is ``(p - new) / lr`` at the check learning rate, so the
        relative error of the gradients is ``|new - new_ref| / |p - new_ref|``.
        """
        from cmtune.workers.measure import TOLERANCE, relative_error

        (new, loss), (want_new, want_loss) = got, expected
        errors = {"loss": relative_error(loss, want_loss)}
        for name in sorted(want_new):
            diff, size = (float(v) for v in _update_error()(self.params[name], new[name], want_new[name]))
            errors[f"d{name}"] = diff / size if size else diff
        worst = max(errors, key=lambda k: errors[k] if math.isfinite(errors[k]) else math.inf)
        record["rel_error"] = errors[worst] if math.isfinite(errors[worst]) else None
        tolerance = TOLERANCE[self.block.dtype]
        if not math.isfinite(errors[worst]) or errors[worst] > tolerance:
            record.update(status=Status.INVALID, message=f"{worst}: relative error {errors[worst]:.3g} against "
                                                         f"{reference!r} exceeds {tolerance:g}")
            return False
        return True

    def _time(self, steps: dict, records: dict, reference: str, started: float, protocol: Protocol, say) -> None:
        """Warm up, then run ``steps`` once a round, each round in its own order, on this session's inputs
        (`interleave`)."""
        inputs = (self.params, self.x, self.target, self._scalar(self.lr))
        interleave({name: (lambda step=step: step(*inputs)) for name, step in steps.items()}, records, reference,
                   started, protocol, say)


MAX_COMPILED = 32  # compiled step programs a session keeps


def _program(source) -> object:
    """What identifies the program a config source compiles to: the configs of a `FixedConfigs` (equal
    configs, one program), else the source object itself."""
    per_role = getattr(source, "per_role", None)
    if per_role is not None and hasattr(source, "default"):
        return "fixed", tuple(sorted(per_role.items())), source.default
    return "source", id(source)  # the cache keeps the source alive, so its id is not reused


def interleave(runs: Mapping[str, Callable[[], object]], records: dict[str, dict], reference: str, started: float,
               protocol: Protocol, say: Callable[[str], None]) -> None:
    """Warm up, then call each of ``runs`` once a round, each round in its own order (one synchronised step per
    call); fill in the records.

    Each call is timed from a barrier (with several processes) to `block_until_ready` of what it
    returns; the slowest process's time counts.  A run that raises leaves the rotation with its
    failure as its status.  Every process must call this together, with the same runs.  Each
    record gets ``status``, ``timing``, and ``ratio`` / ``ratio_iqr``: its time over the
    ``reference``'s, paired by round.  The order of round ``r`` is `round_order`: what runs just
    before a step (another program's buffers, a collective still draining) and its place in the
    round move from round to round, so they are spread over every variant instead of always
    favouring the same one.
    """
    import jax

    from cmtune.workers.measure import any_process, barrier, classify_failure, error_message, slowest_process

    running = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in running}

    def run(name: str, timed: bool) -> None:
        try:
            if timed:
                barrier()
            start = time.perf_counter()
            jax.block_until_ready(runs[name]())
            if timed:
                samples[name].append(time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - a failing variant leaves the rotation
            records[name].update(status=classify_failure(exc), message=error_message(exc))
            running.remove(name)

    say(f"warming up {len(running)} variants ({protocol.warmup} runs each)")
    for _ in range(protocol.warmup):
        for name in list(running):
            run(name, timed=False)
    say(f"timing {len(running)} variants, {protocol.repeats} rounds, each in its own order")
    rounds = 0
    timed_out = False
    for number in range(protocol.repeats):
        for name in round_order(list(running), protocol.seed, number):
            run(name, timed=True)
        rounds += 1
        # every process must agree to stop, or the SPMD programs would diverge
        if rounds < protocol.repeats and any_process(time.monotonic() - started > protocol.timeout_s):
            timed_out = True
            break
    slowest = {name: slowest_process(samples[name]) for name in runs}
    base = slowest[reference]
    reference_failed = "status" in records[reference]
    for name in runs:
        record = records[name]
        if "status" in record:  # failed while timing
            continue
        times = slowest[name]
        if reference_failed:  # nothing to compare against: a ratio would be made up
            record.update(status=Status.ERROR, message=f"not compared: the reference {reference} failed",
                          timing=Timing.of(times) if times else None)
            continue
        ratios = [t / b for t, b in zip(times, base, strict=True)]
        q1, ratio, q3 = quartiles(ratios) if ratios else (None, None, None)
        record.update(
            status=Status.TIMEOUT if timed_out else Status.OK,
            message=f"stopped after {rounds} of {protocol.repeats} rounds: over {protocol.timeout_s:g}s"
            if timed_out else "",
            timing=Timing.of(times) if times else None, ratio=ratio,
            ratio_iqr=None if ratio is None else q3 - q1,
        )


def round_order(names: list[str], seed: int, number: int) -> list[str]:
    """``names`` in round ``number``'s order: a shuffle seeded by ``seed`` and ``number`` alone (the same on every
    process of a group, SPMD)."""
    order = list(names)
    random.Random(f"{seed}:{number}").shuffle(order)
    return order


@cache
def _update_error():
    """Jitted ``(|a - b|, |p - b|)`` in float32: the error of an update ``a`` against ``b`` from ``p``."""
    import jax
    import jax.numpy as jnp

    def terms(p, a, b):
        p, a, b = (v.astype(jnp.float32) for v in (p, a, b))
        return jnp.linalg.norm(a - b), jnp.linalg.norm(p - b)

    return jax.jit(terms)
