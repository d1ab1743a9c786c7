"""Discovery: the collective matmuls of a user's own training step, read from its partitioned module.

`discover` lowers and compiles the step for its mesh without running it (abstract arguments
will do), takes the module as XLA's SPMD partitioner left it, and `scan` finds in it:

- an all-gather feeding a dot on one of the activation's row dimensions, the weight being the
  dot's other operand: an ``allgather_matmul`` (column-parallel projection);
- a dot whose product is reduce-scattered on its rows, or all-reduced and then dynamically sliced
  (what the partitioner emits before a later pass fuses them): a ``matmul_reduce_scatter``
  (row-parallel projection);
- in the backward, the dots of the same role: its input gradient (a dot with the forward's weight
  as an operand) and its weight gradient (a dot of two activations, contracting the rows, whose
  result has the weight's shape).  Their problems come from the one rule of
  `collective_matmul.models.slot_problems`, applied to the forward call.

Each problem gets its slot, its role (`collective_matmul.roles`) and how often it runs per step
(a ``scan`` over layers counts its trip count; remat's recomputation is not counted again).
Gathers that feed no activation × weight product (attention's K/V, FSDP weight gathers) and
all-reduces that are not scattered are listed as skipped, with the reason.  The asynchronous
``all-gather-start`` / ``-done`` pairs of accelerator backends are read too.

Global sizes follow the sequence-parallel layout the ops use (`collective_matmul.ops`): m is the
rows one ring sees (the batch of one data shard times the sequence), k and n the full matmul.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from collective_matmul.hlo import Instruction, Module, parse_module
from collective_matmul.models import COLUMN, ROW, SLOTS, Role, rings, slot_problems
from collective_matmul.roles import label, source_of
from collective_matmul.wire import StepProblem

# Ops a value passes through unchanged on its way between a collective and a dot.
_THROUGH = ("copy", "convert", "bitcast", "reshape", "transpose")


class SkippedCollective(BaseModel):
    """A collective next to a dot that is not a collective matmul cmtune decomposes, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    what: str = Field(max_length=400)
    reason: str = Field(max_length=1000)
    count: int = Field(ge=1)


class Discovery(BaseModel):
    """What `discover` found in one step."""

    model_config = ConfigDict(extra="forbid")

    problems: list[StepProblem] = Field(default_factory=list)
    skipped: list[SkippedCollective] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    mesh: dict[str, int] = Field(default_factory=dict)


# ---- the scan (module text in, problems out: no JAX) ---------------------------------------


@dataclass
class _Gathered:
    collective: Instruction
    dim: int  # the gathered dimension, in the dot operand's coordinates
    ring: int


@dataclass
class _Scattered:
    collective: Instruction
    kind: str  # reduce-scatter | all-reduce+dynamic-slice | all-reduce
    dim: int | None  # the scattered dimension of the dot's output
    ring: int


@dataclass
class _Tally:
    problems: dict[tuple, list] = field(default_factory=dict)  # (role, key) -> [slot problems, count, axis, source]
    skipped: dict[tuple, int] = field(default_factory=dict)
    backward: dict[str, set[str]] = field(default_factory=dict)  # role -> slots its backward computes
    weights: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)  # role -> forward weight shapes


def scan(module: Module | str, mesh: Mapping[str, int] | None = None) -> Discovery:
    """The collective matmuls of a partitioned module (see the module docstring).

    Args:
        module: a parsed `Module` or HLO text (after SPMD partitioning, or an optimized module).
        mesh: the mesh's axis sizes in order, to name each ring's axis (partition ids run over
            the mesh's devices in order).
    """
    if isinstance(module, str):
        module = parse_module(module)
    axes = _axis_groups(mesh) if mesh else {}
    tally = _Tally()
    dots = [(dot, times) for name, (times, _exact) in module.executions.items() if times > 0
            for dot in module.computations[name].instructions.values()
            if dot.opcode == "dot" and "rematted_computation" not in dot.op_name]  # remat's recompute: counted once
    for backward in (False, True):  # the forward first: a weight gradient is known by its weight's shape
        for dot, times in dots:
            if ("transpose(" in dot.op_name) == backward:
                _classify(module, dot, times, axes, tally, backward=backward)
    problems, warnings = [], []
    shapes_per_role: dict[str, set[str]] = {}
    for (role, key), (slots, count, axis, source) in tally.problems.items():
        shapes_per_role.setdefault(role, set()).add(key)
        for slot in SLOTS:
            if slot == "forward" or slot in tally.backward.get(role, ()):
                problems.append(StepProblem(role=role, slot=slot, problem=slots[slot], count=count, axis=axis,
                                            source=source))
    for role, keys in shapes_per_role.items():
        if len(keys) > 1:
            warnings.append(f"role {role!r} runs {len(keys)} different problems ({', '.join(sorted(keys))}): give each "
                            "projection its own jax.named_scope (or Flax module) so that each is decided on its own")
    skipped = [SkippedCollective(role=role, what=what, reason=reason, count=count)
               for (role, what, reason), count in tally.skipped.items()]
    return Discovery(problems=problems, skipped=skipped, warnings=warnings, mesh=dict(mesh or {}))


