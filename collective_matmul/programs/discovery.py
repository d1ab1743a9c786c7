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
  `collective_matmul.planning.models.slot_problems`, applied to the forward call;
- an all-gather of the weight feeding a projection (FSDP): a ``weight_allgather_matmul_k`` (the weight gathered
  on its contracting dimension) or ``_n`` (on its output dimension), whose slots are the weight gathered again
  for the input gradient and the weight gradient reduce-scattered onto the weight's layout
  (``reduce_scatter_grad_weight``; the CPU backend prints it as an all-reduce and slices).

Each problem gets its slot, its role (`collective_matmul.programs.roles`) and how often it runs per step
(a ``scan`` over layers counts its trip count; remat's recomputation is not counted again).
Gathers that feed no activation × weight product (attention's K/V, both operands gathered) and
all-reduces that are not scattered are listed as skipped, with the reason.  The asynchronous
``all-gather-start`` / ``-done`` pairs of accelerator backends are read too.

Global sizes follow the sequence-parallel layout the ops use (`collective_matmul.ops.collective`): m is the
rows one ring sees (the batch of one data shard times the sequence), k and n the full matmul.
"""

from __future__ import annotations

import functools
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from unittest import mock

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from collective_matmul.planning.models import COLUMN, ROW, SLOTS, WEIGHT_K, WEIGHT_N, Role, rings, slot_problems
from collective_matmul.programs.hlo import EIGHT_BIT, Computation, Instruction, Module, parse_module
from collective_matmul.programs.roles import group_label, label, source_of
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


class XlaDecomposed(BaseModel):
    """A collective matmul XLA's own windowed einsum already rewrote as a loop of permutes and partial products."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    what: str = Field(max_length=400, description="the loop, e.g. 'while %loop: 2 permutes and 2 dots per step'")
    problem: str | None = Field(default=None, max_length=200, description="the problem it decomposes, if read")
    count: int = Field(ge=1)


class Discovery(BaseModel):
    """What `discover` found in one step."""

    model_config = ConfigDict(extra="forbid")

    problems: list[StepProblem] = Field(default_factory=list)
    skipped: list[SkippedCollective] = Field(default_factory=list)
    decomposed: list[XlaDecomposed] = Field(default_factory=list, description="what XLA's windowed einsum already "
                                            "decomposes in the compiled step (its problems are listed too)")
    warnings: list[str] = Field(default_factory=list)
    mesh: dict[str, int] = Field(default_factory=dict)
    groups: list[list[Role]] = Field(default_factory=list, description="the roles whose products read one gathered "
                                     "activation (q/k/v, gate/up), each group in the module's order: XLA gathers "
                                     "once for them, and so does the drop-in (collective_matmul.ops.share)")
    seen: dict[str, int] = Field(default_factory=dict, description="what the module read holds, per step: its matrix "
                                 "products ('products') and its collectives by opcode, so that an empty answer says "
                                 "what was looked at")


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
class _Seen:
    """A forward problem of one role: its slots' problems, how often a step runs it, its mesh axis and source."""

    slots: dict
    count: int
    axis: str | None
    source: str


@dataclass
class _Tally:
    problems: dict[tuple, _Seen] = field(default_factory=dict)  # (role, forward problem key) -> what was seen
    skipped: dict[tuple, int] = field(default_factory=dict)
    backward: dict[str, set[str]] = field(default_factory=dict)  # role -> slots its backward computes
    weights: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)  # role -> forward weight shapes
    gathers: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (computation, all-gather) -> roles

    def skip(self, role: str, what: str, reason: str, times: int) -> None:
        """Count a collective not decomposed, ``times`` per step, under its role and reason."""
        key = (role, what, reason)
        self.skipped[key] = self.skipped.get(key, 0) + times

    def found(self, role: str, slots: dict, times: int, axis: str | None, source: str) -> None:
        """Count a forward collective matmul of ``role`` (its slots' problems), ``times`` per step."""
        key = (role, slots["forward"].key)
        if key in self.problems:
            self.problems[key].count += times
        else:
            self.problems[key] = _Seen(slots, times, axis, source)

    def read(self, role: str, module: Module, computation: str, gather: Instruction) -> None:
        """``role`` reads the activation ``gather`` gathers (one all-gather, or several of one value before XLA
        merges them): the readers of one are a group."""
        readers = self.gathers.setdefault((computation, gather.operands, gather.ints("dimensions"),
                                           tuple(gather.replica_groups(module.num_partitions) or ())), [])
        if role not in readers:
            readers.append(role)


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
    warnings: list[str] = []
    loops = _xla_loops(module, axes)
    in_loops = {c for loop in loops for c in loop.computations}
    dots = [(dot, times) for dot, times in products(module, warnings)
            if dot.computation not in in_loops  # XLA's windowed einsum: read as its loop, below
            and "rematted_computation" not in dot.op_name]  # remat's recompute: counted once
    for backward in (False, True):  # the forward first: a weight gradient is known by its weight's shape
        for dot, times in dots:
            if ("transpose(" in dot.op_name) == backward:
                _classify(module, dot, times, axes, tally, backward=backward)
    _gathered_convolutions(module, tally)
    decomposed = []
    for loop in loops:
        decomposed.append(XlaDecomposed(role=loop.role, what=loop.what, problem=loop.problem.key if loop.problem else
                                        None, count=loop.times))
        if loop.problem is None:
            warnings.append(f"{loop.what}: XLA's windowed einsum, whose problem could not be read ({loop.reason}); "
                            "compile the step with XLA's windowed einsum off to list it")
            continue
        problem = loop.problem
        tally.found(loop.role, slot_problems(problem.collective, m=problem.m, k=problem.k, n=problem.n,
                                             dtype=problem.dtype, axis_size=problem.axis_size),
                    loop.times, loop.axis, loop.source)
    problems = []
    shapes_per_role: dict[str, set[str]] = {}
    for (role, key), seen in tally.problems.items():
        shapes_per_role.setdefault(role, set()).add(key)
        for slot in SLOTS:
            if slot == "forward" or slot in tally.backward.get(role, ()):
                problems.append(StepProblem(role=role, slot=slot, problem=seen.slots[slot], count=seen.count,
                                            axis=seen.axis, source=seen.source))
    for role, keys in shapes_per_role.items():
        if len(keys) > 1:
            warnings.append(f"role {role!r} runs {len(keys)} different problems ({', '.join(sorted(keys))}): give each "
                            "projection its own jax.named_scope (or Flax module) so that each is decided on its own")
    skipped = [SkippedCollective(role=role, what=what, reason=reason, count=count)
               for (role, what, reason), count in tally.skipped.items()]
    groups = [roles for roles in tally.gathers.values() if len(roles) > 1]
    problems += [p for p in (_summed_input_gradient(roles, tally) for roles in groups) if p is not None]
    return Discovery(problems=problems, skipped=skipped, decomposed=decomposed, warnings=warnings,
                     mesh=dict(mesh or {}), groups=groups, seen=_seen(module, dots))


_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _seen(module: Module, dots: list[tuple[Instruction, int]]) -> dict[str, int]:
    """The products and the collectives (by opcode, an async pair once) the module runs per step."""
    seen = {"products": sum(times for _, times in dots)}
    for _comp, inst, times in _executed(module):
        opcode = inst.opcode.removesuffix("-start")  # an async wrapper's collective is its computation's root
        if opcode in _COLLECTIVES:
            seen[opcode] = seen.get(opcode, 0) + times
    return seen


def _executed(module: Module) -> Iterator[tuple[Computation, Instruction, int]]:
    """Every instruction of a computation the module runs, with that computation and its runs per step."""
    for name, (times, _exact) in module.executions.items():
        if times > 0:
            comp = module.computations[name]
            for inst in comp.instructions.values():
                yield comp, inst, times


def _gathered_convolutions(module: Module, tally: _Tally) -> None:
    """Skip, with the reason, every gathered operand of a convolution that is not a matmul (spatial windows,
    dilations, groups): XLA's collective feeds it, and no silence hides that."""
    for comp, conv, times in _executed(module):
        if conv.opcode != "convolution" or _convolution_as_dot(conv) is not None:
            continue
        for operand in conv.operands[:2]:
            inst = comp.instructions.get(operand)
            gathered = _gathered(module, comp, inst) if inst is not None else None
            if gathered is None:
                continue
            frames = [(f.file, f.line) for f in module.stack(conv.stack_frame_id)]
            window = re.search(r"window=\{([^}]*)\}", conv.attributes)
            tally.skip(label(conv.op_name.rpartition("/")[0], frames),
                       f"{gathered.collective.opcode} {gathered.collective.name} -> {conv.name}",
                       "a convolution that is not a matrix product"
                       + (f" (window {{{window.group(1)}}})" if window else " (feature or batch groups)")
                       + ": not a collective matmul cmtune decomposes", times)


def _summed_input_gradient(roles: list[Role], tally: _Tally) -> StepProblem | None:
    """The input gradient of a group (the products of one gathered activation) as the drop-in runs it when it
    shares the gather (`collective_matmul.ops.share`): one reduce-scatter ring of the summed product, N the sum of
    the group's, listed under the group's label.  None where a member's backward or shapes do not allow it."""
    members = []
    for role in roles:
        found = [seen for (r, _), seen in tally.problems.items() if r == role]
        if len(found) != 1 or "grad_input" not in tally.backward.get(role, ()):
            return None
        members.append(found[0])
    lead = members[0]
    first = lead.slots["forward"]
    if any((m.slots["forward"].m, m.slots["forward"].k, m.slots["forward"].dtype, m.slots["forward"].axis_size,
            m.axis) != (first.m, first.k, first.dtype, first.axis_size, lead.axis) for m in members):
        return None
    n = sum(m.slots["forward"].n for m in members)
    problem = slot_problems(COLUMN, m=first.m, k=first.k, n=n, dtype=first.dtype,
                            axis_size=first.axis_size)["grad_input"]
    return StepProblem(role=group_label(roles), slot="grad_input", problem=problem, count=lead.count, axis=lead.axis,
                       source=lead.source)


@dataclass(frozen=True)
class _Skip:
    """A collective next to a product that cmtune does not decompose: what it is, and why."""

    what: str
    reason: str


@dataclass(frozen=True)
class _Found:
    """A forward collective matmul: its collective over a ring (and the ring's mesh axis), the global product."""

    collective: str
    ring: int
    axis: str | None
    m: int
    k: int
    n: int
    what: str
    slots: dict | None = None  # each slot's problem (`slot_problems`), once the shapes are checked


@dataclass(frozen=True)
class _Product:
    """One product of a module with what feeds it and what it feeds: the facts the rules read."""

    module: Module
    comp: Computation
    dot: Instruction
    lhs: Instruction
    rhs: Instruction
    lhs_c: tuple[int, ...]
    rhs_c: tuple[int, ...]
    lhs_b: tuple[int, ...]

    @classmethod
    def of(cls, module: Module, dot: Instruction) -> _Product | None:
        comp = module.computations[dot.computation]
        if len(dot.operands) != 2:
            return None
        lhs, rhs = (comp.instructions.get(o) for o in dot.operands)
        if lhs is None or rhs is None:
            return None
        return cls(module, comp, dot, lhs, rhs, dot.ints("lhs_contracting_dims"), dot.ints("rhs_contracting_dims"),
                   dot.ints("lhs_batch_dims"))

    @functools.cached_property
    def gathered_lhs(self) -> _Gathered | None:
        return _gathered(self.module, self.comp, self.lhs)

    @functools.cached_property
    def gathered_rhs(self) -> _Gathered | None:
        return _gathered(self.module, self.comp, self.rhs)

    @functools.cached_property
    def scattered(self) -> _Scattered | None:
        return _scattered(self.module, self.comp, self.dot)

    @functools.cached_property
    def exchanged(self) -> Instruction | None:
        """The all-to-all that feeds an operand (expert or sequence parallelism's exchange), if one does."""
        return next((i for i in (_through(self.comp, o) for o in (self.lhs, self.rhs)) if i.opcode == "all-to-all"),
                    None)

    @property
    def projection(self) -> bool:
        """An activation times a weight: no batch dimensions, no exchange before it."""
        return not self.lhs_b and self.exchanged is None

    def size(self, dims: Sequence[int], operand: Instruction) -> int:
        """The product of ``operand``'s ``dims`` (its local rows, features or columns)."""
        return math.prod(operand.shape.dims[d] for d in dims)


def _classify(module: Module, dot: Instruction, times: int, axes: dict, tally: _Tally, *, backward: bool) -> None:
    """Tally one dot: a forward collective matmul, a skipped collective, or backward evidence."""
    product = _Product.of(module, dot)
    if product is None:
        return
    frames = [(f.file, f.line) for f in module.stack(dot.stack_frame_id)]
    role = label(dot.op_name.rpartition("/")[0], frames)  # the op_name without its primitive
    if backward:
        _backward_evidence(product, role, tally)
        return
    if product.projection:
        tally.weights.setdefault(role, []).append(product.rhs.shape.dims)
    finding = _finding(product, axes)
    if isinstance(finding, _Skip):
        tally.skip(role, finding.what, finding.reason, times)
    elif finding is not None:
        tally.found(role, finding.slots, times, finding.axis, source_of(frames))
        if finding.collective == COLUMN:  # the products one gathered activation feeds: one group
            tally.read(role, module, dot.computation, product.gathered_lhs.collective)


def _backward_evidence(product: _Product, role: str, tally: _Tally) -> None:
    """Which gradients a role's backward computes: dy times its weight, or activations contracted to its shape."""
    weights = tally.weights.get(role, ())
    if any(operand.shape.dims in weights for operand in (product.lhs, product.rhs)):
        tally.backward.setdefault(role, set()).add("grad_input")
    elif any(sorted(product.dot.shape.dims) == sorted(w) for w in weights):
        tally.backward.setdefault(role, set()).add("grad_weight")


def _finding(product: _Product, axes: dict) -> _Skip | _Found | None:
    """What one forward product is: a skip (the first rule that refuses it), a collective matmul, or nothing to say
    (no collective next to it, a ring of one)."""
    for rule in _REFUSALS:
        skip = rule(product)
        if skip is not None:
            return skip
    if product.lhs_b:
        return None
    found = (_weight(product, axes) if product.gathered_rhs else _column(product, axes) if product.gathered_lhs
             else _row(product, axes) if product.scattered else None)
    if not isinstance(found, _Found) or found.ring < 2:
        return found if isinstance(found, _Skip) else None
    return _operand_types(product, found) or _with_slots(product, found)


def _exchange(product: _Product) -> _Skip | None:
    a2a = product.exchanged
    if a2a is None:
        return None
    return _Skip(f"all-to-all {a2a.name} -> {product.dot.name}",
                 "an all-to-all feeds the product (the exchange of expert or sequence parallelism): not a collective "
                 "matmul cmtune decomposes")


def _batched(product: _Product) -> _Skip | None:
    gathered = product.gathered_lhs or product.gathered_rhs
    if not product.lhs_b or gathered is None:
        return None
    return _Skip(f"{gathered.collective.opcode} {gathered.collective.name} -> {product.dot.name}",
                 "a product with batch dimensions (attention-like: both operands are activations), not an "
                 "activation x weight projection")


def _both_gathered(product: _Product) -> _Skip | None:
    lhs, rhs = product.gathered_lhs, product.gathered_rhs
    if product.lhs_b or lhs is None or rhs is None:
        return None
    if lhs.dim in product.lhs_c:  # the activation's features gathered (FSDP x TP's column layers): the weight's ring
        return None               # is the collective matmul (`_weight`), the activation's gather stays XLA's
    return _Skip(f"{lhs.collective.opcode} {lhs.collective.name}, {rhs.collective.opcode} {rhs.collective.name} -> "
                 f"{product.dot.name}",
                 "both operands are gathered (the activation on its rows over one ring, the weight over another: "
                 "FSDP beside sequence parallelism): not the layout of cmtune's ops, which gather one of the two")


_REFUSALS = (_exchange, _batched, _both_gathered)


def _column(product: _Product, axes: dict) -> _Skip | _Found:
    """A product of a gathered activation: an all-gather matmul, if the activation is gathered on its rows."""
    gathered, lhs, rhs = product.gathered_lhs, product.lhs, product.rhs
    what = f"{gathered.collective.opcode} {gathered.collective.name} -> {product.dot.name}"
    if gathered.dim in product.lhs_c:
        return _Skip(what, "gathers the activation's contracting dimension (the activation is sharded on its "
                           "features), not its rows")
    if product.lhs_c != (len(lhs.shape.dims) - 1,):
        return _Skip(what, f"the product contracts the gathered operand's dimensions {set(product.lhs_c)}, not its "
                           "last (its features): a weight gradient of another layout than cmtune's, not a projection")
    rows = [d for d in range(len(lhs.shape.dims)) if d not in product.lhs_c]
    cols = [d for d in range(len(rhs.shape.dims)) if d not in product.rhs_c]
    return _Found(COLUMN, gathered.ring, _axis_of(product.module, gathered.collective, axes),
                  m=product.size(rows, lhs), k=product.size(product.lhs_c, lhs),
                  n=product.size(cols, rhs) * gathered.ring, what=what)


def _weight(product: _Product, axes: dict) -> _Skip | _Found:
    """A product of a gathered weight (FSDP, or a weight smaller than the activation): the weight's shards on the
    ring, gathered on its contracting dimension (FSDP's usual layout) or on its output dimension.  The activation
    keeps this device's rows, its share of the ring's (FSDP's batch, sharded over the same axis)."""
    gathered, lhs, rhs = product.gathered_rhs, product.lhs, product.rhs
    what = f"{gathered.collective.opcode} {gathered.collective.name} -> {product.dot.name}"
    ndim = len(lhs.shape.dims)
    if tuple(sorted(product.lhs_c)) != tuple(range(ndim - len(product.lhs_c), ndim)):  # heads x head_dim folds
        return _Skip(what, f"XLA gathers the weight, but the product contracts the activation's dimensions "
                           f"{set(product.lhs_c)}, not its last ones (its features): not a projection")
    rows = [d for d in range(len(lhs.shape.dims)) if d not in product.lhs_c]
    cols = [d for d in range(len(rhs.shape.dims)) if d not in product.rhs_c]
    collective = WEIGHT_K if gathered.dim in product.rhs_c else WEIGHT_N
    return _Found(collective, gathered.ring, _axis_of(product.module, gathered.collective, axes),
                  m=product.size(rows, lhs) * gathered.ring, k=product.size(product.lhs_c, lhs),
                  n=product.size(cols, rhs), what=what)


def _row(product: _Product, axes: dict) -> _Skip | _Found | None:
    """A product whose result is reduced over a ring: a matmul reduce-scatter, if it is scattered on its rows."""
    scattered, lhs, rhs = product.scattered, product.lhs, product.rhs
    what = f"{product.dot.name} -> {scattered.collective.opcode} {scattered.collective.name}"
    rows = [d for d in range(len(lhs.shape.dims)) if d not in product.lhs_c]
    if scattered.kind == "all-reduce":
        return _Skip(what, "the product is all-reduced, not scattered: tensor parallelism without sequence "
                           "parallelism (the result is wanted whole on every device of the ring)") \
            if scattered.ring > 1 else None
    if scattered.dim is None or scattered.dim >= len(rows):
        return _Skip(what, "the product is scattered on the weight's output dimension, not on its rows")
    cols = [d for d in range(len(rhs.shape.dims)) if d not in product.rhs_c]
    return _Found(ROW, scattered.ring, _axis_of(product.module, scattered.collective, axes),
                  m=product.size(rows, lhs), k=product.size(product.lhs_c, lhs) * scattered.ring,
                  n=product.size(cols, rhs), what=what)


def _operand_types(product: _Product, found: _Found) -> _Skip | None:
    """A product whose operand types cmtune's ops do not take: dequantized 8-bit values, or two types."""
    eight = _dequantized(product.comp, product.lhs) or _dequantized(product.comp, product.rhs)
    if eight is not None:
        return _Skip(found.what, f"the product reads {eight} values dequantized by a scale: cmtune's ops take "
                                 "float32, bfloat16 or float16 operands, so XLA keeps this one")
    lhs, rhs = product.lhs.shape, product.rhs.shape
    if lhs.dtype_name is None or rhs.dtype != lhs.dtype:
        return _Skip(found.what, f"operands of types {lhs.dtype} and {rhs.dtype}: cmtune's ops take one dtype of "
                                 "float32, bfloat16 or float16")
    return None


def _with_slots(product: _Product, found: _Found) -> _Skip | _Found:
    """``found`` with its slots' problems, or a skip where its shapes make none (they do not divide over the ring)."""
    try:
        slots = slot_problems(found.collective, m=found.m, k=found.k, n=found.n, dtype=product.lhs.shape.dtype_name,
                              axis_size=found.ring)
    except ValueError as exc:
        return _Skip(found.what, str(exc))
    return replace(found, slots=slots)


def _axis_of(module: Module, inst: Instruction, axes: dict) -> str | None:
    """The mesh axis whose device groups are ``inst``'s replica groups (None: no one axis's)."""
    groups = inst.replica_groups(module.num_partitions)
    if groups is None:
        return None
    wanted = {frozenset(g) for g in groups}
    return next((name for name, g in axes.items() if g == wanted), None)


# ---- the products of a module, in every form a backend prints them ----------------------------

_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__cudnn$matmul")
_PASS = ("convert", "bitcast", "copy", "reshape")  # inside a fusion, between its parameter and its dot


def products(module: Module, warnings: list[str] | None = None) -> list[tuple[Instruction, int]]:
    """Every matrix product of ``module`` as a ``dot`` in the computation that uses its value, with how often it
    runs: a ``dot``; a ``convolution`` that is a matmul (``dim_labels=bf_io->bf``, as XLA's TPU compiler writes
    dots); a cuBLAS/cuBLASLt GEMM custom call (its value: the call's first result); a fusion around one dot (a
    Triton GEMM, an output fusion), with the fusion's operands for the dot's parameters.  A product whose
    operands cannot be followed is a warning (in ``warnings``), never silence."""
    warnings = [] if warnings is None else warnings
    fused = {target for comp in module.computations.values() for inst in comp.instructions.values()
             if inst.opcode == "fusion" for target in _called(inst)}
    found = []
    for name, (times, _exact) in module.executions.items():
        if times <= 0 or name in fused:
            continue
        comp = module.computations[name]
        for inst in list(comp.instructions.values()):
            product, problem = as_product(module, comp, inst)
            if product is not None:
                found.append((product, times))
            elif problem:
                warnings.append(f"{inst.opcode} {inst.name}: a product whose operands were not read ({problem})")
    return found


def as_product(module: Module, comp, inst: Instruction) -> tuple[Instruction | None, str | None]:
    """``inst`` as a dot (None if it is no product; then a reason if it is one that could not be read)."""
    if inst.opcode == "dot":
        return inst, None
    if inst.opcode == "convolution":
        dims = _convolution_as_dot(inst)
        if dims is None:
            return None, None  # a real convolution (spatial dimensions, groups): not a matmul
        return _dot_like(inst, inst.name, inst.shape, inst.operands, dims, comp), None
    if inst.opcode == "custom-call" and any(f'"{t}"' in inst.attributes for t in _GEMM_TARGETS):
        dims = _gemm_dims(inst.attributes)
        if dims is None or len(inst.operands) < 2:
            return None, "no dot_dimension_numbers in its backend config"
        value = inst
        if inst.shape.is_tuple:  # (result, workspace): the product is element 0
            value = next((u for u in comp.users.get(inst.name, ()) if u.opcode == "get-tuple-element"
                          and u.attribute("index") == "0"), None)
            if value is None:
                return None, "its result is not read"
        return _dot_like(inst, value.name, value.shape, inst.operands[:2], dims, comp), None
    if inst.opcode == "fusion":
        body = module.computations.get(next(iter(_called(inst)), ""))
        inner = [i for i in body.instructions.values() if i.opcode in ("dot", "convolution")] if body else []
        if len(inner) != 1:
            return None, None if not inner else None
        dot = inner[0]
        dims = _dims_of(dot) if dot.opcode == "dot" else _convolution_as_dot(dot)
        if dims is None:
            return None, None
        params = {i.name: int(i.args) for i in body.instructions.values() if i.opcode == "parameter"}
        outer = []
        for operand in dot.operands[:2]:
            traced = _to_parameter(body, operand, module)
            if traced is None or params.get(traced, len(inst.operands)) >= len(inst.operands):
                return None, f"the fused {dot.opcode} {dot.name} reads {operand}, computed inside the fusion"
            outer.append(inst.operands[params[traced]])
        return _dot_like(dot, inst.name, inst.shape, tuple(outer), dims, comp), None
    return None, None


def is_product(module: Module, inst: Instruction, depth: int = 0) -> bool:
    """Whether ``inst`` computes a matrix product: a dot, a convolution that is a matmul, a GEMM custom call, or a
    fusion holding one (at any depth)."""
    if inst.opcode == "dot" or (inst.opcode == "convolution" and _convolution_as_dot(inst) is not None):
        return True
    if inst.opcode == "custom-call":
        return any(f'"{t}"' in inst.attributes for t in _GEMM_TARGETS)
    if inst.opcode == "fusion" and depth < 8:
        body = module.computations.get(next(iter(_called(inst)), ""))
        return body is not None and any(is_product(module, i, depth + 1) for i in body.instructions.values())
    return False


def _dot_like(source: Instruction, name: str, shape, operands, dims: dict[str, tuple[int, ...]], comp) -> Instruction:
    """A dot named ``name`` in ``comp`` with ``operands``, the dimension numbers ``dims`` and ``source``'s metadata."""
    numbers = ", ".join(f"{key}={{{','.join(map(str, value))}}}" for key, value in dims.items())
    metadata = re.search(r"metadata=\{.*?\}(?=,\s*\w+=|\s*$)", source.attributes)
    attributes = numbers + (", " + metadata.group(0) if metadata else "")
    return Instruction(name, "dot", shape, tuple(operands), attributes, comp.name)


def _dims_of(dot: Instruction) -> dict[str, tuple[int, ...]]:
    return {key: dot.ints(key) for key in ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims",
                                           "rhs_batch_dims")}


