"""A reader for HLO module text: instructions, the call graph, loop trip counts and stack frames.

Just enough of the HLO text format to find collective matmuls in a partitioned module
(`collective_matmul.programs.discovery`): each instruction's shape, opcode, operands and attributes, which
computations a ``while`` runs how often, the replica groups of a collective in every format XLA
prints (explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]``, and mesh axes ``mesh['axis_0'=2,...]
{'axis_1'}``), and the stack frames of an instruction's metadata.  Pure text: no JAX.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "s64": "int64", "s32": "int32",
          "s16": "int16", "s8": "int8", "s4": "int4", "u64": "uint64", "u32": "uint32", "u16": "uint16", "u8": "uint8",
          "u4": "uint4", "pred": "bool", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
          "f8e4m3fnuz": "float8_e4m3fnuz", "f8e5m2fnuz": "float8_e5m2fnuz", "f8e4m3b11fnuz": "float8_e4m3b11fnuz",
          "f8e4m3": "float8_e4m3", "f8e3m4": "float8_e3m4", "f4e2m1fn": "float4_e2m1fn"}
EIGHT_BIT = frozenset(k for k in DTYPES if k.startswith(("f8", "f4", "s8", "u8", "s4", "u4")))

_ARRAY = re.compile(r"(\w+)\[([^\]]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")
_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


@dataclass(frozen=True)
class Shape:
    """An array shape (``dtype`` as HLO spells it, e.g. ``f32``) or, with ``elements``, a tuple."""

    dtype: str
    dims: tuple[int, ...] = ()
    elements: tuple[Shape, ...] = ()

    @property
    def is_tuple(self) -> bool:
        return self.dtype == "tuple"

    @property
    def dtype_name(self) -> str | None:
        """The dtype as numpy names it (``float32``), or None for one cmtune does not know."""
        return DTYPES.get(self.dtype)

    @classmethod
    def parse(cls, text: str) -> Shape:
        text = re.sub(r"/\*.*?\*/", "", text).strip()
        if text.startswith("("):
            inner = text[1 : _closing(text, 0)]
            return cls("tuple", elements=tuple(cls.parse(part) for part in _split_top(inner) if part.strip()))
        match = _ARRAY.match(text)
        if match is None:  # token[], opaque types: a scalar of that type
            return cls(text.split("{")[0])
        dims = tuple(int(d.lstrip("<=")) for d in match.group(2).split(",") if d.strip())
        return cls(match.group(1), dims)


@dataclass
class Instruction:
    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...]
    attributes: str  # the text after the operands: key=value pairs, metadata, backend config
    computation: str
    is_root: bool = False
    args: str = ""  # the text inside the parentheses (a constant's literal)

    @cached_property
    def op_name(self) -> str:
        match = _OP_NAME.search(self.attributes)
        return match.group(1).replace('\\"', '"') if match else ""

    @cached_property
    def stack_frame_id(self) -> int | None:
        match = _FRAME_ID.search(self.attributes)
        return int(match.group(1)) if match else None

    def ints(self, key: str) -> tuple[int, ...]:
        """An attribute such as ``dimensions={1}`` or ``lhs_contracting_dims={0,1}`` as integers."""
        match = re.search(rf"(?<![\w]){re.escape(key)}=\{{([\d,\s]*)\}}", self.attributes)
        if match is None:
            return ()
        return tuple(int(v) for v in match.group(1).split(",") if v.strip())

    def attribute(self, key: str) -> str | None:
        """A plain ``key=value`` attribute (``direction=LT``, ``index=0``, ``body=%b``)."""
        match = re.search(rf"(?<![\w]){re.escape(key)}=%?([\w.\-]+)", self.attributes)
        return match.group(1) if match else None

    def replica_groups(self, num_partitions: int) -> list[tuple[int, ...]] | None:
        """The groups of partition ids this collective runs over (None if the format is unknown)."""
        return replica_groups(self.attributes, num_partitions)


@dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: dict[str, Instruction] = field(default_factory=dict)

    @cached_property
    def users(self) -> dict[str, list[Instruction]]:
        found: dict[str, list[Instruction]] = {}
        for inst in self.instructions.values():
            for operand in inst.operands:
                found.setdefault(operand, []).append(inst)
        return found

    @property
    def root(self) -> Instruction | None:
        return next((i for i in self.instructions.values() if i.is_root), None)


@dataclass(frozen=True)
class Frame:
    file: str
    function: str
    line: int


@dataclass
class Module:
    """A parsed HLO module."""

    name: str
    num_partitions: int
    computations: dict[str, Computation]
    frames: dict[int, tuple[Frame, int | None]]  # stack frame id -> (its frame, its parent's id)

    @property
    def entry(self) -> Computation:
        return next(c for c in self.computations.values() if c.is_entry)

    def stack(self, frame_id: int | None) -> list[Frame]:
        """The frames of a stack, innermost first."""
        out, seen = [], set()
        while frame_id is not None and frame_id in self.frames and frame_id not in seen:
            seen.add(frame_id)
            frame, frame_id = self.frames[frame_id]
            out.append(frame)
        return out

    @cached_property
    def executions(self) -> dict[str, tuple[int, bool]]:
        """How often each computation runs per execution of the module, and whether that is exact
        (False when a loop's trip count could not be read, or a conditional may skip a branch)."""
        counts: dict[str, tuple[int, bool]] = {}

        def visit(name: str, times: int, exact: bool, depth: int = 0) -> None:
            if name not in self.computations or depth > 64:
                return
            old = counts.get(name, (0, True))
            counts[name] = (old[0] + times, old[1] and exact)
            for inst in self.computations[name].instructions.values():
                if inst.opcode == "while":
                    trips = self.trip_count(inst)
                    body = inst.attribute("body")
                    if body:
                        visit(body, times * (1 if trips is None else trips), exact and trips is not None, depth + 1)
                    continue
                called = re.findall(r"(?:calls|true_computation|false_computation)=%?([\w.\-]+)", inst.attributes)
                if inst.opcode == "call":  # a call names its computation to_apply (a reducer's field elsewhere)
                    called += re.findall(r"to_apply=%?([\w.\-]+)", inst.attributes)
                branches = re.search(r"branch_computations=\{([^}]*)\}", inst.attributes)
                for target in called:
                    visit(target, times, exact and inst.opcode != "conditional", depth + 1)
                if branches:
                    for target in _OPERAND.findall(branches.group(1)):
                        visit(target, times, False, depth + 1)

        visit(self.entry.name, 1, True)
        return counts

    def trip_count(self, loop: Instruction) -> int | None:
        """A ``while`` loop's trip count: XLA's annotation, else ``i < N`` in its condition with
        ``i`` starting from a constant (how JAX lowers ``scan`` and ``fori_loop``); None if unknown."""
        known = _TRIP_COUNT.search(loop.attributes)
        if known:
            return int(known.group(1))
        cond = self.computations.get(loop.attribute("condition") or "")
        root = cond.root if cond else None
        if cond is None or root is None or root.opcode != "compare" or len(root.operands) != 2:
            return None
        direction = root.attribute("direction")
        a, b = (cond.instructions.get(o) for o in root.operands)
        if direction == "GT":
            a, b, direction = b, a, "LT"
        if direction != "LT" or a is None or b is None or b.opcode != "constant" or a.opcode != "get-tuple-element":
            return None
        limit, index = _constant(b), a.attribute("index")
        init = self.computations[loop.computation].instructions.get(loop.operands[0]) if loop.operands else None
        if limit is None or index is None or init is None or init.opcode != "tuple":
            return None
        outer = self.computations[loop.computation].instructions
        start_inst = outer.get(init.operands[int(index)])
        while start_inst is not None and start_inst.opcode == "copy" and start_inst.operands:  # TPU copies it first
            start_inst = outer.get(start_inst.operands[0])
        start = _constant(start_inst) if start_inst is not None and start_inst.opcode == "constant" else None
        return None if start is None else max(limit - start, 0)


def parse_module(text: str) -> Module:
    """Parse HLO module text (as ``Compiled.as_text()`` prints it, an XLA dump file, or a test's module).

    Both spellings XLA prints are read: ``%name`` with typed operands (``f32[2]{0} %a``) and the short form
    (bare names, ``ENTRY main {`` without a signature); an instruction or a header that continues on the
    next lines (a long backend config) is joined first.

    Raises:
        ValueError: if the text holds no computation.
    """
    name, partitions = "module", 1
    computations: dict[str, Computation] = {}
    tables: dict[str, dict[int, str]] = {}
    section: str | None = None
    current: Computation | None = None
    for stripped in _logical_lines(text):
        if stripped.startswith("HloModule"):
            name = stripped.split()[1].rstrip(",")
            match = re.search(r"num_partitions=(\d+)", stripped)
            partitions = int(match.group(1)) if match else 1
            continue
        if current is None and stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = stripped
            tables[section] = {}
            continue
        if current is None and section and re.match(r"^\d+\s", stripped):
            key, _, value = stripped.partition(" ")
            tables[section][int(key)] = value.strip()
            continue
        match = _COMPUTATION.match(stripped)
        if current is None and match:
            section = None
            current = Computation(match.group(2), bool(match.group(1)))
            computations[current.name] = current
            continue
        if current is not None and stripped == "}":
            current = None
            continue
        if current is not None:
            inst = _instruction(stripped, current.name)
            if inst is not None:
                current.instructions[inst.name] = inst
    if not computations:
        raise ValueError("not an HLO module: no computation found")
    for comp in computations.values():
        _tuple_elements(comp)
    if not any(c.is_entry for c in computations.values()):  # a module of one computation, or ENTRY not marked
        last = list(computations.values())[-1]
        last.is_entry = True
    return Module(name, partitions, computations, _frames(tables))


def _logical_lines(text: str):
    """The module's lines, stripped, with a line whose brackets do not close (outside quotes) joined to the next
    until they do; a computation's header (ending in an open ``{``) and its closing ``}`` stay lines of their own."""
    pending: list[str] = []
    for line in text.splitlines():
        stripped = re.sub(r"\s*//.*$", "", line).strip() if "//" in line and '"' not in line else line.strip()
        if not stripped:
            continue
        if not pending and (stripped == "}" or _COMPUTATION.match(stripped)):
            yield stripped
            continue
        pending.append(stripped)
        joined = " ".join(pending)
        if _balanced(joined) and not joined.endswith(","):  # attributes may go on after a trailing comma
            pending.clear()
            yield joined
    if pending:
        yield " ".join(pending)


def _balanced(text: str) -> bool:
    """Whether every bracket opened in ``text`` (outside quotes) is closed."""
    depth, quote = 0, None
    for i, c in enumerate(text):
        if quote:
            if c == quote and text[i - 1] != "\\":
                quote = None
            continue
        if c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
    return depth <= 0


_NO_OPERANDS = ("constant", "parameter", "iota", "partition-id", "replica-id", "rng-get-and-update-state")


def _instruction(line: str, computation: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    root, name, rest = bool(match.group(1)), match.group(2), match.group(3)
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape_text, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape_text, _, rest = rest.partition(" ")
        while not _balanced(shape_text) and rest:  # dimensions or a layout with spaces: f32[32, 32]
            more, _, rest = rest.partition(" ")
            shape_text += " " + more
    opcode_match = re.match(r"([\w\-]+)\(", rest)
    if opcode_match is None:
        return None
    opcode = opcode_match.group(1)
    start = opcode_match.end() - 1
    end = _closing(rest, start)
    inside = rest[start + 1 : end]
    operands = () if opcode in _NO_OPERANDS else tuple(_operand_name(part) for part in _split_top(inside)
                                                       if part.strip())
    return Instruction(name, opcode, Shape.parse(shape_text), operands, rest[end + 1 :].lstrip(", "), computation,
                       root, inside)


def _tuple_elements(comp: Computation) -> None:
    """Newer XLA writes an element of a tuple operand in place (``compare(%param.1#0, ...)``, no
    ``get-tuple-element``): each such operand becomes the get-tuple-element it stands for, named as written."""
    for inst in list(comp.instructions.values()):
        for operand in inst.operands:
            match = re.fullmatch(r"(.+)#(\d+)", operand)
            if match is None or operand in comp.instructions:
                continue
            source, index = match.group(1), int(match.group(2))
            whole = comp.instructions.get(source)
            elements = whole.shape.elements if whole is not None else ()
            shape = elements[index] if index < len(elements) else Shape("unknown")
            comp.instructions[operand] = Instruction(operand, "get-tuple-element", shape, (source,), f"index={index}",
                                                     comp.name, args=source)


def _operand_name(part: str) -> str:
    """An operand as the instruction names it: ``f32[2]{0} %a``, ``%a`` or ``a`` are all ``a``."""
    return re.sub(r"/\*.*?\*/", "", part).strip().split()[-1].lstrip("%")


def _frames(tables: dict[str, dict[int, str]]) -> dict[int, tuple[Frame, int | None]]:
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations = {}
    for key, value in tables.get("FileLocations", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", value))
        locations[key] = Frame(files.get(int(fields.get("file_name_id", 0)), "?"),
                               functions.get(int(fields.get("function_name_id", 0)), "?"), int(fields.get("line", 0)))
    frames = {}
    for key, value in tables.get("StackFrames", {}).items():
        fields = dict(re.findall(r"(\w+)=(\d+)", value))
        location = locations.get(int(fields.get("file_location_id", 0)))
        if location is None:
            continue
        # XLA prints a frame's parent as its 1-based id plus one (1: no parent)
        parent = int(fields.get("parent_frame_id", 0)) - 1
        frames[key] = (location, parent if parent >= 1 else None)
    return frames


def replica_groups(attributes: str, num_partitions: int) -> list[tuple[int, ...]] | None:
    """The replica groups in a collective's attributes, as tuples of partition ids."""
    mesh = _MESH_GROUPS.search(attributes)
    if mesh:
        axes = [(n, int(s)) for n, s in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))]
        size = math.prod(s for _, s in axes)
        devices = _iota_devices(mesh.group(2), size) if mesh.group(2) else np.arange(size)
        if devices is None:
            return None
        grid = devices.reshape([s for _, s in axes])
        chosen = [i for i, (n, _) in enumerate(axes) if f"'{n}'" in mesh.group(3)]
        rest = [i for i in range(len(axes)) if i not in chosen]
        groups = np.transpose(grid, rest + chosen).reshape(-1, math.prod(axes[i][1] for i in chosen) if chosen else 1)
        return [tuple(int(v) for v in g) for g in groups]
    match = re.search(r"replica_groups=(\{[^=]*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attributes)
    if match is None:
        return None
    text = match.group(1)
    if text == "{}":
        return [tuple(range(num_partitions))]
    if text.startswith("{"):
        return [tuple(int(v) for v in g.split(",") if v.strip()) for g in re.findall(r"\{([\d,\s]+)\}", text)]
    iota = _IOTA.fullmatch(text)
    if iota is None:
        return None
    shape = [int(v) for v in iota.group(1).split(",")]
    devices = _iota_devices(text[text.index("<=") + 2 :], math.prod(shape))
    return None if devices is None else [tuple(int(v) for v in g) for g in devices.reshape(shape[0], -1)]


def _iota_devices(text: str, size: int) -> np.ndarray | None:
    """``[2,4]T(1,0)`` (or ``[8]``): the flattened device order of an iota list."""
    match = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if match is None:
        return None
    dims = [int(v) for v in match.group(1).split(",")]
    if math.prod(dims) != size:
        return None
    grid = np.arange(size).reshape(dims)
    if match.group(2):
        grid = np.transpose(grid, [int(v) for v in match.group(2).split(",")])
    return grid.reshape(-1)


def _constant(inst: Instruction) -> int | None:
    try:
        return int(inst.args.strip())
    except ValueError:
        return None


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at ``start``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, quote = 0, False
    for i in range(start, len(text)):
        c = text[i]
        if c == '"' and text[i - 1] != "\\":
            quote = not quote
        if quote:
            continue
        if c in pairs:
            depth += 1
        elif c in pairs.values():
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts
