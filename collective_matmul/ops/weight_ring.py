"""Rings of weight shards: the collective matmuls of FSDP (per shard) and their custom VJP.

Under FSDP a weight ``w [K, N]`` is sharded over the ring on one of its dimensions and gathered before every
product ``y = x @ w`` (forward, and again for the input gradient), while the activation ``x [R, K]`` holds this
device's own rows (its share of the batch); the weight gradient ``xᵀ @ dy`` is summed over the ring and
scattered back onto the weight's layout.  Each is one of the activation rings of `collective_matmul.ops.ring`
on transposed operands, so every knob (direction, chunks, unroll, accumulate) means what it means there:

1. ``weight_dim="n"`` (the weight sharded on its output dimension): ``yᵀ = all_gather(wᵀ) @ xᵀ`` is an
   all-gather matmul of the weight's rows; each step writes the block of ``y``'s columns of the shard it holds.
2. ``weight_dim="k"`` (sharded on the contracting dimension, FSDP's usual layout): ``yᵀ = all_gather(w)ᵀ @ xᵀ``
   is the weight-gradient ring; each step multiplies the matching columns of the local ``x`` by the shard it
   holds and accumulates.
3. The input gradient ``dx = dy @ all_gather(w)ᵀ`` is the other form (a weight sharded on ``k`` is, transposed,
   sharded on its output dimension), gathered again on a ring of its own; with ``grad_weight.fuse`` (as for the
   activation ops, the backward reuses what the forward gathered: what autodiff of the plain product does) the
   forward keeps the weight its ring gathered (``K x N`` more memory per device until the backward) and ``dx``
   is a local product.
4. The weight gradient ``dw = xᵀ @ dy`` is the matmul reduce-scatter ring over the weight's sharded dimension:
   an accumulator for each destination's block travels round the ring, every device adding its rows' part.
   It is summed over the batch axes (data parallelism beside FSDP) once, at the end.

A second mesh axis (``tensor_axis``, tensor parallelism) may shard the weight's other dimension: the ring is
then over the local slice; with ``weight_dim="n"`` the product of a contracting slice is summed over it.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from collective_matmul.ops.ring import (
    _acc_dtype,
    _allgather_grad_weight,
    _allgather_matmul,
    _cotangent,
    _gather_ring,
    _matmul_reduce_scatter,
)
from collective_matmul.planning.decomposition import DEFAULT_GRAD_WEIGHT, Decomposition
from collective_matmul.planning.problem import Collective, check_decomposition

WEIGHT_DIMS = ("k", "n")
# What each weight-gather product is, as an activation ring on transposed operands (1.-4. above).
_DUAL = {("forward", "n"): Collective.ALLGATHER_MATMUL, ("forward", "k"): Collective.ALLGATHER_GRAD_WEIGHT,
         ("grad_input", "n"): Collective.ALLGATHER_GRAD_WEIGHT, ("grad_input", "k"): Collective.ALLGATHER_MATMUL,
         ("grad_weight", "n"): Collective.MATMUL_REDUCE_SCATTER, ("grad_weight", "k"): Collective.MATMUL_REDUCE_SCATTER}


class _WeightRingPlan(NamedTuple):
    """The static half of one call: the ring, the weight's sharded dimension, the three configs."""

    axis: str
    weight_dim: str
    config: Decomposition
    grad_input: Decomposition
    grad_weight: Decomposition
    tensor_axis: str | None

    @property
    def keep(self) -> bool:
        """Whether the forward keeps the gathered weight for the input gradient (``grad_weight.fuse``)."""
        return self.grad_weight.fuse


