"""Lowering a step: its partitioned module, compiled for its arguments and never run, read by the scan (JAX is
imported when a step is lowered, not at import)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Sequence

from collective_matmul.programs.discovery.cache import past_persistent_cache
from collective_matmul.programs.discovery.records import Discovery
from collective_matmul.programs.discovery.scanning import scan


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


def discover(step, args: Sequence, mesh=None, *, kwargs: Mapping | None = None) -> Discovery:
    """The collective matmuls of one training step (see the package `collective_matmul.programs.discovery`).

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
