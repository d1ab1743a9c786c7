"""XLA's own windowed einsum: the loops its SPMD partitioner writes for a collective matmul, and the problem
each decomposes where its shapes say it."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from collective_matmul.planning.models import COLUMN
from collective_matmul.planning.problem import Collective
from collective_matmul.programs.discovery import flow
from collective_matmul.programs.hlo import Instruction, Module
from collective_matmul.programs.products import as_product
from collective_matmul.programs.roles import label, source_of


@dataclass
class XlaLoop:
    role: str
    what: str
    times: int
    computations: set[str]
    problem: object | None = None  # a Problem
    axis: str | None = None
    source: str = ""
    reason: str = ""


def xla_loops(module: Module, axes: Mapping[str, set[frozenset[int]]] | None = None) -> list[XlaLoop]:
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
            kind = Collective.ALLGATHER_MATMUL if "_ag" in body.name else \
                Collective.MATMUL_REDUCE_SCATTER if "_rs" in body.name else None
            permutes = [i for i in body.instructions.values() if i.opcode.startswith("collective-permute")
                        and not i.opcode.endswith("-done")]
            dots = _body_products(module, body)
            named = dots[0] if dots else inst  # the loop carries the product's metadata too
            frames = [(f.file, f.line) for f in module.stack(named.stack_frame_id)]
            role, source = label(named.op_name.rpartition("/")[0], frames), source_of(frames)
            what = (f"while {inst.name}: XLA's windowed einsum ({'gather' if kind == COLUMN else 'scatter'}), "
                    f"{len(permutes)} collective-permutes and {len(dots)} dots per step")
            loop = XlaLoop(role=role, what=what, times=times, source=source,
                            computations={body.name, inst.attribute("condition") or ""})
            loop.problem, loop.reason = _loop_problem(module, inst, body, kind, permutes, dots, Problem)
            caller = module.computations[name]
            init = caller.instructions.get(inst.operands[0]) if inst.operands else None
            eight = next((e for o in (init.operands if init is not None and init.opcode == "tuple" else ())
                          if (e := flow.dequantized(caller, caller.instructions.get(o)))), None)
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