def _classify(module: Module, dot: Instruction, times: int, axes: dict, tally: _Tally, *, backward: bool) -> None:
    """Tally one dot: a forward collective matmul, a skipped collective, or backward evidence."""
    comp = module.computations[dot.computation]
    frames = [(f.file, f.line) for f in module.stack(dot.stack_frame_id)]
    role = label(dot.op_name.rpartition("/")[0], frames)  # the op_name without its primitive
    source = source_of(frames)
    lhs_c, rhs_c = dot.ints("lhs_contracting_dims"), dot.ints("rhs_contracting_dims")
    lhs_b = dot.ints("lhs_batch_dims")
    if len(dot.operands) != 2:
        return
    lhs, rhs = (comp.instructions.get(o) for o in dot.operands)
    if lhs is None or rhs is None:
        return
    if backward:  # which gradients this role's calls compute
        weights = tally.weights.get(role, ())
        if any(operand.shape.dims in weights for operand in (lhs, rhs)):
            tally.backward.setdefault(role, set()).add("grad_input")  # dy times the weight
        elif any(sorted(dot.shape.dims) == sorted(w) for w in weights):
            tally.backward.setdefault(role, set()).add("grad_weight")  # activations contracted to its shape
        return
    gathered_lhs, gathered_rhs = _gathered(module, comp, lhs), _gathered(module, comp, rhs)
    scattered = _scattered(module, comp, dot)

    def skip(what: str, reason: str) -> None:
        key = (role, what, reason)
        tally.skipped[key] = tally.skipped.get(key, 0) + times

    def axis_of(inst: Instruction) -> str | None:
        groups = inst.replica_groups(module.num_partitions)
        if groups is None:
            return None
        wanted = {frozenset(g) for g in groups}
        return next((name for name, g in axes.items() if g == wanted), None)

    if lhs_b and (gathered_lhs or gathered_rhs):
        collective = (gathered_lhs or gathered_rhs).collective
        skip(f"{collective.opcode} {collective.name} -> {dot.name}",
             "a product with batch dimensions (attention-like: both operands are activations), not an "
             "activation x weight projection")
        return
    if lhs_b:
        return
    tally.weights.setdefault(role, []).append(rhs.shape.dims)
    dtype = lhs.shape.dtype_name
    if gathered_lhs and gathered_rhs:
        skip(f"{gathered_lhs.collective.opcode} {gathered_lhs.collective.name}, {gathered_rhs.collective.opcode} "
             f"{gathered_rhs.collective.name} -> {dot.name}",
             "both operands are gathered (the weight too: FSDP with sequence parallelism): not the layout of "
             "cmtune's ops, whose weight stays sharded")
        return
    if gathered_rhs:
        where = "contracting" if gathered_rhs.dim in rhs_c else "output"
        skip(f"{gathered_rhs.collective.opcode} {gathered_rhs.collective.name} -> {dot.name}",
             f"XLA gathers the weight (on its {where} dimension) over a ring of {gathered_rhs.ring}: FSDP, or a "
             "weight smaller than the activation; the activation stays sharded, so there is no activation "
             "all-gather to overlap (shard the activation on its rows and the weight on its output columns)")
        return
    lhs_rows = [d for d in range(len(lhs.shape.dims)) if d not in lhs_c]
    rhs_cols = [d for d in range(len(rhs.shape.dims)) if d not in rhs_c]
    k_local = math.prod(lhs.shape.dims[d] for d in lhs_c)
    m_local = math.prod(lhs.shape.dims[d] for d in lhs_rows)
    n_local = math.prod(rhs.shape.dims[d] for d in rhs_cols)
    if gathered_lhs:
        what = f"{gathered_lhs.collective.opcode} {gathered_lhs.collective.name} -> {dot.name}"
        if gathered_lhs.dim in lhs_c:
            skip(what, "gathers the activation's contracting dimension (the activation is sharded on its features), "
                       "not its rows")
            return
        collective, ring, axis = COLUMN, gathered_lhs.ring, axis_of(gathered_lhs.collective)
        m, k, n = m_local, k_local, n_local * ring
    elif scattered is not None:
        what = f"{dot.name} -> {scattered.collective.opcode} {scattered.collective.name}"
        if scattered.kind == "all-reduce":
            if scattered.ring > 1:
                skip(what, "the product is all-reduced, not scattered: tensor parallelism without sequence "
                           "parallelism (the result is wanted whole on every device of the ring)")
            return
        if scattered.dim is None or scattered.dim >= len(lhs_rows):
            skip(what, "the product is scattered on the weight's output dimension, not on its rows")
            return
        collective, ring, axis = ROW, scattered.ring, axis_of(scattered.collective)
        m, k, n = m_local, k_local * ring, n_local
    else:
        return
    if ring < 2:
        return
    if dtype is None or rhs.shape.dtype != lhs.shape.dtype:
        skip(what, f"operands of types {lhs.shape.dtype} and {rhs.shape.dtype}: cmtune's ops take one dtype of "
                   "float32, bfloat16 or float16")
        return
    try:
        slots = slot_problems(collective, m=m, k=k, n=n, dtype=dtype, axis_size=ring)
    except ValueError as exc:
        skip(what, str(exc))
        return
    key = (role, slots["forward"].key)
    if key in tally.problems:
        tally.problems[key][1] += times
    else:
        tally.problems[key] = [slots, times, axis, source]


