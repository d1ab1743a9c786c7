"""What one instruction of a compiled module costs on a hardware profile: products by a roofline, collectives by a
model of the links, everything else by the bytes it moves through memory.

The figures come from `collective_matmul.planning.costmodel.HardwareProfile` (published peaks, each with its
source):

- a product (a ``dot``, a ``convolution`` that is a matmul, a cuBLAS GEMM custom call, a fusion holding them):
  ``max(flops / (peak[dtype] * efficiency[dtype]), bytes / memory_bandwidth)``;
- an all-gather or reduce-scatter over a group of ``P`` devices, as a ring: ``op_s + (P-1) * latency_s +
  bytes * (P-1)/P / (links * link_bytes_per_s)``, ``bytes`` the gathered (scattered) whole, ``links`` the links
  into a device along the ring (two on a torus axis with wraparound, one on a line or behind a switch); an
  all-reduce is a reduce-scatter and an all-gather; an all-to-all moves ``(P-1)/P`` of its bytes over one link;
- a collective-permute: ``op_s + latency_s + bytes / link_bytes_per_s`` (one block over one link);
- any other instruction: the bytes it reads and writes over the memory bandwidth (a slice reads what it keeps,
  an update in place writes what it updates; bitcasts, tuples and parameters are free); a fusion holding a
  collective is that collective (XLA's TPU compiler fuses a reduce-scatter as an all-reduce each device slices).

A custom call that is no GEMM is a kernel nothing here can see into: it costs nothing and is reported unpriced.
Pure text and numbers: no JAX.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from collective_matmul.planning.costmodel import HardwareProfile
from collective_matmul.programs.hlo import Computation, Instruction, Module, Shape
from collective_matmul.programs.products import as_product, called, convolution_as_dot

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all",
               "collective-broadcast", "ragged-all-to-all")
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id",
                  "after-all", "opt-barrier", "add-dependency", "iota", "domain", "async-update"})
# custom calls that move no data (layout and sharding markers)
FREE_TARGETS = ("ConcatBitcast", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "AllocateBuffer",
                "LayoutConstraint")


def nbytes(shape: Shape) -> float:
    """The bytes of an array (or a tuple's arrays): a dtype's bits from its name (``bf16``: 16, ``pred``: 8)."""
    if shape.is_tuple:
        return sum(nbytes(element) for element in shape.elements)
    if shape.dtype == "pred":
        bits = 8
    else:
        match = re.search(r"\d+", shape.dtype)
        if match is None:
            return 0.0  # token[], opaque: no data
        bits = int(match.group(0))
    return math.prod(shape.dims) * bits / 8


@dataclass(frozen=True)
class Cost:
    """One instruction's seconds, and which part of the program they are."""

    seconds: float
    kind: str  # "product", "memory", "comm", "free" or "unpriced"


class Pricer:
    """The costs of ``module``'s instructions on ``profile``."""

    def __init__(self, module: Module, profile: HardwareProfile):
        self.module, self.profile = module, profile

    def instruction(self, comp: Computation, inst: Instruction) -> Cost:
        """What ``inst`` costs where it runs synchronously (its wrapped collective, for an async start)."""
        op = inst.opcode
        if op in FREE:
            return Cost(0.0, "free")
        base = op.removesuffix("-start")
        if base in COLLECTIVES:
            return Cost(self.collective(comp, inst, base), "comm")
        if op == "async-start":
            wrapped = self._wrapped(inst)
            if wrapped is not None and wrapped.opcode in COLLECTIVES:
                body = self.module.computations[wrapped.computation]
                return Cost(self.collective(body, wrapped, wrapped.opcode), "comm")
            if wrapped is not None:
                return self.instruction(self.module.computations[wrapped.computation], wrapped)
            return Cost(0.0, "unpriced")
        if op == "custom-call":
            if any(f'"{t}"' in inst.attributes for t in FREE_TARGETS):
                return Cost(0.0, "free")
            product, _ = as_product(self.module, comp, inst)
            if product is None:
                return Cost(0.0, "unpriced")
            return Cost(self.roofline(self._dot_flops(comp, product), self._moved(comp, inst), product, comp),
                        "product")
        if op == "fusion":
            fused = self._fused_collectives(inst)
            if fused is not None:
                return Cost(fused, "comm")
            flops, dtype = self._fused_flops(inst)
            moved = self._moved(comp, inst)
            if flops:
                return Cost(self.roofline(flops, moved, dtype=dtype), "product")
            return Cost(moved / self.profile.memory_bytes_per_s, "memory")
        if op in ("dot", "convolution"):
            dims = inst.ints("lhs_contracting_dims") if op == "dot" else None
            if op == "convolution":
                conv = convolution_as_dot(inst)
                if conv is None:
                    return Cost(0.0, "unpriced")  # a real convolution: no model of its own here
                dims = conv["lhs_contracting_dims"]
            lhs = comp.instructions.get(inst.operands[0]) if inst.operands else None
            flops = _flops(inst.shape, lhs.shape if lhs else None, dims)
            return Cost(self.roofline(flops, self._moved(comp, inst), dtype=_dtype(lhs)), "product")
        if op in ("while", "call", "conditional"):
            return Cost(0.0, "free")  # replayed through their computations
        return Cost(self._moved(comp, inst) / self.profile.memory_bytes_per_s, "memory")

    def roofline(self, flops: float, moved: float, product: Instruction | None = None, comp=None,
                 dtype: str | None = None) -> float:
        """``max(flops / (peak * efficiency), bytes / memory bandwidth)`` at the product's dtype."""
        if dtype is None and product is not None and comp is not None:
            dtype = _dtype(comp.instructions.get(product.operands[0]))
        profile = self.profile
        peak = profile.flops_per_s.get(dtype or "") or max(profile.flops_per_s.values())
        efficiency = profile.matmul_efficiency.get(dtype or "", 1.0)
        return max(flops / (peak * efficiency), moved / profile.memory_bytes_per_s)

    def collective(self, comp: Computation, inst: Instruction, kind: str) -> float:
        """Seconds of one collective of ``kind`` on its replica groups, by the link model."""
        profile = self.profile
        groups = inst.replica_groups(self.module.num_partitions)
        size = max((len(g) for g in groups), default=1) if groups else self.module.num_partitions
        # a combined collective (several operands, a tuple result) moves them all
        result = nbytes(_result(inst)) if inst.opcode.endswith("-start") else nbytes(inst.shape)
        if kind == "collective-permute":
            return profile.op_s + profile.latency_s + result / profile.link_bytes_per_s
        if size <= 1:
            return 0.0
        operands = [comp.instructions[o].shape for o in inst.operands if o in comp.instructions]
        whole = result if kind == "all-gather" or not operands else sum(nbytes(s) for s in operands)
        bandwidth = self.links(size) * profile.link_bytes_per_s
        ring = profile.op_s + (size - 1) * profile.latency_s + whole * (size - 1) / size / bandwidth
        if kind == "all-reduce":
            return 2 * ring - profile.op_s
        if kind in ("all-to-all", "ragged-all-to-all"):
            return profile.op_s + profile.latency_s + whole * (size - 1) / size / profile.link_bytes_per_s
        return ring

    def links(self, size: int) -> int:
        """Links into a device along a ring of ``size``: two where the ring's ends are linked (a torus axis), one
        on a line (its ends) or behind a switch (`HardwareProfile.wraparound_from`)."""
        wrap = self.profile.wraparound_from
        return 2 if wrap is not None and size >= wrap else 1

    def _wrapped(self, inst: Instruction) -> Instruction | None:
        body = self.module.computations.get(next(iter(called(inst)), ""))
        if body is None:
            return None
        return next((i for i in body.instructions.values() if i.opcode not in FREE), body.root)

    def _fused_collectives(self, fusion: Instruction) -> float | None:
        """The collectives a fusion holds (XLA's TPU compiler fuses a reduce-scatter as an all-reduce whose result
        each device slices: priced as the reduce-scatter it is), or None when it holds none."""
        body = self.module.computations.get(next(iter(called(fusion)), ""))
        if body is None:
            return None
        found = [i for i in body.instructions.values() if i.opcode in COLLECTIVES]
        if not found:
            return None
        total = 0.0
        for inst in found:
            sliced = any(u.opcode == "dynamic-slice" for u in body.users.get(inst.name, ()))
            kind = "reduce-scatter" if inst.opcode == "all-reduce" and sliced else inst.opcode
            total += self.collective(body, inst, kind)
        return total

    def _fused_flops(self, fusion: Instruction, depth: int = 0) -> tuple[float, str | None]:
        body = self.module.computations.get(next(iter(called(fusion)), ""))
        if body is None or depth > 8:
            return 0.0, None
        flops, dtype = 0.0, None
        for inst in body.instructions.values():
            if inst.opcode == "fusion":
                inner, inner_dtype = self._fused_flops(inst, depth + 1)
                flops, dtype = flops + inner, dtype or inner_dtype
            elif inst.opcode in ("dot", "convolution"):
                dims = inst.ints("lhs_contracting_dims") if inst.opcode == "dot" else None
                if inst.opcode == "convolution":
                    conv = convolution_as_dot(inst)
                    dims = conv["lhs_contracting_dims"] if conv else None
                lhs = body.instructions.get(inst.operands[0]) if inst.operands else None
                if dims is not None and lhs is not None:
                    flops += _flops(inst.shape, lhs.shape, dims)
                    dtype = dtype or _dtype(lhs)
        return flops, dtype

    def _dot_flops(self, comp: Computation, product: Instruction) -> float:
        lhs = comp.instructions.get(product.operands[0]) if product.operands else None
        return _flops(product.shape, lhs.shape if lhs else None, product.ints("lhs_contracting_dims"))

    def _moved(self, comp: Computation, inst: Instruction) -> float:
        """Bytes ``inst`` reads and writes (a GEMM's workspace and a fusion's untouched buffers left out)."""
        if inst.opcode.endswith("-start"):  # an asynchronous copy or slice: what it copies, read and written
            return 2 * nbytes(_result(inst))
        out = _result(inst) if inst.opcode == "custom-call" else inst.shape
        operands = [comp.instructions[o].shape for o in inst.operands if o in comp.instructions]
        root = inst
        if inst.opcode == "fusion":
            body = self.module.computations.get(next(iter(called(inst)), ""))
            root = body.root if body is not None and body.root is not None else inst
        if root.opcode in ("dynamic-update-slice", "scatter"):  # in place: the update is read and written
            body = self.module.computations.get(root.computation)
            update = body.instructions.get(root.operands[1]) if body and len(root.operands) > 1 else None
            size = nbytes(update.shape) if update is not None else 0.0
            return 2 * size + sum(nbytes(s) for s in operands if nbytes(s) < nbytes(out))
        if inst.opcode in ("slice", "dynamic-slice", "gather", "copy", "transpose"):
            return 2 * nbytes(out)
        return nbytes(out) + sum(nbytes(s) for s in operands)


def _result(inst: Instruction) -> Shape:
    """An instruction's value: a GEMM's or an async start's tuple reduced to its result."""
    shape = inst.shape
    if shape.is_tuple and shape.elements:
        if inst.opcode.endswith("-start") and len(shape.elements) >= 2:
            return shape.elements[1]  # (operands, result[, context]) of an asynchronous collective
        return shape.elements[0]
    return shape


def _flops(out: Shape, lhs: Shape | None, contracting) -> float:
    if lhs is None or not lhs.dims:
        return 0.0
    depth = math.prod(lhs.dims[d] for d in contracting if d < len(lhs.dims)) if contracting else 1
    return 2.0 * math.prod(_result_shape(out).dims) * depth


def _result_shape(shape: Shape) -> Shape:
    return shape.elements[0] if shape.is_tuple and shape.elements else shape


def _dtype(inst: Instruction | None) -> str | None:
    return _result_shape(inst.shape).dtype_name if inst is not None else None