def _convolution_as_dot(conv: Instruction) -> dict[str, tuple[int, ...]] | None:
    """A convolution's dimension numbers as a dot's, where it is a matmul: no feature or batch groups, every window
    of size 1 (XLA's TPU compiler writes a dot as ``dim_labels=bf_io->bf``, rows of several blocks as
    ``0bf_io0->0bf``: a spatial dimension of the left operand is more rows, the kernel's is of size 1), the output
    laid out as the left operand with the kernel's output features last."""
    match = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", conv.attributes)
    if match is None or re.search(r"(feature|batch)_group_count=([2-9]|\d\d)", conv.attributes):
        return None
    lhs, rhs, out = match.groups()
    window = re.search(r"window=\{([^}]*)\}", conv.attributes)
    sizes = re.search(r"size=([\dx]+)", window.group(1)) if window else None
    if sizes and any(int(v) != 1 for v in sizes.group(1).split("x")):
        return None
    if window and re.search(r"(stride|pad|lhs_dilate|rhs_dilate)=", window.group(1)) and not \
            re.fullmatch(r"size=[1x]+", window.group(1).strip()):
        return None
    if lhs.count("b") != 1 or lhs.count("f") != 1 or rhs.count("i") != 1 or rhs.count("o") != 1:
        return None
    if out.replace("f", "") != lhs.replace("f", "") or not out.endswith("f"):
        return None
    return {"lhs_contracting_dims": (lhs.index("f"),), "rhs_contracting_dims": (rhs.index("i"),),
            "lhs_batch_dims": (), "rhs_batch_dims": ()}


