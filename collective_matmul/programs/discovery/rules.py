"""The rules: what one forward product of a module is (a collective matmul cmtune decomposes, a collective it
skips and why, or nothing to say), from what feeds it and what it feeds."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from collective_matmul.planning.models import COLUMN, ROW, WEIGHT_K, WEIGHT_N, slot_problems
from collective_matmul.programs.discovery import flow
from collective_matmul.programs.hlo import Computation, Instruction, Module


@dataclass(frozen=True)
class Skip:
    """A collective next to a product that cmtune does not decompose: what it is, and why."""

    what: str
    reason: str


@dataclass(frozen=True)
class Found:
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
class Product:
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
    def of(cls, module: Module, dot: Instruction) -> Product | None:
        comp = module.computations[dot.computation]
        if len(dot.operands) != 2:
            return None
        lhs, rhs = (comp.instructions.get(o) for o in dot.operands)
        if lhs is None or rhs is None:
            return None
        return cls(module, comp, dot, lhs, rhs, dot.ints("lhs_contracting_dims"), dot.ints("rhs_contracting_dims"),
                   dot.ints("lhs_batch_dims"))

    @functools.cached_property
    def gathered_lhs(self) -> flow.Gathered | None:
        return flow.gathered(self.module, self.comp, self.lhs)

    @functools.cached_property
    def gathered_rhs(self) -> flow.Gathered | None:
        return flow.gathered(self.module, self.comp, self.rhs)

    @functools.cached_property
    def scattered(self) -> flow.Scattered | None:
        return flow.scattered(self.module, self.comp, self.dot)

    @functools.cached_property
    def exchanged(self) -> Instruction | None:
        """The all-to-all that feeds an operand (expert or sequence parallelism's exchange), if one does."""
        return next((i for i in (flow.through(self.comp, o) for o in (self.lhs, self.rhs)) if i.opcode == "all-to-all"),
                    None)

    @property
    def projection(self) -> bool:
        """An activation times a weight: no batch dimensions, no exchange before it."""
        return not self.lhs_b and self.exchanged is None

    def size(self, dims: Sequence[int], operand: Instruction) -> int:
        """The product of ``operand``'s ``dims`` (its local rows, features or columns)."""
        return math.prod(operand.shape.dims[d] for d in dims)


def finding(product: Product, axes: dict) -> Skip | Found | None:
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
    if not isinstance(found, Found) or found.ring < 2:
        return found if isinstance(found, Skip) else None
    return _operand_types(product, found) or _with_slots(product, found)


def _exchange(product: Product) -> Skip | None:
    a2a = product.exchanged
    if a2a is None:
        return None
    return Skip(f"all-to-all {a2a.name} -> {product.dot.name}",
                 "an all-to-all feeds the product (the exchange of expert or sequence parallelism): not a collective "
                 "matmul cmtune decomposes")


def _batched(product: Product) -> Skip | None:
    gathered = product.gathered_lhs or product.gathered_rhs
    if not product.lhs_b or gathered is None:
        return None
    return Skip(f"{gathered.collective.opcode} {gathered.collective.name} -> {product.dot.name}",
                 "a product with batch dimensions (attention-like: both operands are activations), not an "
                 "activation x weight projection")


def _both_gathered(product: Product) -> Skip | None:
    lhs, rhs = product.gathered_lhs, product.gathered_rhs
    if product.lhs_b or lhs is None or rhs is None:
        return None
    if lhs.dim in product.lhs_c:  # the activation's features gathered (FSDP x TP's column layers): the weight's ring
        return None               # is the collective matmul (`_weight`), the activation's gather stays XLA's
    return Skip(f"{lhs.collective.opcode} {lhs.collective.name}, {rhs.collective.opcode} {rhs.collective.name} -> "
                 f"{product.dot.name}",
                 "both operands are gathered (the activation on its rows over one ring, the weight over another: "
                 "FSDP beside sequence parallelism): not the layout of cmtune's ops, which gather one of the two")


_REFUSALS = (_exchange, _batched, _both_gathered)


def _column(product: Product, axes: dict) -> Skip | Found:
    """A product of a gathered activation: an all-gather matmul, if the activation is gathered on its rows."""
    gathered, lhs, rhs = product.gathered_lhs, product.lhs, product.rhs
    what = f"{gathered.collective.opcode} {gathered.collective.name} -> {product.dot.name}"
    if gathered.dim in product.lhs_c:
        return Skip(what, "gathers the activation's contracting dimension (the activation is sharded on its "
                           "features), not its rows")
    if product.lhs_c != (len(lhs.shape.dims) - 1,):
        return Skip(what, f"the product contracts the gathered operand's dimensions {set(product.lhs_c)}, not its "
                           "last (its features): a weight gradient of another layout than cmtune's, not a projection")
    rows = [d for d in range(len(lhs.shape.dims)) if d not in product.lhs_c]
    cols = [d for d in range(len(rhs.shape.dims)) if d not in product.rhs_c]
    return Found(COLUMN, gathered.ring, _axis_of(product.module, gathered.collective, axes),
                  m=product.size(rows, lhs), k=product.size(product.lhs_c, lhs),
                  n=product.size(cols, rhs) * gathered.ring, what=what)


def _weight(product: Product, axes: dict) -> Skip | Found:
    """A product of a gathered weight (FSDP, or a weight smaller than the activation): the weight's shards on the
    ring, gathered on its contracting dimension (FSDP's usual layout) or on its output dimension.  The activation
    keeps this device's rows, its share of the ring's (FSDP's batch, sharded over the same axis)."""
    gathered, lhs, rhs = product.gathered_rhs, product.lhs, product.rhs
    what = f"{gathered.collective.opcode} {gathered.collective.name} -> {product.dot.name}"
    ndim = len(lhs.shape.dims)
    if tuple(sorted(product.lhs_c)) != tuple(range(ndim - len(product.lhs_c), ndim)):  # heads x head_dim folds
        return Skip(what, f"XLA gathers the weight, but the product contracts the activation's dimensions "
                           f"{set(product.lhs_c)}, not its last ones (its features): not a projection")
    rows = [d for d in range(len(lhs.shape.dims)) if d not in product.lhs_c]
    cols = [d for d in range(len(rhs.shape.dims)) if d not in product.rhs_c]
    collective = WEIGHT_K if gathered.dim in product.rhs_c else WEIGHT_N
    return Found(collective, gathered.ring, _axis_of(product.module, gathered.collective, axes),
                  m=product.size(rows, lhs) * gathered.ring, k=product.size(product.lhs_c, lhs),
                  n=product.size(cols, rhs), what=what)


def _row(product: Product, axes: dict) -> Skip | Found | None:
    """A product whose result is reduced over a ring: a matmul reduce-scatter, if it is scattered on its rows."""
    scattered, lhs, rhs = product.scattered, product.lhs, product.rhs
    what = f"{product.dot.name} -> {scattered.collective.opcode} {scattered.collective.name}"
    rows = [d for d in range(len(lhs.shape.dims)) if d not in product.lhs_c]
    if scattered.kind == "all-reduce":
        return Skip(what, "the product is all-reduced, not scattered: tensor parallelism without sequence "
                           "parallelism (the result is wanted whole on every device of the ring)") \
            if scattered.ring > 1 else None
    if scattered.dim is None or scattered.dim >= len(rows):
        return Skip(what, "the product is scattered on the weight's output dimension, not on its rows")
    cols = [d for d in range(len(rhs.shape.dims)) if d not in product.rhs_c]
    return Found(ROW, scattered.ring, _axis_of(product.module, scattered.collective, axes),
                  m=product.size(rows, lhs), k=product.size(product.lhs_c, lhs) * scattered.ring,
                  n=product.size(cols, rhs), what=what)


def _operand_types(product: Product, found: Found) -> Skip | None:
    """A product whose operand types cmtune's ops do not take: dequantized 8-bit values, or two types."""
    eight = flow.dequantized(product.comp, product.lhs) or flow.dequantized(product.comp, product.rhs)
    if eight is not None:
        return Skip(found.what, f"the product reads {eight} values dequantized by a scale: cmtune's ops take "
                                 "float32, bfloat16 or float16 operands, so XLA keeps this one")
    lhs, rhs = product.lhs.shape, product.rhs.shape
    if lhs.dtype_name is None or rhs.dtype != lhs.dtype:
        return Skip(found.what, f"operands of types {lhs.dtype} and {rhs.dtype}: cmtune's ops take one dtype of "
                                 "float32, bfloat16 or float16")
    return None


def _with_slots(product: Product, found: Found) -> Skip | Found:
    """``found`` with its slots' problems, or a skip where its shapes make none (they do not divide over the ring)."""
    try:
        slots = slot_problems(found.collective, m=found.m, k=found.k, n=found.n, dtype=product.lhs.shape.dtype_name,
                              axis_size=found.ring)
    except ValueError as exc:
        return Skip(found.what, str(exc))
    return replace(found, slots=slots)


def _axis_of(module: Module, inst: Instruction, axes: dict) -> str | None:
    """The mesh axis whose device groups are ``inst``'s replica groups (None: no one axis's)."""
    groups = inst.replica_groups(module.num_partitions)
    if groups is None:
        return None
    wanted = {frozenset(g) for g in groups}
    return next((name for name, g in axes.items() if g == wanted), None)
