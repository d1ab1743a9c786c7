"""Collective matmul ops on global arrays (wrapping the per-shard kernels in `shard_map`)."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul.decomposition import Decomposition
from collective_matmul.problem import Problem
from collective_matmul.ring import allgather_matmul_shard, matmul_reduce_scatter_shard

BatchAxis = str | tuple[str, ...] | None


def allgather_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    config: Decomposition,
    batch_axis: BatchAxis = None,
) -> jax.Array:
    """``all_gather(x) @ w`` over mesh axis ``axis``, decomposed as ``config`` says.

    Args:
        x: ``[..., M, K]``, M sharded over ``axis`` (the first batch dimension may be sharded
            over ``batch_axis``).
        w: ``[K, N]``, N sharded over ``axis``.
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis that forms the ring.
        config: the decomposition to run.
        batch_axis: mesh axis (or axes) sharding the first leading dimension of ``x``.

    Returns:
        ``[..., M, N]`` with N sharded over ``axis``.

    Raises:
        ValueError: if the shapes do not fit the mesh or ``config`` is invalid for them.
    """
    lead = _check(x, w, mesh, axis, batch_axis, sharded=(("M", -2, "x"), ("N", -1, "w")))
    specs = _specs("allgather_matmul", lead, axis)
    return _run(allgather_matmul_shard, x, w, mesh=mesh, axis=axis, config=config, specs=specs)


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    config: Decomposition,
    batch_axis: BatchAxis = None,
) -> jax.Array:
    """``reduce_scatter(x @ w)`` over mesh axis ``axis``, decomposed as ``config`` says.

    Args:
        x: ``[..., M, K]``, K sharded over ``axis``.
        w: ``[K, N]``, K sharded over ``axis``.
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis that forms the ring.
        config: the decomposition to run.
        batch_axis: mesh axis (or axes) sharding the first leading dimension of ``x``.

    Returns:
        ``[..., M, N]`` (the full product) with M sharded over ``axis``.

    Raises:
        ValueError: if the shapes do not fit the mesh or ``config`` is invalid for them.
    """
    lead = _check(x, w, mesh, axis, batch_axis, sharded=(("M", -2, "x"), ("K", -1, "x")))
    specs = _specs("matmul_reduce_scatter", lead, axis)
    return _run(matmul_reduce_scatter_shard, x, w, mesh=mesh, axis=axis, config=config, specs=specs)


def _specs(collective: str, lead: tuple, axis: str) -> tuple[P, P, P]:
    """Partition specs of (x, w, result) for a collective (DESIGN.md layouts)."""
    if collective == "allgather_matmul":
        return P(*lead, axis, None), P(None, axis), P(*lead, None, axis)
    if collective == "matmul_reduce_scatter":
        return P(*lead, None, axis), P(axis, None), P(*lead, axis, None)
    raise ValueError(f"unknown collective {collective!r}")


def _run(shard_fn, x, w, *, mesh: Mesh, axis: str, config: Decomposition, specs: tuple[P, P, P]) -> jax.Array:
    x_spec, w_spec, out_spec = specs
    fn = jax.shard_map(partial(shard_fn, axis=axis, config=config), mesh=mesh, in_specs=(x_spec, w_spec),
                       out_specs=out_spec)
    return fn(*_placed(mesh, (x_spec, w_spec), x, w))


def input_shardings(
    collective: str, mesh: Mesh, axis: str, *, batch_dims: int = 0, batch_axis: BatchAxis = None
) -> tuple[NamedSharding, NamedSharding]:
    """The shardings of ``(x, w)`` that an op expects, for placing inputs with `device_put`."""
    x_spec, w_spec, _ = _specs(collective, _lead_spec(batch_dims, batch_axis), axis)
    return NamedSharding(mesh, x_spec), NamedSharding(mesh, w_spec)


def problem_of(
    collective: str,
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    batch_axis: BatchAxis = None,
) -> Problem:
    """The `Problem` one call of an op solves (batch dimensions fold into ``m`` per ring)."""
    batch_shards = _axes_size(mesh, batch_axis)
    rows = math.prod(x.shape[:-1]) // batch_shards
    return Problem(
        collective=collective,
        m=rows,
        k=x.shape[-1],
        n=w.shape[-1],
        dtype=jnp.dtype(x.dtype).name,
        axis_size=mesh.shape[axis],
    )


def _placed(mesh: Mesh, specs: tuple, *arrays: jax.Array) -> tuple:
    """On a mesh with Explicit axes, reshard inputs to the specs (a no-op when they match)."""
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return arrays
    return tuple(
        jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs, strict=True)
    )


def _axes_size(mesh: Mesh, axes: BatchAxis) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for name in names:
        if name not in mesh.shape:
            raise ValueError(f"batch_axis {name!r} is not an axis of the mesh {dict(mesh.shape)}")
    return math.prod(mesh.shape[name] for name in names)


def _lead_spec(batch_dims: int, batch_axis: BatchAxis) -> tuple:
    if batch_axis is not None and batch_dims == 0:
        raise ValueError("batch_axis was given but x has no leading batch dimension")
    lead = [None] * batch_dims
    if batch_axis is not None:
        lead[0] = batch_axis
    return tuple(lead)


def _check(x, w, mesh: Mesh, axis: str, batch_axis: BatchAxis, *, sharded) -> tuple:
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    if x.ndim < 2 or w.ndim != 2:
        raise ValueError(f"expected x [..., M, K] and w [K, N], got shapes {x.shape} and {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"contraction mismatch: x has K={x.shape[-1]} but w has K={w.shape[0]}")
    if batch_axis is not None and (batch_axis == axis or axis in tuple(batch_axis)):
        raise ValueError(f"batch_axis must differ from the ring axis {axis!r}")
    size = mesh.shape[axis]
    for name, index, operand in sharded:
        dim = (x if operand == "x" else w).shape[index]
        if dim % size:
            raise ValueError(f"{name}={dim} is not divisible by the size {size} of mesh axis {axis!r}")
    shards = _axes_size(mesh, batch_axis)
    if batch_axis is not None and x.ndim > 2 and x.shape[0] % shards:
        raise ValueError(f"batch dimension {x.shape[0]} is not divisible by {shards} ({batch_axis!r})")
    return _lead_spec(x.ndim - 2, batch_axis)