def _gemm_dims(attributes: str) -> dict[str, tuple[int, ...]] | None:
    """A GEMM custom call's ``dot_dimension_numbers`` (its backend config) as a dot's."""
    dims = {}
    for key, field_ in (("lhs_contracting_dims", "lhs_contracting_dimensions"),
                        ("rhs_contracting_dims", "rhs_contracting_dimensions"),
                        ("lhs_batch_dims", "lhs_batch_dimensions"), ("rhs_batch_dims", "rhs_batch_dimensions")):
        match = re.search(rf'"{field_}"\s*:\s*\[([^\]]*)\]', attributes)
        if match is None:
            return None
        dims[key] = tuple(int(v) for v in re.findall(r"\d+", match.group(1)))
    return dims


def _to_parameter(body, name: str, module: Module | None = None) -> str | None:
    """The fusion parameter ``name`` is (through converts, bitcasts, copies, reshapes that keep the shape, and
    nested fusions of one operand that are only such ops, as XLA's TPU compiler writes a layout change)."""
    inst = body.instructions.get(name)
    for _ in range(8):
        if inst is None:
            return None
        if inst.opcode == "parameter":
            return inst.name
        if inst.opcode == "fusion" and module is not None and len(inst.operands) == 1:
            nested = module.computations.get(next(iter(_called(inst)), ""))
            root = nested.root if nested is not None else None
            if root is None or _to_parameter(nested, root.name, module) is None:
                return None
            inst = body.instructions.get(inst.operands[0])
            continue
        if inst.opcode not in _PASS or not inst.operands:
            return None
        source = body.instructions.get(inst.operands[0])
        if inst.opcode == "reshape" and (source is None or source.shape.dims != inst.shape.dims):
            return None
        inst = source
    return None


