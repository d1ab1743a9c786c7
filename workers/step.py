"""The step measurement: the whole training step of one block, tuned configs against the block as written.

What users buy cmtune for is a faster step, so each *variant* of the step (a `ConfigSource` for
the block's four op calls, or `AS_WRITTEN`, the block as a user writes it without cmtune: GSPMD
einsums and JAX's autodiff) is timed whole:
``value_and_grad`` of the block's loss and the SGD update, jitted.  The protocol is
`cmtune.workers.stepmeasure`'s (compiled ahead of time, checked against the reference, timed in
interleaved rounds, failures as statuses); what is the block's own:

1. Parameters from `init_params` and inputs (x, target) from a seeded normal distribution, laid
   out as the block expects (seq over the tensor axis, batch over the data axes).
2. Each variant's `train_step` is compiled with the learning rate an argument.
3. The very program that is timed is checked: one step at a learning rate large enough that
   the update dwarfs every parameter (found from one step of the reference), so ``p - new``
   carries ``lr * grad`` to the last bits.  Every variant's loss and gradients are compared
   with the reference variant's (the block as written) by dtype (relative error in norm: float32
   <= 1e-5, bfloat16 <= 2e-2).
4. Every timed run starts from the same parameters and inputs (the update is not fed back).

`standard_variants` builds the usual set (as-written, baseline, tuned, two whole-step
alternatives and a per-role ablation) and `step_layout` the mesh and batch to measure a submission on;
`block_session` makes the session, `BlockVerify` is the block's part of `cmtune verify`
(`cmtune.workers.verify.verify_step`).  The result types (`StepVariant`, `StepMeasurement`) are part of the
wire contract (`collective_matmul.wire`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from cmtune.tuner.variants import REFERENCE, variant_configs
from cmtune.workers.overrides import SearchBudget, StepPlan
from cmtune.workers.progress import Event, ProgressLine, RolesResolved
from cmtune.workers.stepmeasure import Agreement, Check, StepKind, StepSession
from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.planning.models import MeshSpec, TransformerBlock
from collective_matmul.planning.problem import Hardware
from collective_matmul.wire import (
    BlockConfigs,
    ChosenVariant,
    MeasurementProtocol,
    Status,
    StepMeasurement,
    StepVariant,
)

if TYPE_CHECKING:
    from jax.sharding import Mesh

AUTO = "auto"

# ---- the variants ------------------------------------------------------------------------


def standard_variants(configs: Mapping[str, OpConfigs], *, ablation: bool = True) -> dict:
    """`variant_configs` of the per-role ``configs`` as config sources for `StepSession.measure` (`AS_WRITTEN` or
    `FixedConfigs`)."""
    from collective_matmul.block import AS_WRITTEN, FixedConfigs

    return {name: AS_WRITTEN if setting is None else FixedConfigs(setting)
            for name, setting in variant_configs(configs, ablation=ablation).items()}


# ---- a step trial, as a worker or the local runner runs it -------------------------------


def run_step(task, session: StepSession | None = None) -> StepMeasurement:
    """A step trial, as a worker runs it: the submitted block on one ring of its mesh.

    ``task`` is a `collective_matmul.wire.TrialTask` of kind ``step``: a round of the step search
    times exactly the variants it names; a task without them times the standard menu of its
    configs, then grades the tuner's choice (`step_decision`) in fresh rounds (`grade_choice`).  ``session``:
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
    return grade_choice(session, measured, variants, step.configs)