def _gathered(module: Module, comp, inst: Instruction) -> _Gathered | None:
    """The all-gather that ``inst`` (a dot operand) is, through ops that keep its values."""
    chain = []
    for _ in range(16):
        if inst.opcode in ("all-gather", "all-gather-done", "all-gather-start"):
            start = inst
            if inst.opcode == "all-gather-done":
                start = comp.instructions.get(inst.operands[0]) if inst.operands else None
                if start is None:
                    return None
            dims = start.ints("dimensions")
            out = inst.shape if inst.opcode != "all-gather-start" else _last_element(inst.shape)
            source = comp.instructions.get(start.operands[0]) if start.operands else None
            if len(dims) != 1 or source is None or not out.dims:
                return None
            dim = dims[0]
            ring = out.dims[dim] // max(source.shape.dims[dim], 1) if len(source.shape.dims) > dim else 0
            for step in reversed(chain):  # map the gathered dimension forward to the dot operand
                dim = _forward_dim(step, dim)
                if dim is None:
                    return None
            return _Gathered(start, dim, ring)  # the start holds the replica groups
        if inst.opcode == "get-tuple-element":
            source = comp.instructions.get(inst.operands[0]) if inst.operands else None
            if source is not None and source.opcode == "all-gather-start":
                inst = source
                continue
            return None
        if inst.opcode not in _THROUGH or not inst.operands:
            return None
        nxt = comp.instructions.get(inst.operands[0])
        if nxt is None or (inst.opcode in ("reshape", "bitcast") and nxt.shape.dims != inst.shape.dims):
            return None  # a reshape that moves dimensions: the gathered one cannot be followed
        chain.append(inst)
        inst = nxt
    return None


def _forward_dim(through: Instruction, dim: int) -> int | None:
    """Where dimension ``dim`` of ``through``'s operand lands in its result (None: it does not survive)."""
    if through.opcode == "transpose":
        perm = list(through.ints("dimensions"))
        return perm.index(dim) if dim in perm else None
    return dim  # copy, convert, a reshape that keeps the shape


def _scattered(module: Module, comp, dot: Instruction) -> _Scattered | None:
    """The reduce-scatter (or all-reduce, and the slice after it) that ``dot``'s product goes through."""
    frontier, seen = [dot], set()
    while frontier:
        inst = frontier.pop()
        if inst.name in seen:
            continue
        seen.add(inst.name)
        for user in comp.users.get(inst.name, ()):
            if user.opcode == "reduce-scatter":
                dims = user.ints("dimensions")
                ring = _ratio(user, dims[0], inst) if len(dims) == 1 else 0
                return _Scattered(user, "reduce-scatter", dims[0] if dims else None, ring)
            if user.opcode in ("all-reduce", "all-reduce-start"):
                reduced = user
                groups = user.replica_groups(module.num_partitions)
                ring = len(groups[0]) if groups else 0
                index = list(user.operands).index(inst.name)
                for sliced in _slices(comp, reduced, index):
                    dims = [d for d, (a, b) in enumerate(zip(inst.shape.dims, sliced.shape.dims, strict=False))
                            if a != b]
                    if len(dims) == 1 and inst.shape.dims[dims[0]] == sliced.shape.dims[dims[0]] * ring:
                        return _Scattered(user, "all-reduce+dynamic-slice", dims[0], ring)
                return _Scattered(user, "all-reduce", None, ring)
            if user.opcode in ("copy", "convert") and user.shape.dims == inst.shape.dims:
                frontier.append(user)
    return None