def _called(inst: Instruction) -> list[str]:
    return re.findall(r"calls=%?([\w.\-]+)", inst.attributes)


# ---- XLA's own windowed einsum --------------------------------------------------------------


@dataclass
class _XlaLoop:
    role: str
    what: str
    times: int
    computations: set[str]
    problem: object | None = None  # a Problem
    axis: str | None = None
    source: str = ""
    reason: str = ""


def _xla_loops(module: Module, axes: Mapping[str, set[frozenset[int]]] | None = None) -> list[_XlaLoop]:
    """The loops XLA's SPMD partitioner writes for a windowed einsum (its body ``windowed_dot_general_body_ag``
    or ``_rs``): a ring of collective-permutes and partial products, with the problem each decomposes where
    its shapes say it (a gather: m = the rows of all steps, n = the local columns times the ring; a scatter:
    m = a step's rows times the ring, k = the local contraction times the ring)."""
    from collective_matmul.planning.problem import Problem

    loops = []
    for name, (times, _exact) in module.executions.items():
        if times <= 0:
            continue
        for inst in module.computations[name].instructions.values():
            body = module.computations.get(inst.attribute("body") or "") if inst.opcode == "while" else None
            if body is None or "windowed_dot_general_body" not in body.name:
                continue
            kind = "allgather_matmul" if "_ag" in body.name else "matmul_reduce_scatter" if "_rs" in body.name \
                else None
            permutes = [i for i in body.instructions.values() if i.opcode.startswith("collective-permute")
                        and not i.opcode.endswith("-done")]
            dots = _body_products(module, body)
            named = dots[0] if dots else inst  # the loop carries the product's metadata too
            frames = [(f.file, f.line) for f in module.stack(named.stack_frame_id)]
            role, source = label(named.op_name.rpartition("/")[0], frames), source_of(frames)
            what = (f"while {inst.name}: XLA's windowed einsum ({'gather' if kind == COLUMN else 'scatter'}), "
                    f"{len(permutes)} collective-permutes and {len(dots)} dots per step")
            loop = _XlaLoop(role=role, what=what, times=times, source=source,
                            computations={body.name, inst.attribute("condition") or ""})
            loop.problem, loop.reason = _loop_problem(module, inst, body, kind, permutes, dots, Problem)
            caller = module.computations[name]
            init = caller.instructions.get(inst.operands[0]) if inst.operands else None
            eight = next((e for o in (init.operands if init is not None and init.opcode == "tuple" else ())
                          if (e := _dequantized(caller, caller.instructions.get(o)))), None)
            if eight is not None and loop.problem is not None:
                loop.problem, loop.reason = None, (f"its operands are {eight} values dequantized by a scale: cmtune's "
                                                   "ops take float32, bfloat16 or float16")
            ring = _ring_devices(permutes[0]) if permutes else None
            loop.axis = next((a for a, groups in (axes or {}).items() if ring in groups), None)
            if loop.problem is not None:
                loop.what += f", a ring of {loop.problem.axis_size}"
            loops.append(loop)
    return loops


