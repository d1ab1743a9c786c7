"""Ring decompositions of the collective matmuls (per shard) and their custom VJPs.

Call these inside `jax.shard_map` over ``axis``; `collective_matmul.ops.collective` wraps them for global
arrays.  The algorithm (Wang et al., ASPLOS 2023):

1. Split the collective into ``P-1`` CollectivePermutes round the ring of ``P`` devices.
2. At each step, start the permute that feeds the next step, and meanwhile run the partial
   einsum on the block that arrived at the previous step; the transfer hides behind it.
3. All-gather side: each step multiplies one block of ``x`` (rows of M) by the local ``w`` and
   places the result at that block's rows.  Reduce-scatter side: a partial-sum accumulator for
   one output block travels round the ring and every device adds its partial product to it.
4. Weight-gradient side (all-gather on the contracting dimension): the blocks of ``u`` travel as
   ``x`` does on the all-gather side; each step contracts the block it holds with the matching
   rows of the local ``v`` and adds the product ``[A, B/P]`` into an accumulator that stays on
   the device (``accumulate`` sets its dtype).  One loop (`_gather_ring`) serves every use of a
   travelling block, so the backward can fuse two of them.
5. ``bidirectional`` runs two streams at once, one each way round the ring, so every block
   arrives after about ``P/2`` steps and both link directions are busy.
6. ``chunks`` splits every block into pieces that are moved and multiplied separately.  A block
   ``[..., rows, K]`` is split over its leading (batch) dimensions first, then over its rows, so
   any power of two dividing the block's ``batch x rows`` works (see `_Tiling`).
7. ``unroll='full'`` writes the steps out in Python; ``unroll=1|2`` puts the homogeneous
   middle steps in a `lax.fori_loop` (reduce-scatter side) or a `lax.scan` (the gathering
   sides, which may collect per-block results).
8. Backward (`jax.custom_vjp`): an op's input gradient runs the dual op with the ``grad_input``
   config and its weight gradient runs the weight-gradient op with the ``grad_weight`` config.
   With ``grad_weight.fuse`` one loop serves both where two would move the same blocks: an
   all-gather matmul keeps the x it gathered in the forward (dW is then a local matmul); a
   matmul reduce-scatter gathers dy once, in the ``grad_input`` ring, for dx and dW together.
   The weight gradient is summed over the mesh axes it varies over and ``w`` does not (the data
   axes) once, at the end (`_cotangent`).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, reduce
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from collective_matmul.ops.baseline import (
    baseline_allgather_grad_weight_shard,
    baseline_allgather_matmul_shard,
    baseline_matmul_reduce_scatter_shard,
)
from collective_matmul.ops.ring_schedule import RingSchedule
from collective_matmul.planning.decomposition import DEFAULT_GRAD_WEIGHT, Decomposition
from collective_matmul.planning.models import slot_collective
from collective_matmul.planning.problem import Collective, check_decomposition, resolved_accumulate, ring_hops

Pieces = tuple[jax.Array, ...]

def allgather_matmul_shard(
    x: jax.Array,
    w: jax.Array,
    *,
    axis: str,
    config: Decomposition,
    grad_input: Decomposition | None = None,
    grad_weight: Decomposition | None = None,
) -> jax.Array:
    """All-gather ``x`` over ``axis`` and multiply by ``w``, decomposed as ``config`` says.

    Args:
        x: local block ``[..., M/P, K]`` (rows of M sharded over ``axis``).
        w: local block ``[K, N/P]``.
        axis: the mesh axis of the ring.
        config: the decomposition of the forward.
        grad_input: the decomposition of ``dx = reduce_scatter(dy @ wᵀ)``, a matmul
            reduce-scatter problem with k and n swapped (m=M, k=N, n=K); None: the baseline.
        grad_weight: the decomposition of ``dW = all_gather(x)ᵀ @ dy``, an
            ``allgather_grad_weight`` problem (m=M, k=K, n=N).  With ``fuse=True`` the forward
            keeps the x it gathers (``M x K`` more memory per device) and dW is a local matmul;
            only its ``accumulate`` (``float32``) then matters.  None:
            ``Decomposition.baseline(fuse=True)``, what autodiff of the baseline does.

    Returns:
        ``[..., M, N/P]``, equal to ``all_gather(x) @ w``.

    Raises:
        ValueError: if a config is not valid for these shapes (a backward config's message
            starts with its argument name).
    """
    plan = _plan(Collective.ALLGATHER_MATMUL, x, axis, config, grad_input, grad_weight,
                 block_rows=math.prod(x.shape[:-1]))
    return _allgather_matmul_vjp(x, w, plan)


def allgather_matmul_keep_shard(
    x: jax.Array,
    w: jax.Array,
    *,
    axis: str,
    config: Decomposition,
    grad_input: Decomposition | None = None,
    grad_weight: Decomposition | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The forward of `allgather_matmul_shard` that also returns the gathered ``x``, for other products of it to
    reuse.  The gathered ``x`` is a by-product (the all-gather, or the blocks the ring moved).  Its backward is
    `allgather_matmul_keep_grads_shard` (the group's one reduce-scatter; `collective_matmul.ops.collective` pairs the
    two in a custom VJP over the global arrays, where the group's calls meet: `collective_matmul.ops.share`).

    Returns:
        ``(all_gather(x) @ w, all_gather(x))``: ``[..., M, N/P]`` and ``[..., M, K]``.

    Raises:
        ValueError: as `allgather_matmul_shard`.
    """
    plan = _plan(Collective.ALLGATHER_MATMUL, x, axis, config, grad_input, grad_weight,
                 block_rows=math.prod(x.shape[:-1]))
    return _allgather_matmul(x, w, plan.axis, plan.config, keep=True)


