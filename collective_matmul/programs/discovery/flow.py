"""What feeds a product and what it feeds: the collective behind an operand, the one after its result.

Through the ops a value passes unchanged (copies, converts, layout changes, a dequantize's scale) and the
asynchronous forms accelerator backends print (``all-gather-start`` / ``-done``, ``async-start`` wrappers).
"""

from __future__ import annotations

from dataclasses import dataclass

from collective_matmul.programs.hlo import EIGHT_BIT, Instruction, Module
from collective_matmul.programs.products import called

# Ops a value passes through unchanged on its way between a collective and a dot.
_THROUGH = ("copy", "convert", "bitcast", "reshape", "transpose")


@dataclass
class Gathered:
    collective: Instruction
    dim: int  # the gathered dimension, in the dot operand's coordinates
    ring: int


@dataclass
class Scattered:
    collective: Instruction
    kind: str  # reduce-scatter | all-reduce+dynamic-slice | all-reduce
    dim: int | None  # the scattered dimension of the dot's output
    ring: int


def dequantized(comp, inst: Instruction | None) -> str | None:
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


def gathered(module: Module, comp, inst: Instruction) -> Gathered | None:
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
            return Gathered(start, dim, ring)  # the start holds the replica groups
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


def through(comp, inst: Instruction) -> Instruction:
    """What ``inst`` is, past the ops a value passes unchanged."""
    for _ in range(16):
        if inst.opcode not in _THROUGH or not inst.operands or inst.operands[0] not in comp.instructions:
            return inst
        inst = comp.instructions[inst.operands[0]]
    return inst


def _forward_dim(op: Instruction, dim: int) -> int | None:
    """Where dimension ``dim`` of ``op``'s operand lands in its result (None: it does not survive)."""
    if op.opcode == "transpose":
        perm = list(op.ints("dimensions"))
        return perm.index(dim) if dim in perm else None
    return dim  # copy, convert, a reshape that keeps the shape


def scattered(module: Module, comp, dot: Instruction) -> Scattered | None:
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
                return Scattered(scatter, "reduce-scatter", dims[0] if dims else None, ring)
            if user.opcode in ("all-reduce", "all-reduce-start"):
                reduced = user
                groups = user.replica_groups(module.num_partitions)
                ring = len(groups[0]) if groups else 0
                index = list(user.operands).index(inst.name)
                for sliced in _slices(comp, reduced, index):
                    dims = [d for d, (a, b) in enumerate(zip(inst.shape.dims, sliced.shape.dims, strict=False))
                            if a != b]
                    if len(dims) == 1 and inst.shape.dims[dims[0]] == sliced.shape.dims[dims[0]] * ring:
                        return Scattered(user, "all-reduce+dynamic-slice", dims[0], ring)
                return Scattered(user, "all-reduce", None, ring)
            if user.opcode in ("copy", "convert") and user.shape.dims == inst.shape.dims:
                frontier.append(user)
    return None


def _wrapped(module: Module, inst: Instruction) -> Instruction | None:
    """The collective an ``async-start`` runs (the root of the computation it ``calls``), or None."""
    if inst.opcode != "async-start":
        return None
    body = module.computations.get(next(iter(called(inst)), ""))
    root = body.root if body is not None else None
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
