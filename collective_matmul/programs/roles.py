"""Role labels: one rule names a projection, for discovery (from a compiled module) and for the drop-in.

A role is where a collective matmul occurs in a step.  The reference block names its four
(``qkv``, ``attn_out``, ``mlp_up``, ``mlp_down``); a user's projection is named by the rule here,
from what JAX records of the call:

1. the scopes it runs under — Flax linen's module path (``Model/layers/up``) or the user's
   `jax.named_scope` — with JAX's own structure left out: transforms (``jvp(...)``,
   ``transpose(...)``), jitted functions (``jit(step)``), loop bodies, remat, einsum specs;
2. if no scope is left (NNX in Flax 0.12, plain JAX without named scopes), the source location
   of the call: the innermost frame outside JAX, Flax, Optax and cmtune, as ``file.py:LINE``.

Discovery reads the scopes from a dot's ``op_name`` and the frames from the module's stack
frames; the drop-in reads JAX's name stack and the Python frames at trace time.  Inside a
traced function such as a remat or scan body JAX's name stack starts afresh, so the drop-in may
see only the end of the path discovery sees (``layers/up`` for ``Model/layers/up``): two labels
`agree` when one's scopes end the other's.  Pure text: no JAX at import.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Sequence
from functools import cache

from collective_matmul.planning.models import MAX_ROLE_LENGTH
from collective_matmul.planning.text import as_label

# Names JAX gives its own structure in a name stack (never a user's scope).
STRUCTURAL = frozenset({
    "while", "body", "cond", "closed_call", "core_call", "checkpoint", "rematted_computation", "remat", "remat2",
    "scan", "shard_map", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "pjit", "xla_call",
    "named_call", "branch", "cond_branch", "fori_loop", "map", "dot_general", "eval_jaxpr", "",
})
# Transforms whose parentheses hold a function's name, not scopes.
_NAMED_FUNCTIONS = frozenset({"jit", "pjit", "xla_pmap", "pmap"})
# Packages whose frames are never the source of a user's projection.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "chex", "orbax", "collective_matmul", "cmtune")


def scopes(name_stack: str) -> list[str]:
    """The user's scopes in a name stack such as ``jit(step)/transpose(jvp(Model))/while/body/layers/up``."""
    out: list[str] = []
    for part in _split(name_stack):
        match = re.fullmatch(r"([\w.\-]+)\((.*)\)", part, flags=re.S)
        if match:
            inner = [] if match.group(1) in _NAMED_FUNCTIONS else scopes(match.group(2))
            # a transformed function's scopes come again inside it (``transpose(jvp(Model))/jvp(Model)/...``)
            if inner and out[len(out) - len(inner):] != inner:
                out.extend(inner)
            continue
        if part in STRUCTURAL or re.fullmatch(r"branch_\d+(_fun)?", part) or "->" in part or part.startswith("("):
            continue
        out.append(part)
    return out


def transforms(name_stack: str) -> list[str] | None:
    """The JAX transforms a name stack runs under, outermost first: ``["jit", "transpose", "jvp"]`` for
    ``jit(step)/transpose(jvp(Model))/layers/up`` (a jitted function's name is not one).  None where the
    parentheses do not balance: not a name stack JAX wrote."""
    depth = 0
    for c in name_stack:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return None
    if depth:
        return None
    out: list[str] = []
    for part in _split(name_stack):
        match = re.fullmatch(r"([\w.\-]+)\((.*)\)", part, flags=re.S)
        if match:
            out.append(match.group(1))
            if match.group(1) not in _NAMED_FUNCTIONS:
                out.extend(transforms(match.group(2)) or ())
    return out


def label(name_stack: str, frames: Iterable[tuple[str, int]] = ()) -> str:
    """The role of a call: its scopes joined by ``/``, else ``file.py:LINE`` of its innermost user frame.

    Args:
        name_stack: JAX's name stack of the call (for a compiled dot: its ``op_name`` without the
            trailing primitive name).
        frames: ``(file, line)`` of the call's stack, innermost first.
    """
    found = scopes(name_stack)
    text = "/".join(found) if found else source_of(frames) or "unlabelled"
    text = as_label(text)
    return text if len(text) <= MAX_ROLE_LENGTH else "…" + text[-(MAX_ROLE_LENGTH - 1):]


def source_of(frames: Iterable[tuple[str, int]]) -> str:
    """``file.py:LINE`` of the innermost frame outside JAX, Flax, Optax and cmtune ("" if none)."""
    return next((as_label(f"{os.path.basename(f)}:{line}") for f, line in frames if not is_library(f)), "")


def agree(a: str, b: str) -> bool:
    """True if two labels name the same call: equal, or one's scopes end the other's (see the module)."""
    if a == b:
        return True
    if ":" in a.rpartition("/")[2] or ":" in b.rpartition("/")[2]:  # source locations: equal only
        return False
    pa, pb = a.split("/"), b.split("/")
    short, long = (pa, pb) if len(pa) <= len(pb) else (pb, pa)
    return long[len(long) - len(short):] == short


def match(found: str, known: Sequence[str]) -> str | None:
    """The one label of ``known`` that agrees with ``found`` (itself first), or None (none, or several)."""
    if found in known:
        return found
    hits = [k for k in known if agree(found, k)]
    return hits[0] if len(hits) == 1 else None


def is_library(path: str) -> bool:
    """True for a file of JAX, Flax, Optax or cmtune (their frames are not a user's source): installed here,
    or under any ``site-packages`` (a module compiled on another machine names that one's paths)."""
    if _INSTALLED.search(path):
        return True
    path = os.path.normcase(os.path.abspath(path)) if path and not path.startswith("<") else path
    return any(path.startswith(root) for root in _library_roots())


_INSTALLED = re.compile(r"[/\\](?:site|dist)-packages[/\\](?:" + "|".join(LIBRARIES) + r")[/\\]")


@cache
def _library_roots() -> tuple[str, ...]:
    roots = []
    for name in LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            roots.append(os.path.normcase(os.path.abspath(location)) + os.sep)
    return tuple(roots)


def _split(text: str) -> list[str]:
    """``a/b(c/d)/e`` -> ``["a", "b(c/d)", "e"]``: slashes outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "/" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


# ---- at trace time (the drop-in and the ops' clients) -------------------------------------------


def call_site() -> tuple[str, str]:
    """The call being traced now: its role (`label` of JAX's name stack and the Python stack) and its
    source (`source_of` the Python stack)."""
    frames = _frames()
    return label(_name_stack(), frames), source_of(frames)


def _name_stack() -> str:
    try:
        from jax._src import source_info_util

        return str(source_info_util.current_name_stack())
    except Exception:  # noqa: BLE001 - a label is never worth a failed step
        return ""


def _frames(limit: int = 64) -> list[tuple[str, int]]:
    frame, out = sys._getframe(1), []
    while frame is not None and len(out) < limit:
        out.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return out


def group_label(roles: Sequence[str]) -> str:
    """``Llama/layers/{key,query,value}``: the roles of the calls of one gathered activation (`collective_matmul.
    share`) in sorted order (a trace and a compiled module order them differently), a common prefix written once
    (else joined by commas).  The role their summed input gradient is listed (`collective_matmul.programs.discovery`)
    and looked up under."""
    roles = sorted(roles)
    prefix = roles[0].rpartition("/")[0]
    if len(roles) > 1 and prefix and all(r.rpartition("/")[0] == prefix for r in roles):
        return f"{prefix}/{{{','.join(r.rpartition('/')[2] for r in roles)}}}"
    return ", ".join(roles)