def _ring_devices(permute: Instruction) -> frozenset[int] | None:
    """The devices of one ring of a permute's source-target pairs (the cycle its first pair is on)."""
    text = permute.attributes.split("source_target_pairs=", 1)
    pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", text[1].split("}}")[0] + "}")] \
        if len(text) == 2 else []
    if not pairs:
        return None
    after = dict(pairs)
    ring, device = [], pairs[0][0]
    while device in after and device not in ring:
        ring.append(device)
        device = after[device]
    return frozenset(ring)


def _body_products(module: Module, body) -> list[Instruction]:
    return [product for inst in body.instructions.values()
            if (product := as_product(module, body, inst)[0]) is not None]


def _loop_problem(module: Module, loop: Instruction, body, kind: str | None, permutes, dots, problem_type):
    """The problem a windowed-einsum loop decomposes, or None and why.  A gather loop moves shards of the rows
    (``[..., rows, k]``) round a ring: m = a shard's rows times the ring, n = the local columns times the ring.
    A scatter loop slices its rows from the whole left operand (``[m, k_local]``) and moves partial sums
    (``[m / ring, n]``): the ring is their ratio (its permutes may skip devices, two at a time)."""
    if kind is None or not permutes:
        return None, "neither a gather nor a scatter loop"
    if not dots:
        return None, "its products are fused with what feeds them (the partitioned module, which discovery reads, " \
                     "has them whole)"
    dot = dots[0]
    lhs, rhs = (body.instructions.get(o) for o in dot.operands[:2])
    moved = body.instructions.get(permutes[0].operands[0]) if permutes[0].operands else None
    if lhs is None or rhs is None or moved is None or not moved.shape.dims:
        return None, "its operands were not read"
    lhs_c, rhs_c = dot.ints("lhs_contracting_dims"), dot.ints("rhs_contracting_dims")
    k_local = math.prod(lhs.shape.dims[i] for i in lhs_c)
    cols = math.prod(d for i, d in enumerate(rhs.shape.dims) if i not in rhs_c)
    rows = math.prod(d for i, d in enumerate(lhs.shape.dims) if i not in lhs_c)
    dtype = lhs.shape.dtype_name
    if dtype not in ("float32", "bfloat16", "float16"):
        return None, f"its operands are {lhs.shape.dtype}: cmtune's ops take float32, bfloat16 or float16"
    shard_rows = math.prod(moved.shape.dims[:-1])
    if kind == COLUMN:
        ring = len(_ring_devices(permutes[0]) or ())
        if rhs.opcode == "dynamic-slice" or moved.shape.dims[-1] != k_local or rows % max(shard_rows, 1):
            return None, ("it moves shards of the weight or of the contracting dimension, not of the rows: not the "
                          "layout of cmtune's ops")
        m, k, n = shard_rows * ring, k_local, cols * ring
    else:
        whole = body.instructions.get(lhs.operands[0]) if lhs.opcode == "dynamic-slice" and lhs.operands else lhs
        m = math.prod(d for i, d in enumerate(whole.shape.dims) if i not in lhs_c)
        ring = m // max(shard_rows, 1)
        if moved.shape.dims[-1] != cols or m % max(shard_rows, 1):
            return None, "its partial sums are not row blocks of the product: not the layout of cmtune's ops"
        k, n = k_local * ring, cols
    if ring < 2:
        return None, "its ring was not read"
    try:
        return problem_type(collective=kind, m=m, k=k, n=n, dtype=dtype, axis_size=ring), ""
    except ValueError as exc:
        return None, str(exc)


