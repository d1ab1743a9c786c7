"""The scan: a partitioned module's text in, the step's collective matmuls out (no JAX).

Every product of the module is read by the rules (`collective_matmul.programs.discovery.rules`), the forward
first, its backward's products as evidence of the slots it computes; XLA's windowed-einsum loops are read as
their loops (`collective_matmul.programs.discovery.loops`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping

import numpy as np

from collective_matmul.planning.models import COLUMN, SLOTS, Role, rings, slot_problems
from collective_matmul.programs.discovery import flow
from collective_matmul.programs.discovery.loops import xla_loops
from collective_matmul.programs.discovery.records import Discovery, SkippedCollective, XlaDecomposed
from collective_matmul.programs.discovery.rules import Product, Skip, finding
from collective_matmul.programs.discovery.tally import Tally
from collective_matmul.programs.hlo import Computation, Instruction, Module, parse_module
from collective_matmul.programs.products import convolution_as_dot, products
from collective_matmul.programs.roles import group_label, label, source_of, transforms
from collective_matmul.wire import StepProblem


def scan(module: Module | str, mesh: Mapping[str, int] | None = None) -> Discovery:
    """The collective matmuls of a partitioned module (see the package `collective_matmul.programs.discovery`).

    Args:
        module: a parsed `Module` or HLO text (after SPMD partitioning, or an optimized module).
        mesh: the mesh's axis sizes in order, to name each ring's axis (partition ids run over
            the mesh's devices in order).
    """
    if isinstance(module, str):
        module = parse_module(module)
    axes = _axis_groups(mesh) if mesh else {}
    tally = Tally()
    warnings: list[str] = []
    loops = xla_loops(module, axes)
    in_loops = {c for loop in loops for c in loop.computations}
    dots = [(dot, times) for dot, times in products(module, warnings)
            if dot.computation not in in_loops  # XLA's windowed einsum: read as its loop, below
            and "rematted_computation" not in dot.op_name]  # remat's recompute: counted once
    for backward in (False, True):  # the forward first: a weight gradient is known by its weight's shape
        for dot, times in dots:
            if in_backward(dot) == backward:
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


def in_backward(dot: Instruction) -> bool:
    """Whether JAX's autodiff emitted ``dot`` for the backward pass: its name stack runs under ``transpose``.

    The module's structure cannot say it.  Forward and backward are one dataflow graph in which the residuals and
    cotangents a backward product reads are values like any other: an input gradient reads the forward's weight
    as the forward does, a weight gradient is a product of two activations as attention's are, and a square
    weight leaves even their shapes alike.  Nor does JAX mark the pass in the program beyond the name stack: its
    backward pass (`jax._src.interpreters.ad`) runs every transposed equation under the ``transpose`` transform,
    and the lowering writes that name stack into each instruction's ``op_name``, which XLA's passes carry to the
    products they rewrite (a jaxpr's equations hold the same name stack, no more).  So the ``op_name`` is read as
    a name stack, its transforms (`collective_matmul.programs.roles.transforms`); the fallback, for one whose
    parentheses do not balance (not a name stack JAX wrote), is the plain text test for ``transpose(``.
    """
    found = transforms(dot.op_name.rpartition("/")[0])
    return "transpose(" in dot.op_name if found is None else "transpose" in found


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


def _gathered_convolutions(module: Module, tally: Tally) -> None:
    """Skip, with the reason, every gathered operand of a convolution that is not a matmul (spatial windows,
    dilations, groups): XLA's collective feeds it, and no silence hides that."""
    for comp, conv, times in _executed(module):
        if conv.opcode != "convolution" or convolution_as_dot(conv) is not None:
            continue
        for operand in conv.operands[:2]:
            inst = comp.instructions.get(operand)
            gathered = flow.gathered(module, comp, inst) if inst is not None else None
            if gathered is None:
                continue
            frames = [(f.file, f.line) for f in module.stack(conv.stack_frame_id)]
            window = re.search(r"window=\{([^}]*)\}", conv.attributes)
            tally.skip(label(conv.op_name.rpartition("/")[0], frames),
                       f"{gathered.collective.opcode} {gathered.collective.name} -> {conv.name}",
                       "a convolution that is not a matrix product"
                       + (f" (window {{{window.group(1)}}})" if window else " (feature or batch groups)")
                       + ": not a collective matmul cmtune decomposes", times)


def _summed_input_gradient(roles: list[Role], tally: Tally) -> StepProblem | None:
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


def _classify(module: Module, dot: Instruction, times: int, axes: dict, tally: Tally, *, backward: bool) -> None:
    """Tally one dot: a forward collective matmul, a skipped collective, or backward evidence."""
    product = Product.of(module, dot)
    if product is None:
        return
    frames = [(f.file, f.line) for f in module.stack(dot.stack_frame_id)]
    role = label(dot.op_name.rpartition("/")[0], frames)  # the op_name without its primitive
    if backward:
        _backward_evidence(product, role, tally)
        return
    if product.projection:
        tally.weights.setdefault(role, []).append(product.rhs.shape.dims)
    found = finding(product, axes)
    if isinstance(found, Skip):
        tally.skip(role, found.what, found.reason, times)
    elif found is not None:
        tally.found(role, found.slots, times, found.axis, source_of(frames))
        if found.collective == COLUMN:  # the products one gathered activation feeds: one group
            tally.read(role, module, dot.computation, product.gathered_lhs.collective)


def _backward_evidence(product: Product, role: str, tally: Tally) -> None:
    """Which gradients a role's backward computes: dy times its weight, or activations contracted to its shape."""
    weights = tally.weights.get(role, ())
    if any(operand.shape.dims in weights for operand in (product.lhs, product.rhs)):
        tally.backward.setdefault(role, set()).add("grad_input")
    elif any(sorted(product.dot.shape.dims) == sorted(w) for w in weights):
        tally.backward.setdefault(role, set()).add("grad_weight")


def _axis_groups(mesh: Mapping[str, int]) -> dict[str, set[frozenset[int]]]:
    """For each mesh axis, the groups of partition ids that run along it."""
    grid = np.arange(math.prod(mesh.values())).reshape(list(mesh.values()))
    return {name: {frozenset(int(v) for v in row) for row in rings(grid, i)} for i, name in enumerate(mesh)}
