"""Baseline (reference) ops: the whole collective, then the einsum, as XLA would run it.

Per-shard forms: call them inside `jax.shard_map` over ``axis``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def baseline_allgather_matmul_shard(x: jax.Array, w: jax.Array, *, axis: str) -> jax.Array:
    """All-gather ``x [..., M/P, K]`` over ``axis``, then multiply by ``w [K, N/P]``."""
    gathered = lax.all_gather(x, axis, axis=x.ndim - 2, tiled=True)
    return jnp.matmul(gathered, w)


def baseline_matmul_reduce_scatter_shard(x: jax.Array, w: jax.Array, *, axis: str) -> jax.Array:
    """Multiply ``x [..., M, K/P]`` by ``w [K/P, N]``, then reduce-scatter the sum over M."""
    partial = jnp.matmul(x, w)
    return lax.psum_scatter(partial, axis, scatter_dimension=partial.ndim - 2, tiled=True)


def baseline_allgather_grad_weight_shard(u: jax.Array, v: jax.Array, *, axis: str) -> jax.Array:
    """All-gather ``u [..., M/P, A]`` over ``axis``, then contract it with ``v [..., M, B/P]``.

    Returns ``all_gather(u)ᵀ @ v``, ``[A, B/P]``, contracting M and every leading dimension.
    """
    gathered = lax.all_gather(u, axis, axis=u.ndim - 2, tiled=True)
    contracted = tuple(range(u.ndim - 1))
    return jnp.tensordot(gathered, v, axes=(contracted, contracted))