def _dequantized(comp, inst: Instruction | None) -> str | None:
    """The 8-bit type ``inst`` was dequantized from (a convert of an FP8 or int8 value, times or over a broadcast
    scale; through the ops a value passes unchanged and an all-gather), or None."""
    for _ in range(16):
        if inst is None:
            return None
        if inst.opcode == "convert" and inst.operands:
            source = comp.instructions.get(inst.operands[0])
            if source is not None and source.shape.dtype in EIGHT_BIT:
                return source.shape.dtype
        if inst.opcode in ("multiply", "divide") and len(inst.operands) == 2:
            a, b = (comp.instructions.get(o) for o in inst.operands)
            inst = a if b is not None and b.opcode == "broadcast" else b if a is not None and a.opcode == \
                "broadcast" else None
            continue
        if inst.opcode in (*_THROUGH, "all-gather", "all-gather-done", "get-tuple-element") and inst.operands:
            inst = comp.instructions.get(inst.operands[0])
            continue
        return None
    return None


def _gathered(module: Module, comp, inst: Instruction) -> _Gathered | None:
    """The all-gather that ``inst`` (a dot operand) is, through ops that keep its values."""
    chain = []
    for _ in range(16):
        if inst.opcode == "async-done" and inst.operands:
            start = comp.instructions.get(inst.operands[0])
            wrapped = _wrapped(module, start) if start is not None else None
            if wrapped is None or wrapped.opcode != "all-gather":
                return None
            inst = Instruction(inst.name, "all-gather", inst.shape, start.operands, wrapped.attributes, comp.name)
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
        if inst.opcode in ("multiply", "divide") and len(inst.operands) == 2:  # a dequantize's scale
            a, b = (comp.instructions.get(o) for o in inst.operands)
            scaled = a if b is not None and b.opcode == "broadcast" else b if a is not None and a.opcode == \
                "broadcast" else None
            if scaled is None or scaled.shape.dims != inst.shape.dims:
                return None
            chain.append(inst)
            inst = scaled
            continue
        if inst.opcode not in _THROUGH or not inst.operands:
            return None
        nxt = comp.instructions.get(inst.operands[0])
        if nxt is None or (inst.opcode in ("reshape", "bitcast") and nxt.shape.dims != inst.shape.dims):
            return None  # a reshape that moves dimensions: the gathered one cannot be followed
        chain.append(inst)
        inst = nxt
    return None