def step_session(task) -> StepSession:
    """The session a step trial runs in: the submitted block on one ring of its mesh, with the trial's seed."""
    step = task.step
    layout = step_layout(step.block, MeshSpec(axes=step.mesh, tensor_axis=step.tensor_axis))
    return block_session(layout.block, layout.mesh, axis=layout.axis, batch_axis=layout.batch_axis,
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
    from collective_matmul.planning.text import as_message

    step, message = task.step, as_message(message, 2000)  # an error's text may hold anything
    return StepMeasurement(block=step.block, mesh=step.mesh, tensor_axis=step.tensor_axis, hardware=Hardware.detect(),
                           protocol=task.protocol, variants=[StepVariant(name=name, status=status, message=message)
                                                             for name in (REFERENCE, "tuned")])


def grade_choice(session: StepSession, measured: StepMeasurement, variants: Mapping,
                 configs: Mapping[str, OpConfigs]) -> StepMeasurement:
    """``measured`` with a confirmation: the reference, the all-baseline step and the variant that the tuner
    chooses (`step_decision`, from ``measured`` and the tuned ``configs``), timed again in fresh interleaved rounds,
    so that the speedup reported is not read from the rounds that picked the winner (those favour it).

    Process 0 asks the tuner and the others follow (`Group`), so every process compiles the same
    programs.  Nothing is re-timed when the tuner chose nothing.
    """
    from cmtune.tuner.decision import step_decision
    from cmtune.workers.cluster import Group

    group, message = Group(), None
    if group.leader:
        decision = step_decision(measured, configs)
        message = ChosenVariant(variant=decision.variant if decision.ok else None)
    chosen = group.share(message, ChosenVariant).variant
    if chosen is None:
        return measured
    names = dict.fromkeys([measured.reference, "baseline", chosen])
    again = session.measure({name: variants[name] for name in names if name in variants},
                            reference=measured.reference)
    return measured.model_copy(update={"confirmation": again.variants})


# ---- `cmtune verify --model` ----------------------------------------------------------------


class BlockVerify:
    """The reference block's part of `cmtune verify --model` (a `cmtune.workers.verify.VerifyTarget`): ``block``'s
    step as submitted on ``spec``, on ``layout`` (its first ring here: `step_layout`), with the configs of
    ``bundle`` or ``server`` (process 0 looks them up) against the block as written (`standard_variants`); searched,
    from those configs with the bundle's entries as the runners-up (`block_plan`)."""

    found = BlockConfigs

    def __init__(self, block: TransformerBlock, spec: MeshSpec, layout: StepLayout, *, bundle: Path | None,
                 server: str | None, token: str | None, protocol: MeasurementProtocol, ablation: bool):
        self.block, self.spec, self.layout, self.bundle = block, spec, layout, bundle
        self.server, self.token, self.protocol, self.ablation = server, token, protocol, ablation

    def start(self, leader: bool) -> None:
        """Nothing: the session is made once the configs are known."""

    def look_up(self) -> BlockConfigs:
        """Each role's configs from a `Tuned` client, and how each slot was resolved."""
        from collective_matmul.block import configs_per_role
        from collective_matmul.client.tuned import Tuned
        from collective_matmul.wire import Resolved

        layout = self.layout
        tuned = Tuned(self.server, token=self.token, bundle=self.bundle, model=self.block.name)
        configs = configs_per_role(tuned, layout.block, mesh=layout.mesh, axis=layout.axis,
                                   batch_axis=layout.batch_axis)
        resolved = {role: {slot: Resolved(problem=problem.key, decomposition=answer.decomposition.id,
                                          match=answer.match, source=answer.origin)
                           for slot, (problem, answer) in slots.items()}
                    for role, slots in tuned.resolved_by_role.items()}
        return BlockConfigs(configs=configs, resolved=resolved)

    def shown(self, found: BlockConfigs) -> list[Event]:
        """What is measured where, and each role's resolved configs."""
        import jax

        layout, block = self.layout, self.block
        mesh_text = ",".join(f"{name}={size}" for name, size in layout.mesh.shape.items())
        submitted = ",".join(f"{name}={size}" for name, size in self.spec.axes.items())
        return [ProgressLine(f"measuring {block.name} on {mesh_text} (submitted {submitted}): batch "
                             f"{layout.block.global_batch} ({layout.per_shard_batch} per data shard), seq "
                             f"{block.seq_len}, {block.dtype}, {jax.process_count()} process(es)"),
                RolesResolved(found.resolved)]

    def follow(self, found: BlockConfigs, leader: bool) -> StepSession:
        layout = self.layout
        return block_session(layout.block, layout.mesh, axis=layout.axis, batch_axis=layout.batch_axis,
                             protocol=self.protocol)

    def variants(self, found: BlockConfigs) -> dict:
        return standard_variants(found.configs, ablation=self.ablation)

    def announce(self, found: BlockConfigs, variants: Mapping | None,
                 budget: SearchBudget | None) -> list[ProgressLine]:
        return []

    def plan(self, found: BlockConfigs) -> StepPlan:
        return block_plan(self.block, self.spec, self.layout, found.configs, self.bundle, ablation=self.ablation)

    def sources(self, found: BlockConfigs) -> Callable[[Mapping], dict]:
        return fixed_sources

    def measure_options(self, found: BlockConfigs) -> dict:
        return {}


def block_plan(block, spec, layout, configs: dict[str, OpConfigs], bundle: Path, *, ablation: bool) -> StepPlan:
    """The reference block as submitted on ``spec`` (measured on ``layout``), searched from its tuned ``configs``
    with the bundle's entries for its problems (any hardware) as the runners-up."""
    from collective_matmul.client.tuned import ring_hardware
    from collective_matmul.planning.models import role_problems
    from collective_matmul.wire.bundle import Bundle

    problems = role_problems(block, spec)
    return StepPlan(model=block.name, hardware=ring_hardware(layout.mesh, layout.axis).identity(), configs=configs,
                    problems=problems, history=Bundle.load(bundle).configs, ablation=ablation,
                    bound_problems=[p for slots in problems.values() for p in slots.values()])


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

    def configs(self, role, collective, x, w, *, mesh, axis, batch_axis=None, tensor_axis=None, site: str = "",
                via: str = "op"):
        configs = self.source.configs(role, collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis,
                                      tensor_axis=tensor_axis, site=site, via=via)
        self.used[role] = configs
        return configs

    def fell_back(self, role: str, reason: str, *, site: str = "") -> None:
        self.source.fell_back(role, reason, site=site)


def block_session(block: TransformerBlock, mesh, *, axis: str = "model", batch_axis=AUTO,
                  protocol: MeasurementProtocol = MeasurementProtocol(), lr: float = 1e-3) -> StepSession:
    """The session of one block on one mesh: a `cmtune.workers.stepmeasure.StepSession` of its `BlockStep`,
    measuring variants of its training step (``measure``: name -> `ConfigSource` or `AS_WRITTEN`).

    Args:
        block: the shapes; ``global_batch`` is the batch measured.
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis (the ring).
        batch_axis: the mesh axis (or axes) sharding the batch; ``"auto"``: every other axis.
        protocol: warm-up, repeats (rounds), seed (of the parameters and inputs) and timeout.
        lr: the SGD learning rate of the step.

    Raises:
        ValueError: if the block does not fit the mesh.
    """
    return StepSession(BlockStep(block, mesh, axis=axis, batch_axis=batch_axis, seed=protocol.seed, lr=lr),
                       protocol=protocol)


class BlockStep(StepKind):
    """The reference block's step (`StepKind`): its parameters and inputs on one mesh, a config source per variant,
    checked by its loss and each parameter's gradient (`check_run`)."""

    not_checked = "not checked: the reference variant {reference!r} failed"

    def __init__(self, block: TransformerBlock, mesh, *, axis: str = "model", batch_axis=AUTO, seed: int = 0,
                 lr: float = 1e-3):
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
        self.lr = lr
        key_params, key_x, key_target = jax.random.split(jax.random.key(seed), 3)
        self.params = init_params(key_params, block, mesh, axis=axis)
        shape, dtype = (block.global_batch, block.seq_len, block.d_model), jnp.dtype(block.dtype)
        normal = jax.jit(lambda k: jax.random.normal(k, shape, dtype),
                         out_shardings=activation_sharding(mesh, axis=axis, batch_axis=batch_axis))
        self.x, self.target = normal(key_x), normal(key_target)

    @property
    def batch_axes(self) -> list[str]:
        if self.batch_axis is None:
            return []
        return [self.batch_axis] if isinstance(self.batch_axis, str) else list(self.batch_axis)

    def record_fields(self) -> dict:
        """The block, its tensor axis and its batch axes."""
        return dict(block=self.block, tensor_axis=self.axis, batch_axes=self.batch_axes)

    @cached_property
    def _inputs(self) -> tuple:
        """The step's arguments: the parameters, the inputs and the learning rate."""
        return self.params, self.x, self.target, self._scalar(self.lr)

    def _scalar(self, value: float):
        """``value`` as a float32 scalar replicated over the mesh (an input every process agrees on)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.jit(lambda: jnp.float32(value), out_shardings=NamedSharding(self.mesh, PartitionSpec()))()

    def program_key(self, source) -> Hashable:
        """A `FixedConfigs` by its configs (equal configs, one program), any other source by itself."""
        from collective_matmul.block import FixedConfigs

        if isinstance(source, FixedConfigs):
            return "fixed", tuple(sorted(source.per_role.items())), source.default
        return super().program_key(source)

    def tracer(self, source):
        """``source`` behind a `_Recorder` (the block as written uses none)."""
        from collective_matmul.block import AsWritten

        return source if isinstance(source, AsWritten) else _Recorder(source)

    def lowering(self, tracer) -> Callable[[], object]:
        """The variant's `train_step`, jitted with the learning rate an argument."""
        import jax

        from collective_matmul.block import train_step

        kwargs = dict(block=self.block, mesh=self.mesh, axis=self.axis, source=tracer, batch_axis=self.batch_axis)
        step = jax.jit(lambda params, x, target, lr: train_step(params, x, target, lr=lr, **kwargs))
        return lambda: step.lower(*self._inputs)

    def used(self, tracer) -> dict[str, OpConfigs]:
        return getattr(tracer, "used", {})

    def compile_failure(self, exc: Exception) -> str:
        """A `ValueError` (the ops' check of a config) is an invalid decomposition."""
        prefix = "invalid decomposition: " if isinstance(exc, ValueError) else ""
        return prefix + super().compile_failure(exc)

    def check_run(self, step, expected: Check | None) -> Check:
        """One step at the check learning rate (the reference's: `_check_lr`): ``(new_params, loss, lr)``."""
        import jax

        lr = self._check_lr(step) if expected is None else expected.value[2]
        new, loss = jax.block_until_ready(step(self.params, self.x, self.target, lr))
        return Check((new, loss, lr), loss=float(loss))

    def _check_lr(self, step):
        """A learning rate whose update dwarfs every parameter, so ``p - new`` carries the gradient
        to the last bits (a power of two, from one step of the reference at lr=1)."""
        from cmtune.workers.compare import tree_terms

        new, _ = step(self.params, self.x, self.target, self._scalar(1.0))
        ratio = max(t.size / max(t.diff, 1e-30) for t in tree_terms(new, self.params))
        return self._scalar(2.0 ** math.ceil(math.log2(max(1e3 * ratio, 1.0))))

    def agrees(self, got: Check, expected: Check, reference: str) -> Agreement:
        """Compare a variant's loss and gradients with the reference's; ``invalid`` if they differ.

        The gradient of a parameter is ``(p - new) / lr`` at the check learning rate, so the
        relative error of the gradients is ``|new - new_ref| / |p - new_ref|``.
        """
        from cmtune.workers.compare import relative_error
        from cmtune.workers.measure import TOLERANCE

        (new, loss, _), (want_new, want_loss, _) = got.value, expected.value
        errors = {"loss": relative_error(loss, want_loss)}
        for name in sorted(want_new):
            errors[f"d{name}"] = relative_error(new[name], want_new[name], base=self.params[name])
        worst = max(errors, key=lambda k: errors[k] if math.isfinite(errors[k]) else math.inf)
        rel_error = errors[worst] if math.isfinite(errors[worst]) else None
        tolerance = TOLERANCE[self.block.dtype]
        if not math.isfinite(errors[worst]) or errors[worst] > tolerance:
            return Agreement(rel_error, invalid=f"{worst}: relative error {errors[worst]:.3g} against {reference!r} "
                                                f"exceeds {tolerance:g}")
        return Agreement(rel_error)

    def timed_run(self, step, got: Check) -> Callable[[], object]:
        """One step on this session's inputs (the same every run: the update is not fed back)."""
        inputs = self._inputs
        return lambda: step(*inputs)