def _slices(comp, reduced: Instruction, index: int) -> list[Instruction]:
    """The dynamic slices of an all-reduce's ``index``-th result (through its done and tuple elements)."""
    found, frontier = [], [(reduced, False)]
    tupled = reduced.shape.is_tuple
    while frontier:
        inst, picked = frontier.pop()
        for user in comp.users.get(inst.name, ()):
            if user.opcode == "all-reduce-done":
                frontier.append((user, picked))
            elif user.opcode == "get-tuple-element" and tupled and not picked:
                if user.attribute("index") == str(index):
                    frontier.append((user, True))
            elif user.opcode in ("copy", "convert", "bitcast") and (picked or not tupled):
                frontier.append((user, picked))
            elif user.opcode == "dynamic-slice" and (picked or not tupled):
                found.append(user)
    return found


def _ratio(scatter: Instruction, dim: int, source: Instruction) -> int:
    if len(source.shape.dims) <= dim or not scatter.shape.dims:
        return 0
    return source.shape.dims[dim] // max(scatter.shape.dims[dim], 1)


def _last_element(shape):
    return shape.elements[-1] if shape.is_tuple and shape.elements else shape


def _axis_groups(mesh: Mapping[str, int]) -> dict[str, set[frozenset[int]]]:
    """For each mesh axis, the groups of partition ids that run along it."""
    grid = np.arange(math.prod(mesh.values())).reshape(list(mesh.values()))
    return {name: {frozenset(int(v) for v in row) for row in rings(grid, i)} for i, name in enumerate(mesh)}


# ---- lowering a step (JAX) ------------------------------------------------------------------


def partitioned_module(step, args: Sequence, *, kwargs: Mapping | None = None) -> tuple[str, str | None]:
    """The text of ``step``'s module after SPMD partitioning, compiled for ``args`` (never run), and a
    note when only the optimized module could be had.

    ``step`` is jitted if it is not already; ``args`` may be arrays or `jax.ShapeDtypeStruct`s
    with shardings.
    """
    import jax

    jitted = step if hasattr(step, "lower") else jax.jit(step)
    lowered = jitted.lower(*args, **(kwargs or {}))
    with tempfile.TemporaryDirectory(prefix="cmtune-discover-") as directory:
        compiled = lowered.compile(compiler_options={"xla_dump_to": directory,
                                                     "xla_dump_hlo_pass_re": "spmd-partitioning"})
        dumps = sorted(f for f in os.listdir(directory) if "after_spmd-partitioning" in f and f.endswith(".txt"))
        if dumps:
            with open(os.path.join(directory, dumps[-1])) as handle:
                return handle.read(), None
    # no partitioned module was written: one device (nothing to partition), or a compile served from JAX's
    # persistent cache; the optimized module holds the same collectives, fused
    return compiled.as_text(), ("XLA wrote no partitioned module (one device, or a compile from the persistent "
                                "compilation cache): the optimized module was read instead")


def discover(step, args: Sequence, mesh=None, *, kwargs: Mapping | None = None) -> Discovery:
    """The collective matmuls of one training step (see the module docstring).

    Args:
        step: the step, jitted or not (as a step spec's ``NAME(tuned=None)`` returns it).
        args: its arguments: arrays or `jax.ShapeDtypeStruct`s with their shardings.
        mesh: the step's mesh, to name each ring's axis (optional).
        kwargs: keyword arguments of the step, if any.

    Returns:
        A `Discovery`: problems with slot, role and runs per step; skipped collectives and why.
    """
    text, note = partitioned_module(step, args, kwargs=kwargs)
    shape = {str(name): int(size) for name, size in mesh.shape.items()} if mesh is not None else None
    found = scan(text, shape)
    if note:
        found.warnings.append(note)
    return found