def weight_allgather_matmul_shard(
    x: jax.Array,
    w: jax.Array,
    *,
    axis: str,
    weight_dim: str,
    config: Decomposition,
    grad_input: Decomposition | None = None,
    grad_weight: Decomposition | None = None,
    tensor_axis: str | None = None,
) -> jax.Array:
    """``x @ all_gather(w)`` with the weight's shards moved round the ring over ``axis``, decomposed.

    Args:
        x: this device's rows ``[..., K']`` (``K' = K``, or ``K / T`` where ``tensor_axis`` shards the weight's
            rows, with ``weight_dim="n"``).
        w: the local shard, ``[K/P, N']`` (``weight_dim="k"``; ``N' = N`` or ``N / T``) or ``[K', N/P]`` (``"n"``).
        axis: the ring's mesh axis (FSDP's).
        weight_dim: ``"k"`` or ``"n"``: the weight dimension sharded over ``axis``.
        config: the forward's decomposition (a ``weight_allgather_matmul_<weight_dim>`` problem).
        grad_input: ``dx``'s (the other weight dimension's problem, m=M, k=N, n=K), where the weight is gathered
            again.  None: the baseline.
        grad_weight: ``dw``'s (a ``reduce_scatter_grad_weight`` problem); ``fuse=True`` keeps the forward's
            gathered weight for ``dx`` instead of gathering it again (``grad_input`` then unused).  None:
            ``Decomposition.baseline(fuse=True)``, what autodiff of the plain product does.
        tensor_axis: the mesh axis sharding the weight's other dimension, if any.

    Returns:
        ``[..., N']`` (``weight_dim="k"``) or ``[..., N]`` summed over ``tensor_axis`` (``"n"``).

    Raises:
        ValueError: if ``weight_dim`` is neither, or a config is not valid for these shapes (a backward
            config's message starts with its argument name).
    """
    if weight_dim not in WEIGHT_DIMS:
        raise ValueError(f"weight_dim={weight_dim!r}: give 'k' (the weight sharded on its contracting dimension, "
                         "FSDP's usual layout) or 'n' (on its output dimension)")
    plan = _plan(x, w, axis, weight_dim, config, grad_input, grad_weight, tensor_axis)
    return _weight_vjp(x, w, plan)


def _plan(x, w, axis, weight_dim, config, grad_input, grad_weight, tensor_axis) -> _WeightRingPlan:
    """The call's plan, each config checked as the activation ring it runs as (1.-4. of the module)."""
    size = lax.axis_size(axis)
    rows = w.shape[0] if weight_dim == "k" else w.shape[1]  # the weight's rows of one ring block
    dtype = jnp.dtype(x.dtype).name
    configs = {"forward": config, "grad_input": grad_input or Decomposition.baseline(),
               "grad_weight": grad_weight or DEFAULT_GRAD_WEIGHT}
    for slot, c in configs.items():
        if c.method == "xla":
            raise ValueError(f"{slot}: method='xla' is the product as written, partitioned by GSPMD: it runs "
                             "through the op (weight_allgather_matmul), not inside a shard_map")
        if c.fuse and slot != "grad_weight":
            raise ValueError(f"{slot}: fuse=True is the weight gradient's (the backward keeps the gathered weight); "
                             "remove it")
        try:
            check_decomposition(c.model_copy(update={"fuse": False}), collective=_DUAL[slot, weight_dim],
                                block_rows=rows, axis_size=size, dtype=dtype)
        except ValueError as exc:
            raise ValueError(f"{slot}: {exc}" if slot != "forward" else str(exc)) from None
    return _WeightRingPlan(axis, weight_dim, configs["forward"], configs["grad_input"], configs["grad_weight"],
                           tensor_axis)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _weight_vjp(x: jax.Array, w: jax.Array, plan: _WeightRingPlan) -> jax.Array:
    return _forward(x, w, plan)[0]


def _forward(x: jax.Array, w: jax.Array, plan: _WeightRingPlan):
    """``(y, the gathered weight or None)``: the gathered weight where the plan keeps it for the backward."""
    rows = x.reshape(-1, x.shape[-1])  # [R, K']: this device's rows
    if plan.weight_dim == "n":  # yᵀ = all_gather(wᵀ) @ xᵀ, wᵀ [N/P, K']
        out = _allgather_matmul(w.T, rows.T, plan.axis, plan.config, keep=plan.keep)
        (yt, kept) = out if plan.keep else (out, None)
        y = yt.T if plan.tensor_axis is None else lax.psum(yt.T, plan.tensor_axis)
    elif plan.config.method == "baseline":  # y = x @ all_gather(w)
        gathered = lax.all_gather(w, plan.axis, axis=0, tiled=True)
        y, kept = jnp.matmul(rows, gathered), gathered if plan.keep else None
    else:  # yᵀ = Σ_j w_jᵀ @ x[:, K_j]ᵀ, accumulated as the shards pass
        _, yt, kept = _gather_ring(w, axis=plan.axis, config=plan.config, v=rows.T,
                                   acc_dtype=_acc_dtype(plan.config, w.dtype), keep=plan.keep)
        y = yt.T
    y = y.astype(jnp.result_type(x, w))
    return y.reshape(*x.shape[:-1], y.shape[-1]), kept


