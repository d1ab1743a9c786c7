"""The matrix products of a partitioned or compiled module, in every form a backend prints them.

A ``dot``; a ``convolution`` that is a matmul (as XLA's TPU compiler writes dots); a cuBLAS/cuBLASLt GEMM custom
call; a fusion around one dot (a Triton GEMM, an output fusion).  Read by discovery
(`collective_matmul.programs.discovery`) and by the overlap verdict (`collective_matmul.programs.schedule`).  Pure
text: no JAX.
"""

from __future__ import annotations

import re

from collective_matmul.programs.hlo import Instruction, Module

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
             if inst.opcode == "fusion" for target in called(inst)}
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
        dims = convolution_as_dot(inst)
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
        body = module.computations.get(next(iter(called(inst)), ""))
        inner = [i for i in body.instructions.values() if i.opcode in ("dot", "convolution")] if body else []
        if len(inner) != 1:
            return None, None if not inner else None
        dot = inner[0]
        dims = _dims_of(dot) if dot.opcode == "dot" else convolution_as_dot(dot)
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
    if inst.opcode == "dot" or (inst.opcode == "convolution" and convolution_as_dot(inst) is not None):
        return True
    if inst.opcode == "custom-call":
        return any(f'"{t}"' in inst.attributes for t in _GEMM_TARGETS)
    if inst.opcode == "fusion" and depth < 8:
        body = module.computations.get(next(iter(called(inst)), ""))
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


def convolution_as_dot(conv: Instruction) -> dict[str, tuple[int, ...]] | None:
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
            nested = module.computations.get(next(iter(called(inst)), ""))
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


def called(inst: Instruction) -> list[str]:
    return re.findall(r"calls=%?([\w.\-]+)", inst.attributes)
