"""Meshes of any devices, a TPU slice compiled ahead of time among them, and the arguments of such a compile.

On a host with libtpu (``pip install 'cmtune[tpu]'``), `jax.experimental.topologies` gives the devices of a TPU
slice that is not there: programs lower and compile for them with XLA's real TPU compiler, and nothing runs.
A step spec that takes ``devices`` builds its mesh with `mesh_of` (``jax.make_mesh`` refuses TPU v4's two
devices per chip) and, where `compile_only` says so, returns abstract arguments (`abstract`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax.sharding import AxisType, Mesh

__all__ = ["TPU_EXTRA", "abstract", "compile_only", "mesh_of", "quiet_libtpu", "tpu_devices"]

TPU_EXTRA = "pip install 'cmtune[tpu]' (JAX's TPU build, jax[tpu], with the libtpu of this JAX version)"


class TopologyError(ValueError):
    """Devices that cannot be compiled for here: the compiler is missing, or it does not know the name."""


def tpu_devices(topology: str) -> list:
    """The devices of the TPU slice ``topology`` (``v5p:2x2x1``, ``v5e:2x2``, ``v4:4x4x4``; any name libtpu takes),
    compiled for ahead of time on this host.

    Raises:
        TopologyError: libtpu is not installed (the message says how to get it), or it refuses ``topology``.
    """
    quiet_libtpu(topology)
    try:
        import libtpu  # noqa: F401 - only to say what is missing
    except ImportError:
        raise TopologyError(f"compiling for the TPU topology {topology!r} needs libtpu: {TPU_EXTRA}") from None
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as exc:  # noqa: BLE001 - libtpu's error says what it took
        raise TopologyError(f"libtpu refused the topology {topology!r} ({type(exc).__name__}: {exc}); give one "
                            "such as v5p:2x2x1, v5e:2x2 or v4:2x2x1") from None


def quiet_libtpu(topology: str) -> None:
    """Tell libtpu it runs on no TPU host (call before JAX starts its backends): without these it prints errors
    about the worker hostnames it could not find, on every start, and a second process that compiles (a test's
    subprocess, a process group) finds libtpu's lock taken.  Variables already set are kept."""
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{topology.split(':', 1)[0]}-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiles only: several processes may hold libtpu


def compile_only(devices: Sequence) -> bool:
    """True when ``devices`` cannot run anything here (a TPU slice compiled ahead of time): arguments must be
    abstract (`jax.ShapeDtypeStruct` with their shardings) and nothing is timed."""
    import jax

    local = {(d.platform, d.id) for d in jax.devices()}
    return any((d.platform, d.id) not in local for d in devices)


def mesh_of(devices: Sequence, shape: Sequence[int], names: Sequence[str], *,
            axis_types: AxisType | Sequence[AxisType] | None = None) -> Mesh:
    """A mesh of ``devices`` laid out as ``shape``, the last axis on neighbouring devices (``axis_types``: every
    axis ``Auto`` by default).

    ``jax.make_mesh`` where it takes the devices (it orders a TPU slice by its physical layout); else, as on TPU
    v4 with two devices per chip, the devices in their order (by id), reshaped.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    axis_types = AxisType.Auto if axis_types is None else axis_types
    devices = list(devices)
    if math.prod(shape) != len(devices):
        raise ValueError(f"a mesh of shape {tuple(shape)} needs {math.prod(shape)} devices, got {len(devices)}")
    types = tuple(axis_types) if isinstance(axis_types, Sequence) else (axis_types,) * len(shape)
    try:
        return jax.make_mesh(tuple(shape), tuple(names), axis_types=types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.array(sorted(devices, key=lambda d: d.id), dtype=object).reshape(tuple(shape))
        return Mesh(grid, tuple(names), axis_types=types)


def abstract(tree):
    """``tree`` with every array replaced by its `jax.ShapeDtypeStruct` (shape, dtype, sharding)."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None))
                        if hasattr(a, "shape") and hasattr(a, "dtype") else a, tree)