def _through(comp, inst: Instruction) -> Instruction:
    """What ``inst`` is, past the ops a value passes unchanged."""
    for _ in range(16):
        if inst.opcode not in _THROUGH or not inst.operands or inst.operands[0] not in comp.instructions:
            return inst
        inst = comp.instructions[inst.operands[0]]
    return inst


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
            wrapped = _wrapped(module, user)
            if user.opcode in ("reduce-scatter", "reduce-scatter-start") or (wrapped and wrapped.opcode ==
                                                                               "reduce-scatter"):
                scatter = wrapped or user
                dims = scatter.ints("dimensions")
                ring = _ratio(scatter, dims[0], inst) if len(dims) == 1 else 0
                return _Scattered(scatter, "reduce-scatter", dims[0] if dims else None, ring)
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


def _wrapped(module: Module, inst: Instruction) -> Instruction | None:
    """The collective an ``async-start`` runs (the root of the computation it ``calls``), or None."""
    if inst.opcode != "async-start":
        return None
    called = module.computations.get(next(iter(_called(inst)), ""))
    root = called.root if called is not None else None
    if root is None:
        return None
    return Instruction(root.name, root.opcode, _last_element(inst.shape) if root.opcode != "all-gather" else
                       root.shape, inst.operands, root.attributes, inst.computation, args=root.args)


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