def allgather_matmul_keep_grads_shard(
    saved: jax.Array,
    w: jax.Array,
    dy: jax.Array,
    d_gathered: jax.Array | None,
    others: tuple[tuple[jax.Array, jax.Array], ...] = (),
    *,
    axis: str,
    config: Decomposition,
    grad_input: Decomposition | None = None,
    grad_weight: Decomposition | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The backward of `allgather_matmul_keep_shard` for a group of products of one gathered ``x``:
    ``(dx, dW)`` of this op, where ``dx`` also holds the input gradients of the products that reused the gathered
    ``x`` (``others``: their ``(dy_i, w_i)``, local blocks ``[..., M, N_i/P]`` and ``[K, N_i/P]``) and
    ``d_gathered`` (any other cotangent of the gathered ``x``, ``[..., M, K]``; None: none).  One reduce-scatter ring
    (``grad_input``, a config of the summed problem: N the sum of the group's) computes every product's chunk at
    every step, so the whole group's transfer hides behind the whole group's product.

    Args:
        saved: what the forward kept: ``all_gather(x)`` where ``grad_weight`` fuses, else the local ``x`` (gathered
            again for dW).

    Raises:
        ValueError: as `allgather_matmul_shard`.
    """
    fuse = (DEFAULT_GRAD_WEIGHT if grad_weight is None else grad_weight).fuse
    rows = math.prod(saved.shape[:-1]) // (lax.axis_size(axis) if fuse else 1)
    plan = _plan(Collective.ALLGATHER_MATMUL, saved, axis, config, grad_input, grad_weight, block_rows=rows)
    addend = None if d_gathered is None else d_gathered.astype(dy.dtype)
    return _allgather_matmul_bwd(plan, (saved, w), dy, addend=addend, others=others)


def matmul_reduce_scatter_shard(
    x: jax.Array,
    w: jax.Array,
    *,
    axis: str,
    config: Decomposition,
    grad_input: Decomposition | None = None,
    grad_weight: Decomposition | None = None,
) -> jax.Array:
    """Multiply ``x`` by ``w`` and reduce-scatter the sum over ``axis``, decomposed.

    Args:
        x: local block ``[..., M, K/P]`` (columns of K sharded over ``axis``).
        w: local block ``[K/P, N]``.
        axis: the mesh axis of the ring.
        config: the decomposition of the forward.
        grad_input: the decomposition of ``dx = all_gather(dy) @ wᵀ``, an all-gather matmul
            problem with k and n swapped (m=M, k=N, n=K); None: the baseline.
        grad_weight: the decomposition of ``dWᵀ = all_gather(dy)ᵀ @ x``, an
            ``allgather_grad_weight`` problem (m=M, k=N, n=K).  With ``fuse=True`` one gather of
            dy serves both gradients: the ``grad_input`` ring (its direction, chunks and unroll)
            also accumulates dW, in the dtype this config's ``accumulate`` sets.  None:
            ``Decomposition.baseline(fuse=True)``, what autodiff of the baseline does.

    Returns:
        ``[..., M/P, N]``, equal to ``psum_scatter(x @ w)`` over the M rows.

    Raises:
        ValueError: if a config is not valid for these shapes (a backward config's message
            starts with its argument name).
    """
    size = lax.axis_size(axis)
    if x.shape[-2] % size:
        raise ValueError(f"matmul_reduce_scatter: M={x.shape[-2]} is not divisible by the ring size {size}")
    block_rows = math.prod(x.shape[:-2]) * (x.shape[-2] // size)
    plan = _plan(Collective.MATMUL_REDUCE_SCATTER, x, axis, config, grad_input, grad_weight, block_rows=block_rows)
    return _matmul_reduce_scatter_vjp(x, w, plan)


def allgather_grad_weight_shard(
    u: jax.Array, v: jax.Array, *, axis: str, config: Decomposition
) -> jax.Array:
    """All-gather ``u`` over ``axis`` on the contracting dimension and contract it with ``v``.

    The weight gradient of both ops: an all-gather matmul's ``dW`` is ``u = x, v = dy``; a matmul
    reduce-scatter's ``dWᵀ`` is ``u = dy, v = x``.  ``config.fuse`` has no effect here (it only
    matters in an op's backward).  Differentiable by JAX autodiff.

    Args:
        u: local block ``[..., M/P, A]`` (rows of M sharded over ``axis``).
        v: local block ``[..., M, B/P]`` (all of M; the same leading dimensions as ``u``).
        axis: the mesh axis of the ring.
        config: the decomposition.

    Returns:
        ``[A, B/P]``, equal to ``all_gather(u)ᵀ @ v`` contracting M and the leading dimensions
        (not summed over any other mesh axis).

    Raises:
        ValueError: if the shapes do not match or ``config`` is not valid for them.
    """
    if config.method == "xla":
        raise ValueError("method='xla' is the product as written, partitioned by GSPMD: it runs through the op "
                         "(allgather_grad_weight), not inside a shard_map")
    size = lax.axis_size(axis)
    if u.ndim < 2 or v.shape[:-2] != u.shape[:-2] or v.shape[-2] != u.shape[-2] * size:
        raise ValueError(
            f"allgather_grad_weight: expected u [..., M/P, A] and v [..., M, B/P] with M/P * {size} = M "
            f"and the same leading dimensions, got {u.shape} and {v.shape}"
        )
    check_decomposition(
        config,
        collective=Collective.ALLGATHER_GRAD_WEIGHT,
        block_rows=math.prod(u.shape[:-1]),
        axis_size=size,
        dtype=jnp.dtype(u.dtype).name,
    )
    return _allgather_grad_weight(u, v, axis, config).astype(jnp.result_type(u, v))


class _ActivationRingPlan(NamedTuple):
    """The static half of one op call: the ring axis and the three configs."""

    axis: str
    config: Decomposition
    grad_input: Decomposition
    grad_weight: Decomposition


def _plan(
    collective: str,
    x: jax.Array,
    axis: str,
    config: Decomposition,
    grad_input: Decomposition | None,
    grad_weight: Decomposition | None,
    *,
    block_rows: int,
) -> _ActivationRingPlan:
    """Fill in the backward defaults and check all three configs (the same ring blocks)."""
    if any(c is not None and c.method == "xla" for c in (config, grad_input, grad_weight)):
        raise ValueError("method='xla' is the product as written, partitioned by GSPMD: it runs through the op "
                         "(allgather_matmul, matmul_reduce_scatter), not inside a shard_map")
    plan = _ActivationRingPlan(
        axis,
        config,
        Decomposition.baseline() if grad_input is None else grad_input,
        DEFAULT_GRAD_WEIGHT if grad_weight is None else grad_weight,
    )
    checks = (
        ("", plan.config, collective),
        ("grad_input: ", plan.grad_input, slot_collective(collective, "grad_input")),
        ("grad_weight: ", plan.grad_weight, slot_collective(collective, "grad_weight")),
    )
    for prefix, cfg, coll in checks:
        try:
            check_decomposition(
                cfg, collective=coll, block_rows=block_rows, axis_size=lax.axis_size(axis),
                dtype=jnp.dtype(x.dtype).name,
            )
        except ValueError as exc:
            if not prefix:
                raise
            raise ValueError(f"{prefix}{exc}") from None
    return plan


# ---- custom VJPs -------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _allgather_matmul_vjp(x: jax.Array, w: jax.Array, plan: _ActivationRingPlan) -> jax.Array:
    return _allgather_matmul(x, w, plan.axis, plan.config)


def _allgather_matmul_fwd(x, w, plan: _ActivationRingPlan):
    if plan.grad_weight.fuse:
        out, gathered = _allgather_matmul(x, w, plan.axis, plan.config, keep=True)
        return out, (gathered, w)
    return _allgather_matmul(x, w, plan.axis, plan.config), (x, w)


def _allgather_matmul_bwd(plan: _ActivationRingPlan, residuals, dy, addend=None, others: tuple = ()):
    """``(dx, dW)``.  ``addend``: what other products of the gathered x add to its input gradient; ``others``:
    ``(dy_i, w_i)`` of the products that reused it (`allgather_matmul_keep_grads_shard`), whose input gradients
    the one reduce-scatter ring computes with this op's, chunk by chunk."""
    saved, w = residuals  # saved: all_gather(x) when fused, else x
    dx = _matmul_reduce_scatter(dy, w.T, plan.axis, plan.grad_input, addend=addend,
                                others=tuple((d.astype(dy.dtype), v.T.astype(w.dtype)) for d, v in others))
    if plan.grad_weight.fuse:
        dw = _contract(saved, dy, _single_dtype(plan.grad_weight))
    else:
        dw = _allgather_grad_weight(saved, dy, plan.axis, plan.grad_weight)
    return _cotangent(dx, saved), _cotangent(dw, w)


_allgather_matmul_vjp.defvjp(_allgather_matmul_fwd, _allgather_matmul_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_reduce_scatter_vjp(x: jax.Array, w: jax.Array, plan: _ActivationRingPlan) -> jax.Array:
    return _matmul_reduce_scatter(x, w, plan.axis, plan.config)


def _matmul_reduce_scatter_fwd(x, w, plan: _ActivationRingPlan):
    return _matmul_reduce_scatter(x, w, plan.axis, plan.config), (x, w)


def _matmul_reduce_scatter_bwd(plan: _ActivationRingPlan, residuals, dy):
    x, w = residuals
    if plan.grad_weight.fuse:
        dx, dwt = _fused_gradients(dy, w.T, x, plan.axis, plan.grad_input, plan.grad_weight)
    else:
        dx = _allgather_matmul(dy, w.T, plan.axis, plan.grad_input)
        dwt = _allgather_grad_weight(dy, x, plan.axis, plan.grad_weight)
    return _cotangent(dx, x), _cotangent(dwt.T, w)


_matmul_reduce_scatter_vjp.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)


def _cotangent(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """``grad`` as the cotangent of ``primal``: in its dtype, and summed ONCE over the mesh axes
    that ``grad`` varies over and ``primal`` does not (the data axes of a weight gradient).

    Without `check_vma` nothing is known to vary; `shard_map`'s transpose then sums the
    cotangent of an input replicated over an axis, once, at its boundary.
    """
    grad = grad.astype(primal.dtype)
    extra = tuple(sorted(_varying_axes(grad) - _varying_axes(primal)))
    if extra:
        grad = lax.psum(grad, extra)
    return _vary_like(grad, primal)


# ---- the kernels (plain JAX, differentiable by autodiff) ---------------------------------


def _allgather_matmul(x, w, axis: str, config: Decomposition, *, keep: bool = False):
    """``all_gather(x) @ w``; with ``keep``, also ``all_gather(x)`` (as the pair)."""
    if config.method == "baseline":
        if not keep:
            return baseline_allgather_matmul_shard(x, w, axis=axis)
        gathered = lax.all_gather(x, axis, axis=x.ndim - 2, tiled=True)
        return jnp.matmul(gathered, w), gathered
    out, _, gathered = _gather_ring(x, axis=axis, config=config, rhs=w, keep=keep)
    return (out, gathered) if keep else out


def _allgather_grad_weight(u, v, axis: str, config: Decomposition) -> jax.Array:
    """``all_gather(u)ᵀ @ v``, in the accumulator dtype of ``config``."""
    if config.method == "baseline":
        return baseline_allgather_grad_weight_shard(u, v, axis=axis)
    _, acc, _ = _gather_ring(u, axis=axis, config=config, v=v, acc_dtype=_acc_dtype(config, u.dtype))
    return acc


def _fused_gradients(dy, wt, x, axis: str, grad_input: Decomposition, grad_weight: Decomposition):
    """``(all_gather(dy) @ wt, all_gather(dy)ᵀ @ x)`` from one gather of ``dy``.

    The gather is ``grad_input``'s (one `all_gather`, or its ring); ``grad_weight`` sets the
    dtype of the dW accumulator.
    """
    if grad_input.method == "baseline":
        gathered = lax.all_gather(dy, axis, axis=dy.ndim - 2, tiled=True)
        return jnp.matmul(gathered, wt), _contract(gathered, x, _single_dtype(grad_weight))
    dx, dwt, _ = _gather_ring(
        dy, axis=axis, config=grad_input, rhs=wt, v=x, acc_dtype=_acc_dtype(grad_weight, dy.dtype)
    )
    return dx, dwt


def _acc_dtype(config: Decomposition, dtype) -> jnp.dtype:
    """The dtype of a ring's weight-gradient accumulator (the collective's default if unset)."""
    mode = resolved_accumulate(config, collective=Collective.ALLGATHER_GRAD_WEIGHT, dtype=jnp.dtype(dtype).name)
    return jnp.dtype(jnp.float32) if mode == "float32" else jnp.dtype(dtype)


def _single_dtype(config: Decomposition):
    """The output dtype of one whole local weight-gradient matmul (None: the input dtype)."""
    return jnp.float32 if config.accumulate == "float32" else None


def _contract(u: jax.Array, v: jax.Array, preferred=None) -> jax.Array:
    """``uᵀ @ v`` over every dimension but the last: ``[..., R, A] x [..., R, B] -> [A, B]``."""
    dims = tuple(range(u.ndim - 1))
    return jnp.tensordot(u, v, axes=(dims, dims), preferred_element_type=preferred)


def _matmul_reduce_scatter(x, w, axis: str, config: Decomposition, *, addend: jax.Array | None = None,
                           others: tuple[tuple[jax.Array, jax.Array], ...] = ()) -> jax.Array:
    """``psum_scatter(x @ w + Σ x_i @ w_i + addend)`` over the M rows (checked by the caller).  ``others``: more
    products ``(x_i, w_i)`` of the same rows and N (a group's input gradients, `collective_matmul.ops.share`), computed
    piece by piece with ``x @ w`` at every step of the ring: no concatenated copy of their operands; ``addend``
    (``[..., M, N]``) is added to this device's partial product before the sum."""
    pairs = ((x, w), *others)
    if config.method == "baseline":
        if addend is None and not others:
            return baseline_matmul_reduce_scatter_shard(x, w, axis=axis)
        partial = reduce(operator.add, (jnp.matmul(u, v) for u, v in pairs))
        partial = partial if addend is None else partial + addend
        return lax.psum_scatter(partial, axis, scatter_dimension=partial.ndim - 2, tiled=True)
    size = lax.axis_size(axis)
    rows = x.shape[-2] // size
    mode = resolved_accumulate(config, collective=Collective.MATMUL_REDUCE_SCATTER, dtype=jnp.dtype(x.dtype).name)
    acc_dtype = jnp.float32 if mode == "float32" else x.dtype
    ring = _Ring(axis, size, config)
    tiling = _Tiling((*x.shape[:-2], rows), config.chunks)

    def part(offset, pairs=pairs) -> Pieces:
        """This device's partial products for the output block ``i + offset`` (of ``pairs``: the operands as the
        step before fenced them)."""
        start = ((ring.index + offset) % size) * rows
        products = tuple(
            reduce(operator.add, (
                jnp.matmul(lax.dynamic_slice(u, (*lead, start + row, 0), (*tiling.piece, u.shape[-1])), v,
                           preferred_element_type=acc_dtype) for u, v in pairs))
            for *lead, row in tiling.offsets
        )
        if addend is None:
            return products
        return tuple(p + lax.dynamic_slice(addend, (*lead, start + row, 0), (*tiling.piece, w.shape[-1])).astype(
            acc_dtype) for p, (*lead, row) in zip(products, tiling.offsets, strict=True))

    add = lambda a, b: tuple(u + v for u, v in zip(a, b, strict=True))  # noqa: E731
    # Every step fences what it sends with the product it adds and the operands the next step multiplies
    # (`_Ring.fence`): each step's products then wait for the step before, and no compiler merges them into one.
    if config.direction == "unidirectional":
        # Accumulator travels to i+1; at step t device i adds its part of block i-t-1.
        def step(t, carry):
            acc, operands = carry
            sent, products, operands = ring.fence(ring.send_up(acc), part(-t - 1, operands), operands)
            return add(sent, products), operands

        acc, _ = ring.loop(step, ring.fence(part(-1), pairs), 1, size)
    else:
        # Stream A travels up (to i+1) for `hops_a` hops and ends with this device's own part;
        # stream B travels down for `hops_b` hops and only carries the other devices' parts.
        hops_a, hops_b = ring.hops

        def middle(t, carry):
            acc_a, acc_b, operands = carry
            sent_a, sent_b, part_a, part_b, operands = ring.fence(
                ring.send_up(acc_a), ring.send_down(acc_b), part(hops_a - t, operands), part(t - hops_b, operands),
                operands)
            return add(sent_a, part_a), add(sent_b, part_b), operands

        acc_a, acc_b, operands = ring.loop(middle, ring.fence(part(hops_a), part(-hops_b), pairs), 1, hops_b)
        sent_a, acc_b, last, operands = ring.fence(ring.send_up(acc_a), ring.send_down(acc_b),
                                                   part(hops_a - hops_b, operands), operands)
        acc_a = add(sent_a, last)
        if hops_a > hops_b:
            acc_a = add(ring.send_up(acc_a), part(0, operands))
        acc = add(acc_a, acc_b)
    return tiling.assemble(acc).astype(x.dtype)


def _gather_ring(
    u: jax.Array,
    *,
    axis: str,
    config: Decomposition,
    rhs: jax.Array | None = None,
    v: jax.Array | None = None,
    acc_dtype=None,
    keep: bool = False,
):
    """Move the blocks of ``u`` round the ring once and use every block where it arrives.

    For each block ``u_j`` (rows j of ``all_gather(u)``) a device holds, it computes what is
    asked: with ``rhs``, rows j of ``all_gather(u) @ rhs``; with ``v``, adds ``u_jᵀ @ v[rows j]``
    into an accumulator of ``acc_dtype`` that stays on the device; with ``keep``, rows j of
    ``all_gather(u)`` itself.  Row results are written in place, or collected, concatenated and
    rotated when ``config.accumulate == 'concat'``.  Which block arrives when is the
    `RingSchedule`'s; what is done with it, `_BlockUses`'.

    Returns:
        ``(all_gather(u) @ rhs, all_gather(u)ᵀ @ v, all_gather(u))``, None where not asked.
    """
    ring = _Ring(axis, lax.axis_size(axis), config)
    uses = _BlockUses(u, ring, config, rhs=rhs, v=v, acc_dtype=acc_dtype, keep=keep)
    schedule = RingSchedule.of(config.direction, ring.size)
    # On older JAX (0.10) an optimization barrier makes all it fences vary over every mesh axis one of them
    # varies over (each step fences its blocks with its products): the blocks and the state start so, or the
    # loop's carry would change type at its first fence
    own, state = _vary_together((uses.tiling.split(u), uses.start()), rhs, v)
    state, runs = _run_schedule(schedule, ring, own, uses.use, state)
    return uses.finish(state, runs, first=schedule.first)


def _run_schedule(schedule: RingSchedule, ring: _Ring, own: Pieces, use, state):
    """Run ``schedule``: at each step send the blocks that travel on, then ``use(state, pieces, offset)`` every
    block held, which returns the new state and its collected results.

    `RingSchedule.loop`'s steps run in one `_Ring.scan`, the others in Python; each step leaves through one
    `_Ring.fence`.

    Returns:
        The final state and the collected results as runs ``(offset of the run's first block, per result its
        array, or its `_Ring.scan` output, reversed or not)``, in the order made (`_BlockUses.finish` sorts
        them).  ``reversed`` is None for one block.
    """
    moves = [ring.send_down if stream.sign > 0 else ring.send_up for stream in schedule.streams]
    held: tuple[Pieces, ...] = (own,) * len(moves)
    runs: list[tuple[int, list, bool | None]] = []

    def outside(step: int, held, state):
        sent = {j: moves[j](held[j]) for j in schedule.sends(step)}
        offsets, used = [], []
        for arrival in schedule.arrivals(step):
            state, ys = use(state, held[arrival.stream], arrival.offset)
            offsets.append(arrival.offset)
            used.append(ys)
        sent, state, used = ring.fence(sent, state, used)  # the next blocks' products wait for these
        runs.extend((offset, list(ys), None) for offset, ys in zip(offsets, used, strict=True))
        return tuple(sent.get(j, pieces) for j, pieces in enumerate(held)), state

    def body(carry, t):
        held, state = carry
        sent = tuple(move(pieces) for move, pieces in zip(moves, held, strict=True))
        collected: tuple = ()
        for stream, pieces in zip(schedule.streams, held, strict=True):
            state, ys = use(state, pieces, t if stream.sign > 0 else -t)
            collected += ys
        sent, state, collected = ring.fence(sent, state, collected)
        return (sent, state), collected

    lower, upper = schedule.loop
    for step in range(lower):
        held, state = outside(step, held, state)
    (held, state), ys = ring.scan(body, (held, state), lower, upper)
    if upper > lower:
        width = len(ys) // len(moves) if ys is not None else 0
        for j, stream in enumerate(schedule.streams):
            first = min(stream.sign * lower, stream.sign * (upper - 1))
            runs.append((first, [_leaf(ys, j * width + k) for k in range(width)], stream.sign < 0))
    for step in range(upper, schedule.steps):
        held, state = outside(step, held, state)
    return state, runs


class _BlockUses:
    """What a gathering ring computes with each block it holds: the row results and the weight-gradient sum."""

    def __init__(self, u: jax.Array, ring: _Ring, config: Decomposition, *, rhs, v, acc_dtype, keep: bool):
        self.u, self.ring, self.rhs, self.v, self.acc_dtype, self.keep = u, ring, rhs, v, acc_dtype, keep
        self.tiling = _Tiling(u.shape[:-1], config.chunks)
        self.rows = u.shape[-2]
        self.concat = config.accumulate == "concat"
        self.outputs = (
            *([_RowOutput(rhs=rhs, width=rhs.shape[-1], dtype=jnp.result_type(u, rhs), likes=(u, rhs))]
              if rhs is not None else []),
            *([_RowOutput(rhs=None, width=u.shape[-1], dtype=u.dtype, likes=(u,))] if keep else []),
        )

    def start(self):
        """The state before the first block: ``(row buffers, accumulator)`` (no buffers when concatenating)."""
        u, v = self.u, self.v
        buffers = () if self.concat else tuple(
            _vary_like(jnp.zeros((*u.shape[:-2], self.ring.size * self.rows, out.width), out.dtype), *out.likes)
            for out in self.outputs
        )
        acc = None if v is None else _vary_like(jnp.zeros((u.shape[-1], v.shape[-1]), self.acc_dtype), u, v)
        return buffers, acc

    def use(self, state, pieces: Pieces, offset):
        """Use block ``i + offset``: returns the new state and the collected results."""
        buffers, acc = state
        results = [out.of(pieces) for out in self.outputs]
        if self.concat:
            return (buffers, self._add_products(acc, pieces, offset)), tuple(self.tiling.assemble(r) for r in results)
        start = self._start(offset)
        written = []
        for buffer, result in zip(buffers, results, strict=True):
            for (*lead, row), y in zip(self.tiling.offsets, result, strict=True):
                buffer = lax.dynamic_update_slice(buffer, y, (*lead, start + row, 0))
            written.append(buffer)
        return (tuple(written), self._add_products(acc, pieces, offset)), ()

    def finish(self, state, runs, *, first: int):
        """``(product, accumulator, gathered)`` from the final state and the collected runs (None where not asked)."""
        buffers, acc = state
        if self.concat:
            runs = sorted(runs, key=lambda run: run[0])
            columns = [
                [a for _, parts, rev in runs for a in ([parts[k]] if rev is None else _segment(parts[k], reverse=rev))]
                for k in range(len(self.outputs))
            ]
            row_axis = self.u.ndim - 2
            shift = ((self.ring.index + first) % self.ring.size) * self.rows
            outputs = [jnp.roll(jnp.concatenate(parts, axis=row_axis), shift, axis=row_axis) for parts in columns]
        else:
            outputs = list(buffers)
        product = outputs.pop(0) if self.rhs is not None else None
        gathered = outputs.pop(0) if self.keep else None
        return product, acc, gathered

    def _start(self, offset):
        return ((self.ring.index + offset) % self.ring.size) * self.rows

    def _add_products(self, acc, pieces: Pieces, offset):
        if acc is None:
            return None
        v, start = self.v, self._start(offset)
        for (*lead, row), piece in zip(self.tiling.offsets, pieces, strict=True):
            rows_of_v = lax.dynamic_slice(v, (*lead, start + row, 0), (*self.tiling.piece, v.shape[-1]))
            acc = acc + _contract(piece, rows_of_v, self.acc_dtype)
        return acc


@dataclass(frozen=True, kw_only=True)
class _RowOutput:
    """One row result of a gathering ring: ``block @ rhs`` (or the block itself, ``rhs=None``), ``width`` columns
    of ``dtype``, varying like ``likes``."""

    rhs: jax.Array | None
    width: int
    dtype: Any
    likes: tuple

    def of(self, pieces: Pieces) -> list[jax.Array]:
        """The result of every piece of a block."""
        return list(pieces) if self.rhs is None else [jnp.matmul(p, self.rhs) for p in pieces]


def _leaf(ys, j: int):
    """Output ``j`` of `_Ring.scan`'s collected results (None when the loop made no step)."""
    return None if ys is None else ys[j]


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

    @staticmethod
    def fence(*values):
        """``values`` through one optimization barrier: what a step sends and what it computed leave it together.

        Without it XLA may merge the products of an unrolled ring that share an operand into one product of the
        concatenated blocks (its GPU pipeline's dot merger does), which then waits for every permute: the ring
        becomes gather-then-multiply and its permutes run synchronously.  Fenced, each step's products depend on
        the step before, so they stay one per step, each beside the next step's permute.
        """
        return lax.optimization_barrier(values)

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


def _vary_together(tree, *likes: jax.Array | None):
    """Every array of ``tree`` marked as varying over each mesh axis one of them or of ``likes`` varies over
    (`check_vma`)."""
    leaves = jax.tree.leaves((tree, likes))
    return jax.tree.map(lambda value: _vary_like(value, *leaves), tree)


def _vary_like(value: jax.Array, *likes: jax.Array) -> jax.Array:
    """Mark an array as varying over every mesh axis one of ``likes`` varies over (`check_vma`)."""
    wanted = frozenset().union(*map(_varying_axes, likes))
    missing = tuple(sorted(wanted - _varying_axes(value)))
    return lax.pcast(value, missing, to="varying") if missing else value
