"""Ring decompositions of all-gather matmul and matmul reduce-scatter (per shard).

Call these inside `jax.shard_map` over ``axis``; `collective_matmul.ops` wraps them for global
arrays.  The algorithm (Wang et al., ASPLOS 2023):

1. Split the collective into ``P-1`` CollectivePermutes round the ring of ``P`` devices.
2. At each step, start the permute that feeds the next step, and meanwhile run the partial
   einsum on the block that arrived at the previous step; the transfer hides behind it.
3. All-gather side: each step multiplies one block of ``x`` (rows of M) by the local ``w`` and
   places the result at that block's rows.  Reduce-scatter side: a partial-sum accumulator for
   one output block travels round the ring and every device adds its partial product to it.
4. ``bidirectional`` runs two streams at once, one each way round the ring, so every block
   arrives after about ``P/2`` steps and both link directions are busy.
5. ``chunks`` splits every block into pieces that are moved and multiplied separately.  A block
   ``[..., rows, K]`` is split over its leading (batch) dimensions first, then over its rows, so
   any power of two dividing the block's ``batch x rows`` works (see `_Tiling`).
6. ``unroll='full'`` writes the steps out in Python; ``unroll=1|2`` puts the homogeneous
   middle steps in a `lax.fori_loop` (or `lax.scan` when results are collected).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from collective_matmul.decomposition import Decomposition
from collective_matmul.problem import check_decomposition, resolved_accumulate, ring_hops
from collective_matmul.reference import (
    baseline_allgather_matmul_shard,
    baseline_matmul_reduce_scatter_shard,
)

Pieces = tuple[jax.Array, ...]


def allgather_matmul_shard(
    x: jax.Array, w: jax.Array, *, axis: str, config: Decomposition
) -> jax.Array:
    """All-gather ``x`` over ``axis`` and multiply by ``w``, decomposed as ``config`` says.

    Args:
        x: local block ``[..., M/P, K]`` (rows of M sharded over ``axis``).
        w: local block ``[K, N/P]``.
        axis: the mesh axis of the ring.
        config: the decomposition.

    Returns:
        ``[..., M, N/P]``, equal to ``all_gather(x) @ w``.

    Raises:
        ValueError: if ``config`` is not valid for these shapes.
    """
    if config.method == "baseline":
        return baseline_allgather_matmul_shard(x, w, axis=axis)
    size = lax.axis_size(axis)
    check_decomposition(
        config,
        collective="allgather_matmul",
        block_rows=math.prod(x.shape[:-1]),
        axis_size=size,
        dtype=jnp.dtype(x.dtype).name,
    )
    mode = resolved_accumulate(config, collective="allgather_matmul", dtype=jnp.dtype(x.dtype).name)
    ring = _Ring(axis, size, config)
    tiling = _Tiling(x.shape[:-1], config.chunks)
    own = tiling.split(x)
    products = lambda pieces: [jnp.matmul(p, w) for p in pieces]  # noqa: E731
    if mode == "update_slice":
        return _allgather_update_slice(ring, tiling, own, products, x, w)
    return _allgather_concat(ring, tiling, own, products)


def matmul_reduce_scatter_shard(
    x: jax.Array, w: jax.Array, *, axis: str, config: Decomposition
) -> jax.Array:
    """Multiply ``x`` by ``w`` and reduce-scatter the sum over ``axis``, decomposed.

    Args:
        x: local block ``[..., M, K/P]`` (columns of K sharded over ``axis``).
        w: local block ``[K/P, N]``.
        axis: the mesh axis of the ring.
        config: the decomposition.

    Returns:
        ``[..., M/P, N]``, equal to ``psum_scatter(x @ w)`` over the M rows.

    Raises:
        ValueError: if ``config`` is not valid for these shapes.
    """
    if config.method == "baseline":
        return baseline_matmul_reduce_scatter_shard(x, w, axis=axis)
    size = lax.axis_size(axis)
    if x.shape[-2] % size:
        raise ValueError(f"matmul_reduce_scatter: M={x.shape[-2]} is not divisible by the ring size {size}")
    rows = x.shape[-2] // size
    dtype_name = jnp.dtype(x.dtype).name
    check_decomposition(
        config,
        collective="matmul_reduce_scatter",
        block_rows=math.prod(x.shape[:-2]) * rows,
        axis_size=size,
        dtype=dtype_name,
    )
    mode = resolved_accumulate(config, collective="matmul_reduce_scatter", dtype=dtype_name)
    acc_dtype = jnp.float32 if mode == "float32" else x.dtype
    ring = _Ring(axis, size, config)
    tiling = _Tiling((*x.shape[:-2], rows), config.chunks)

    def partial(offset) -> Pieces:
        """This device's partial products for the output block ``i + offset``."""
        start = ((ring.index + offset) % size) * rows
        return tuple(
            jnp.matmul(
                lax.dynamic_slice(x, (*lead, start + row, 0), (*tiling.piece, x.shape[-1])),
                w,
                preferred_element_type=acc_dtype,
            )
            for *lead, row in tiling.offsets
        )

    add = lambda a, b: tuple(u + v for u, v in zip(a, b, strict=True))  # noqa: E731
    if config.direction == "unidirectional":
        # Accumulator travels to i+1; at step t device i adds its part of block i-t-1.
        acc = ring.loop(
            lambda t, acc: add(ring.send_up(acc), partial(-t - 1)),
            partial(-1),
            1,
            size,
        )
    else:
        # Stream A travels up (to i+1) for `hops_a` hops and ends with this device's own part;
        # stream B travels down for `hops_b` hops and only carries the other devices' parts.
        hops_a, hops_b = ring.hops

        def middle(t, accs):
            acc_a, acc_b = accs
            return (
                add(ring.send_up(acc_a), partial(hops_a - t)),
                add(ring.send_down(acc_b), partial(t - hops_b)),
            )

        acc_a, acc_b = ring.loop(middle, (partial(hops_a), partial(-hops_b)), 1, hops_b)
        acc_a = add(ring.send_up(acc_a), partial(hops_a - hops_b))
        acc_b = ring.send_down(acc_b)
        if hops_a > hops_b:
            acc_a = add(ring.send_up(acc_a), partial(0))
        acc = add(acc_a, acc_b)
    return tiling.assemble(acc).astype(x.dtype)