def _weight_fwd(x, w, plan: _WeightRingPlan):
    y, kept = _forward(x, w, plan)
    return y, (x, w, kept)


def _weight_bwd(plan: _WeightRingPlan, residuals, dy):
    x, w, kept = residuals
    rows, d_rows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]).astype(x.dtype)
    if plan.weight_dim == "n":
        # dx = dy @ all_gather(w)ᵀ contracts the sharded N: dxᵀ = all_gather(wᵀ)ᵀ @ dyᵀ, the accumulating ring
        if kept is not None:  # kept: all_gather(wᵀ) [N, K']
            dx = jnp.matmul(d_rows, kept)
        else:
            dx = _allgather_grad_weight(w.T, d_rows.T, plan.axis, plan.grad_input).T
        dw = _matmul_reduce_scatter(d_rows.T, rows, plan.axis, plan.grad_weight).T  # dwᵀ [N/P, K'] scattered
    else:
        # dx = dy @ all_gather(w)ᵀ writes K blocks: dxᵀ = all_gather(w) @ dyᵀ, the all-gather ring of w's rows
        if kept is not None:  # kept: all_gather(w) [K, N']
            dx = jnp.matmul(d_rows, kept.T)
        else:
            dx = _allgather_matmul(w, d_rows.T, plan.axis, plan.grad_input).T
        dw = _matmul_reduce_scatter(rows.T, d_rows, plan.axis, plan.grad_weight)  # [K/P, N'] scattered
    # dx varies over the tensor axis where w's N is sharded over it (k): _cotangent sums it there; dw is summed
    # over the batch axes x varies over and w does not
    return _cotangent(dx.reshape(x.shape), x), _cotangent(dw, w)


_weight_vjp.defvjp(_weight_fwd, _weight_bwd)


def reduce_scatter_grad_weight_shard(u: jax.Array, v: jax.Array, *, axis: str, config: Decomposition) -> jax.Array:
    """``psum_scatter(uᵀ @ v)`` over ``axis`` onto the rows of the result (the weight gradient of FSDP alone), the
    reduce-scatter ring of `collective_matmul.ops.ring` on ``uᵀ``.  Differentiable by JAX autodiff.

    Args:
        u: this device's rows ``[..., K]``.
        v: the same rows ``[..., N]``.
        config: the decomposition (a ``reduce_scatter_grad_weight`` problem).

    Returns:
        ``[K/P, N]``: this device's rows of ``uᵀ @ v`` summed over the ring, contracting every row.

    Raises:
        ValueError: if the rows differ or ``config`` is not valid for them.
    """
    if u.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"reduce_scatter_grad_weight: expected u [..., K] and v [..., N] with the same rows, got "
                         f"{u.shape} and {v.shape}")
    if config.method == "xla":
        raise ValueError("method='xla' is the product as written, partitioned by GSPMD: it runs through the op "
                         "(reduce_scatter_grad_weight), not inside a shard_map")
    size = lax.axis_size(axis)
    if u.shape[-1] % size:
        raise ValueError(f"reduce_scatter_grad_weight: K={u.shape[-1]} is not divisible by the ring size {size}")
    check_decomposition(config, collective=Collective.MATMUL_REDUCE_SCATTER, block_rows=u.shape[-1] // size,
                        axis_size=size, dtype=jnp.dtype(u.dtype).name, rows="k / axis_size")
    rows = u.reshape(-1, u.shape[-1])
    return _matmul_reduce_scatter(rows.T, v.reshape(-1, v.shape[-1]), axis, config)