def partitioned_module(step, args: Sequence, *, kwargs: Mapping | None = None,
                       options: Mapping | None = None) -> tuple[str, str | None]:
    """The text of ``step``'s module after SPMD partitioning, compiled for ``args`` (never run), and a
    note when only the optimized module could be had.

    ``step`` is jitted if it is not already; ``args`` may be arrays or `jax.ShapeDtypeStruct`s
    with shardings; ``options``: more compile options (XLA's windowed einsum off, say).  XLA's TPU compiler
    writes the module as ``after_tpu-spmd-partitioning``, the others as ``after_spmd-partitioning``.
    """
    import jax

    from collective_matmul.programs.gpus import compile_options

    jitted = step if hasattr(step, "lower") else jax.jit(step)
    lowered = jitted.lower(*args, **(kwargs or {}))
    options = compile_options(_devices_of(args), options)
    with tempfile.TemporaryDirectory(prefix="cmtune-discover-") as directory, past_persistent_cache():
        compiled = lowered.compile(compiler_options={"xla_dump_to": directory,
                                                     "xla_dump_hlo_pass_re": "spmd-partitioning", **options})
        dumps = sorted(f for f in os.listdir(directory)
                       if re.search(r"after_(tpu-)?spmd-partitioning", f) and f.endswith(".txt"))
        if dumps:
            with open(os.path.join(directory, dumps[-1])) as handle:
                return handle.read(), None
    # no partitioned module was written (one device: nothing to partition); the optimized module holds the same
    # collectives, fused
    return compiled.as_text(), ("XLA wrote no partitioned module (one device: nothing to partition): the optimized "
                                "module was read instead")


def _devices_of(args: Sequence) -> list:
    """The devices the first sharded argument of ``args`` is laid out on (none without one)."""
    import jax

    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and hasattr(sharding, "device_set"):
            return sorted(sharding.device_set, key=lambda d: d.id)
    return []


@contextmanager
def past_persistent_cache():
    """Compile for real inside: JAX's persistent compilation cache (MaxText turns it on) neither read nor written.

    A compile served from the cache runs none of XLA's passes, so it writes no partitioned module to read.  JAX
    decides once per process whether the cache is used (`jax._src.compilation_cache.is_cache_used`, asked by every
    compile), so turning the option off after a first compile changes nothing: that question is answered "no"
    for the compiles inside.  A JAX without it has no cache to go past.
    """
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover
        compilation_cache = None
    if compilation_cache is None or not hasattr(compilation_cache, "is_cache_used"):
        yield
        return
    with mock.patch.object(compilation_cache, "is_cache_used", lambda backend: False):
        yield


def discover(step, args: Sequence, mesh=None, *, kwargs: Mapping | None = None) -> Discovery:
    """The collective matmuls of one training step (see the module docstring).

    Where XLA's own windowed einsum already decomposes some of them (TPU, at its size threshold), the step is
    compiled a second time with it off: the problems are read from that plain module, each marked with how XLA
    decomposes it (`StepProblem.xla`), and the loops are listed in ``decomposed``.

    Args:
        step: the step, jitted or not (as a step spec's ``NAME(tuned=None)`` returns it).
        args: its arguments: arrays or `jax.ShapeDtypeStruct`s with their shardings.
        mesh: the step's mesh, to name each ring's axis and to know its platform (optional).
        kwargs: keyword arguments of the step, if any.

    Returns:
        A `Discovery`: problems with slot, role and runs per step; skipped collectives and why; what XLA decomposes.
    """
    from collective_matmul.planning.xla_options import windowed_einsum

    text, note = partitioned_module(step, args, kwargs=kwargs)
    shape = {str(name): int(size) for name, size in mesh.shape.items()} if mesh is not None else None
    found = scan(text, shape)
    platform = mesh.devices.flat[0].platform if mesh is not None else None
    off = windowed_einsum(platform, "off") if platform else None
    if found.decomposed and off is not None:
        plain_text, _ = partitioned_module(step, args, kwargs=kwargs, options=off)
        found = _marked(scan(plain_text, shape), found)
    if note:
        found.warnings.append(note)
    return found


def _marked(plain: Discovery, default: Discovery) -> Discovery:
    """The problems of the step compiled with XLA's windowed einsum off, each marked with how XLA decomposes it in
    the step as compiled (matched by role and problem, or by role where the loop's problem was not read)."""
    by_problem = {(d.role, d.problem): d for d in default.decomposed if d.problem}
    by_role = {d.role: d for d in default.decomposed}
    problems = []
    for p in plain.problems:
        loop = by_problem.get((p.role, p.problem.key)) or (by_role.get(p.role) if p.slot == "forward" else None)
        note = f"XLA's windowed einsum decomposes this at its threshold: {loop.what}"[:400] if loop else None
        problems.append(p.model_copy(update={"xla": note}) if note else p)
    warnings = [w for w in default.warnings if "windowed einsum" not in w] + plain.warnings
    return plain.model_copy(update={"problems": problems, "decomposed": default.decomposed,
                                    "warnings": list(dict.fromkeys(warnings))})