class _Tiling:
    """How ``chunks`` splits a block: over its leading dims first, then its rows.

    ``splits[d]`` pieces along block dimension ``d`` (greedy ``gcd`` from the outermost), so
    every piece is a rectangular slice; pieces are listed in row-major order of that grid.
    """

    def __init__(self, block_shape: tuple[int, ...], chunks: int):
        splits, remaining = [], chunks
        for size in block_shape:
            splits.append(math.gcd(remaining, size))
            remaining //= splits[-1]
        if remaining != 1:
            raise ValueError(f"chunks={chunks} does not tile a block of shape {block_shape}")
        self.splits = tuple(splits)
        self.piece = tuple(size // s for size, s in zip(block_shape, splits, strict=True))
        self.offsets = [
            tuple(i * p for i, p in zip(index, self.piece, strict=True))
            for index in itertools.product(*(range(s) for s in splits))
        ]

    def split(self, x: jax.Array) -> Pieces:
        """Static pieces of a block ``x`` whose leading dims are the block dims."""
        if len(self.offsets) == 1:
            return (x,)
        return tuple(
            x[tuple(slice(o, o + p) for o, p in zip(offset, self.piece, strict=True))]
            for offset in self.offsets
        )

    def assemble(self, pieces) -> jax.Array:
        """Inverse of `split`: nested concatenation, innermost split dimension first."""
        arrays = list(pieces)
        for dim in reversed(range(len(self.splits))):
            step = self.splits[dim]
            if step > 1:
                arrays = [jnp.concatenate(arrays[i : i + step], axis=dim) for i in range(0, len(arrays), step)]
        return arrays[0]


class _Ring:
    """Ring geometry and the two primitive moves, shared by both collectives."""

    def __init__(self, axis: str, size: int, config: Decomposition):
        self.axis = axis
        self.size = size
        self.config = config
        self.index = lax.axis_index(axis)
        self.hops = ring_hops(config.direction, size)
        self._up = [(j, (j + 1) % size) for j in range(size)]
        self._down = [(j, (j - 1) % size) for j in range(size)]

    def send_up(self, pieces: Pieces) -> Pieces:
        """Each device sends to ``i+1`` (so it receives from ``i-1``)."""
        return tuple(lax.ppermute(p, self.axis, self._up) for p in pieces)

    def send_down(self, pieces: Pieces) -> Pieces:
        """Each device sends to ``i-1`` (so it receives from ``i+1``)."""
        return tuple(lax.ppermute(p, self.axis, self._down) for p in pieces)

    def loop(self, body: Callable[[Any, Any], Any], carry: Any, lower: int, upper: int) -> Any:
        """``carry = body(t, carry)`` for t in [lower, upper): Python-unrolled or `fori_loop`."""
        if self.config.unroll == "full":
            for t in range(lower, upper):
                carry = body(t, carry)
            return carry
        if upper <= lower:
            return carry
        return lax.fori_loop(lower, upper, body, carry, unroll=self.config.unroll)

    def scan(self, body: Callable[[Any, Any], Any], carry: Any, lower: int, upper: int):
        """``carry, y = body(carry, t)`` for t in [lower, upper), collecting every ``y``.

        Returns the carry and, per output leaf, either a Python list (unrolled) or an array
        stacked on a new leading axis (`lax.scan`); `_segment` concatenates either.
        """
        if self.config.unroll == "full" or upper <= lower:
            ys = []
            for t in range(lower, upper):
                carry, y = body(carry, t)
                ys.append(y)
            return carry, [list(leaf) for leaf in zip(*ys, strict=True)] if ys else None
        carry, ys = lax.scan(body, carry, jnp.arange(lower, upper), unroll=self.config.unroll)
        return carry, ys


def _segment(blocks, *, reverse: bool = False) -> list[jax.Array]:
    """Blocks collected by `_Ring.scan` as a list of arrays to concatenate on the row axis."""
    if blocks is None:
        return []
    if isinstance(blocks, list):
        return blocks[::-1] if reverse else blocks
    if reverse:
        blocks = blocks[::-1]
    moved = jnp.moveaxis(blocks, 0, -3)  # [..., T, rows, N]
    return [moved.reshape(*moved.shape[:-3], -1, moved.shape[-1])]


def _varying_axes(value: jax.Array) -> frozenset[str]:
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.9
    return manual.varying if manual is not None else frozenset(getattr(aval, "vma", ()))


def _vary_like(value: jax.Array, like: jax.Array) -> jax.Array:
    """Mark a fresh array as varying over the same mesh axes as ``like`` (for `check_vma`)."""
    missing = tuple(sorted(_varying_axes(like) - _varying_axes(value)))
    return lax.pcast(value, missing, to="varying") if missing else value


def _allgather_update_slice(ring: _Ring, tiling: _Tiling, own: Pieces, products, x, w) -> jax.Array:
    rows = x.shape[-2]
    out = jnp.zeros((*x.shape[:-2], ring.size * rows, w.shape[-1]), jnp.result_type(x, w))
    out = _vary_like(out, jnp.matmul(x[..., :1, :], w[:, :1]))

    def write(out, pieces: Pieces, offset):
        """Place the products of block ``i + offset`` at its rows."""
        start = ((ring.index + offset) % ring.size) * rows
        for (*lead, row), y in zip(tiling.offsets, products(pieces), strict=True):
            out = lax.dynamic_update_slice(out, y, (*lead, start + row, 0))
        return out

    if ring.config.direction == "unidirectional":

        def step(t, carry):
            cur, out = carry
            return ring.send_down(cur), write(out, cur, t)

        cur, out = ring.loop(step, (own, out), 0, ring.size - 1)
        return write(out, cur, ring.size - 1)

    hops_a, hops_b = ring.hops  # stream a brings blocks i+t, stream b brings blocks i-t
    a, b = ring.send_down(own), ring.send_up(own)
    out = write(out, own, 0)

    def step_bi(t, carry):
        a, b, out = carry
        next_a, next_b = ring.send_down(a), ring.send_up(b)
        return next_a, next_b, write(write(out, a, t), b, -t)

    a, b, out = ring.loop(step_bi, (a, b, out), 1, hops_b)
    last_a = ring.send_down(a) if hops_a > hops_b else None
    out = write(write(out, a, hops_b), b, -hops_b)
    if last_a is not None:
        out = write(out, last_a, hops_a)
    return out


def _allgather_concat(ring: _Ring, tiling: _Tiling, own: Pieces, products) -> jax.Array:
    row_axis = own[0].ndim - 2
    rows = own[0].shape[-2] * tiling.splits[-1]
    block = lambda pieces: tiling.assemble(products(pieces))  # noqa: E731

    if ring.config.direction == "unidirectional":
        cur, (middle,) = ring.scan(lambda cur, t: (ring.send_down(cur), (block(cur),)), own, 0, ring.size - 1)
        parts = [*_segment(middle), block(cur)]  # blocks i, i+1, ..., i+P-1
        first = 0
    else:
        hops_a, hops_b = ring.hops
        first_y = block(own)

        def step_bi(carry, t):
            a, b = carry
            return (ring.send_down(a), ring.send_up(b)), (block(a), block(b))

        (a, b), ys = ring.scan(step_bi, (ring.send_down(own), ring.send_up(own)), 1, hops_b)
        ys_a, ys_b = ys if ys is not None else (None, None)
        last_a = ring.send_down(a) if hops_a > hops_b else None
        # blocks i-hops_b, ..., i-1, i, i+1, ..., i+hops_a
        parts = [
            block(b),
            *_segment(ys_b, reverse=True),
            first_y,
            *_segment(ys_a),
            block(a),
            *([block(last_a)] if last_a is not None else []),
        ]
        first = -hops_b
    gathered = jnp.concatenate(parts, axis=row_axis)
    shift = ((ring.index + first) % ring.size) * rows
    return jnp.roll(gathered, shift, axis=row_axis)
