"""Collective matmul ops on global arrays (wrapping the per-shard kernels in `shard_map`).

Each op's backward runs its own configs (``grad_input``, ``grad_weight``): see
`collective_matmul.ops.ring` and ``docs/decompositions.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul.ops.baseline import baseline_allgather_matmul_shard, baseline_matmul_reduce_scatter_shard
from collective_matmul.ops.ring import (
    allgather_grad_weight_shard,
    allgather_matmul_keep_grads_shard,
    allgather_matmul_keep_shard,
    allgather_matmul_shard,
    matmul_reduce_scatter_shard,
)
from collective_matmul.ops.share import SharedGather
from collective_matmul.ops.weight_ring import reduce_scatter_grad_weight_shard, weight_allgather_matmul_shard
from collective_matmul.planning.decomposition import DEFAULT_GRAD_WEIGHT, Decomposition
from collective_matmul.planning.problem import Collective, Problem

BatchAxis = str | tuple[str, ...] | None


def allgather_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    config: Decomposition,
    batch_axis: BatchAxis = None,
    grad_input: Decomposition | None = None,
    grad_weight: Decomposition | None = None,
) -> jax.Array:
    """``all_gather(x) @ w`` over mesh axis ``axis``, decomposed as ``config`` says.

    Args:
        x: ``[..., M, K]``, M sharded over ``axis`` (the first batch dimension may be sharded
            over ``batch_axis``).
        w: ``[K, N]``, N sharded over ``axis``.
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis that forms the ring.
        config: the decomposition of the forward.
        batch_axis: mesh axis (or axes) sharding the first leading dimension of ``x``.
        grad_input: the decomposition of ``dx``, a ``matmul_reduce_scatter`` problem with k and
            n swapped; None: the baseline.
        grad_weight: the decomposition of ``dW = all_gather(x)ᵀ @ dy``, an
            ``allgather_grad_weight`` problem (m, k, n as the forward's).  ``fuse=True`` keeps
            the gathered x from the forward instead of gathering it again.  None:
            ``Decomposition.baseline(fuse=True)`` (what autodiff of the baseline does).  dW is
            summed over ``batch_axis`` once.

    Returns:
        ``[..., M, N]`` with N sharded over ``axis``.

    Raises:
        ValueError: if the shapes do not fit the mesh or a config is invalid for them.
    """
    lead = _check(x, w, mesh, axis, batch_axis, sharded=(("M", -2, "x"), ("N", -1, "w")))
    specs = _specs(Collective.ALLGATHER_MATMUL, lead, axis)
    if _left_to_xla(config, grad_input, grad_weight):
        return _as_written(Collective.ALLGATHER_MATMUL, x, w, mesh=mesh, specs=specs)
    body = partial(allgather_matmul_shard, axis=axis, config=config, grad_input=grad_input, grad_weight=grad_weight)
    return _run(body, x, w, mesh=mesh, specs=specs)


def allgather_matmul_keep(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    config: Decomposition,
    batch_axis: BatchAxis = None,
    grad_input: Decomposition | None = None,
    grad_weight: Decomposition | None = None,
    group: SharedGather | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`allgather_matmul` that also returns what it gathered, for `gathered_matmul` to reuse.

    The gathered ``x`` comes back as ``[P, ..., M, K]``, sharded over ``axis`` on its first dimension: row ``i``
    is device ``i``'s copy of ``all_gather(x)`` (the one the ring or the all-gather left there), so a later
    product of the same activation needs no collective.  With a ``group``, the input gradients of the
    `gathered_matmul` calls of that group join this op's ONE reduce-scatter ring as one product of the summed N
    (its config ``group.grad_input(N)`` where given); any other cotangent of the gathered ``x`` is added to it
    (`collective_matmul.ops.share`).  Nothing reuses it: XLA drops the copy and the zero it adds.

    Raises:
        ValueError: as `allgather_matmul`; and for ``method="xla"``, which has no gathered value to hand on.
    """
    lead = _check(x, w, mesh, axis, batch_axis, sharded=(("M", -2, "x"), ("N", -1, "w")))
    if _left_to_xla(config, grad_input, grad_weight):
        raise ValueError("allgather_matmul_keep: method='xla' leaves the gather to XLA, which shares it itself")
    call = _Keep(mesh, axis, _specs(Collective.ALLGATHER_MATMUL, lead, axis), P(axis, *lead, None, None), config,
                 grad_input, grad_weight, group)
    return _keep(*placed(mesh, call.specs[:2], x, w), call)


@dataclass(frozen=True, eq=False)
class _Keep:
    """The static half of one `allgather_matmul_keep` call (hashed by identity)."""

    mesh: Mesh
    axis: str
    specs: tuple[P, P, P]  # x, w, out
    stack_spec: P
    config: Decomposition
    grad_input: Decomposition | None
    grad_weight: Decomposition | None
    group: SharedGather | None

    def configs(self, grad_input: Decomposition | None = None) -> dict:
        return dict(axis=self.axis, config=self.config, grad_input=grad_input or self.grad_input,
                    grad_weight=self.grad_weight)

    @property
    def fuse(self) -> bool:
        """Whether the weight gradient is a product with the gathered ``x`` the forward kept (else x is gathered
        again): what the backward keeps, the gathered copy or the local ``x``."""
        return (DEFAULT_GRAD_WEIGHT if self.grad_weight is None else self.grad_weight).fuse


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _keep(x: jax.Array, w: jax.Array, call: _Keep) -> tuple[jax.Array, jax.Array]:
    return _gather_keeping(x, w, call)


def _gather_keeping(x: jax.Array, w: jax.Array, call: _Keep) -> tuple[jax.Array, jax.Array]:
    x_spec, w_spec, out_spec = call.specs

    def body(x, w):
        y, gathered = allgather_matmul_keep_shard(x, w, **call.configs())
        return y, gathered[None]

    return jax.shard_map(body, mesh=call.mesh, in_specs=(x_spec, w_spec), out_specs=(out_spec, call.stack_spec))(x, w)


def _keep_fwd(x, w, call: _Keep):
    x, w = x.value, w.value  # `CustomVJPPrimal`s: the VJP takes symbolic zeros (see `_keep_bwd`)
    y, stack = _gather_keeping(x, w, call)
    return (y, stack), (stack if call.fuse else x, w)


def _keep_bwd(call: _Keep, residuals, cotangents):
    saved, w = residuals
    dy, d_stack = cotangents  # d_stack: a symbolic zero where only the group's readers read the gathered x
    dy = jnp.zeros(dy.shape, dy.dtype) if isinstance(dy, SymbolicZero) else dy
    others = call.group.take() if call.group is not None else []
    grad_input = None
    if others and call.group.grad_input is not None:  # the group's summed problem
        grad_input = call.group.grad_input(w.shape[-1] + sum(v.shape[-1] for _, v in others))
    x_spec, w_spec, out_spec = call.specs

    def body(saved, w, dy, d_stack, dys, ws):
        return allgather_matmul_keep_grads_shard(saved[0] if call.fuse else saved, w, dy,
                                                 None if d_stack is None else d_stack[0],
                                                 tuple(zip(dys, ws, strict=True)), **call.configs(grad_input))

    n = len(others)
    d_stack = None if isinstance(d_stack, SymbolicZero) else placed(call.mesh, (call.stack_spec,), d_stack)[0]
    in_specs = (call.stack_spec if call.fuse else x_spec, w_spec, out_spec,
                None if d_stack is None else call.stack_spec, (out_spec,) * n, (w_spec,) * n)
    fn = jax.shard_map(body, mesh=call.mesh, in_specs=in_specs, out_specs=(x_spec, w_spec))
    dys = placed(call.mesh, (out_spec,) * n, *(d for d, _ in others))
    ws = placed(call.mesh, (w_spec,) * n, *(v for _, v in others))
    return fn(saved, w, placed(call.mesh, (out_spec,), dy)[0], d_stack, dys, ws)


_keep.defvjp(_keep_fwd, _keep_bwd, symbolic_zeros=True)


def gathered_matmul(stack: jax.Array, w: jax.Array, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
                    group: SharedGather | None = None) -> jax.Array:
    """``all_gather(x) @ w`` from the gathered ``x`` an `allgather_matmul_keep` returned: a local product on every
    device, no collective.  Its weight gradient is the local product of the gathered ``x`` with the output
    gradient, summed over ``batch_axis``.  Its input gradient: with the ``group`` of that op, its output gradient
    and ``w`` go to the op's one reduce-scatter ring (`SharedGather.hand_over`); without, it is the local product,
    which autodiff sums into the stack's cotangent, which the op adds before its ring.

    Args:
        stack: ``[P, ..., M, K]`` as `allgather_matmul_keep` returned it.
        w: ``[K, N]``, N sharded over ``axis``.
        group: the `SharedGather` that op was given.

    Returns:
        ``[..., M, N]`` with N sharded over ``axis``, as `allgather_matmul` lays it.
    """
    if stack.shape[0] != mesh.shape[axis] or stack.ndim < 3 or stack.shape[-1] != w.shape[0]:
        raise ValueError(f"gathered_matmul: expected a stack [{mesh.shape[axis]}, ..., M, K] of "
                         f"allgather_matmul_keep with K={w.shape[0]}, got {stack.shape}")
    lead = _check(jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype), w, mesh, axis, batch_axis,
                  sharded=(("N", -1, "w"),))
    _, w_spec, out_spec = _specs(Collective.ALLGATHER_MATMUL, lead, axis)
    stack_spec = P(axis, *lead, None, None)
    product = jax.shard_map(lambda s, w: jnp.matmul(s[0], w), mesh=mesh, in_specs=(stack_spec, w_spec),
                            out_specs=out_spec)
    stack, w = placed(mesh, (stack_spec, w_spec), stack, w)
    if group is None:
        return product(stack, w)
    return _reuse(stack, w, _Reuse(product, group))


@dataclass(frozen=True, eq=False)
class _Reuse:
    """The static half of one `gathered_matmul` call of a group (hashed by identity)."""

    product: object  # the local product, a shard_map of (stack, w)
    group: SharedGather


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _reuse(stack: jax.Array, w: jax.Array, call: _Reuse) -> jax.Array:
    return call.product(stack, w)


def _reuse_fwd(stack, w, call: _Reuse):
    return call.product(stack, w), (stack, w)


def _reuse_bwd(call: _Reuse, residuals, dy):
    stack, w = residuals
    call.group.hand_over(dy, w)  # its input gradient: a chunk of every step of the group's one ring
    _, weight_vjp = jax.vjp(lambda w: call.product(stack, w), w)
    return None, weight_vjp(dy)[0]  # None: a symbolic zero, which adds nothing to the gathering op's backward


_reuse.defvjp(_reuse_fwd, _reuse_bwd)


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    config: Decomposition,
    batch_axis: BatchAxis = None,
    grad_input: Decomposition | None = None,
    grad_weight: Decomposition | None = None,
) -> jax.Array:
    """``reduce_scatter(x @ w)`` over mesh axis ``axis``, decomposed as ``config`` says.

    Args:
        x: ``[..., M, K]``, K sharded over ``axis``.
        w: ``[K, N]``, K sharded over ``axis``.
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis that forms the ring.
        config: the decomposition of the forward.
        batch_axis: mesh axis (or axes) sharding the first leading dimension of ``x``.
        grad_input: the decomposition of ``dx = all_gather(dy) @ wᵀ``, an ``allgather_matmul``
            problem with k and n swapped; None: the baseline.
        grad_weight: the decomposition of ``dWᵀ = all_gather(dy)ᵀ @ x``, an
            ``allgather_grad_weight`` problem with k and n swapped.  ``fuse=True`` runs one
            gather of dy (``grad_input``'s) for both gradients.  None:
            ``Decomposition.baseline(fuse=True)`` (what autodiff of the baseline does).  dW is
            summed over ``batch_axis`` once.

    Returns:
        ``[..., M, N]`` (the full product) with M sharded over ``axis``.

    Raises:
        ValueError: if the shapes do not fit the mesh or a config is invalid for them.
    """
    lead = _check(x, w, mesh, axis, batch_axis, sharded=(("M", -2, "x"), ("K", -1, "x")))
    specs = _specs(Collective.MATMUL_REDUCE_SCATTER, lead, axis)
    if _left_to_xla(config, grad_input, grad_weight):
        return _as_written(Collective.MATMUL_REDUCE_SCATTER, x, w, mesh=mesh, specs=specs)
    body = partial(matmul_reduce_scatter_shard, axis=axis, config=config, grad_input=grad_input,
                   grad_weight=grad_weight)
    return _run(body, x, w, mesh=mesh, specs=specs)


def allgather_grad_weight(
    u: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    config: Decomposition,
    batch_axis: BatchAxis = None,
) -> jax.Array:
    """``all_gather(u)ᵀ @ v`` (the weight gradient) over mesh axis ``axis``, decomposed.

    All-gather on the contracting dimension: M and the leading dimensions are contracted.
    Differentiable by JAX autodiff; ``config.fuse`` has no effect here.

    Args:
        u: ``[..., M, A]``, M sharded over ``axis`` (the first batch dimension may be sharded
            over ``batch_axis``).
        v: ``[..., M, B]``, B sharded over ``axis`` (the same leading dimensions, sharded alike).
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis that forms the ring.
        config: the decomposition to run.
        batch_axis: mesh axis (or axes) sharding the first leading dimension; the result is
            summed over it once.

    Returns:
        ``[A, B]`` with B sharded over ``axis``.

    Raises:
        ValueError: if the shapes do not fit the mesh or ``config`` is invalid for them.
    """
    if u.ndim < 2 or v.shape[:-1] != u.shape[:-1]:
        raise ValueError(
            f"expected u [..., M, A] and v [..., M, B] with equal leading dims, got {u.shape} and {v.shape}"
        )
    lead = _check(u, v, mesh, axis, batch_axis, sharded=(("M", -2, "x"), ("B", -1, "w")), contraction=False)
    specs = _specs(Collective.ALLGATHER_GRAD_WEIGHT, lead, axis)
    if config.method == "xla":
        return _as_written(Collective.ALLGATHER_GRAD_WEIGHT, u, v, mesh=mesh, specs=specs)
    kernel = partial(allgather_grad_weight_shard, axis=axis, config=config)
    body = kernel if batch_axis is None else lambda a, b: lax.psum(kernel(a, b), batch_axis)
    return _run(body, u, v, mesh=mesh, specs=specs)


def weight_allgather_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    config: Decomposition,
    weight_dim: str = "k",
    batch_axis: BatchAxis = None,
    tensor_axis: str | None = None,
    grad_input: Decomposition | None = None,
    grad_weight: Decomposition | None = None,
) -> jax.Array:
    """``x @ all_gather(w)`` over mesh axis ``axis`` with the weight sharded on it (FSDP), decomposed as ``config``
    says: the weight's shards move round the ring (`collective_matmul.ops.weight_ring`).

    Args:
        x: ``[B, ..., K]``, its first dimension sharded over ``batch_axis`` and ``axis`` (in that order: data
            parallelism beside FSDP); with ``weight_dim="n"`` and a ``tensor_axis``, K sharded over it.
        w: ``[K, N]``, ``weight_dim`` sharded over ``axis``; the other dimension over ``tensor_axis`` if given.
        mesh: the device mesh.
        axis: the mesh axis that shards the weight and forms the ring (FSDP's).
        config: the forward's decomposition (a ``weight_allgather_matmul_<weight_dim>`` problem).
        weight_dim: ``"k"`` (the weight sharded on its contracting dimension, FSDP's usual layout) or ``"n"``.
        batch_axis: mesh axis (or axes) that also shard x's first dimension; the weight gradient is summed
            over them once.
        tensor_axis: a mesh axis sharding the weight's other dimension (tensor parallelism): N for ``"k"``, whose
            result is then sharded on N over it; K for ``"n"``, whose product is then summed over it.
        grad_input: ``dx``'s decomposition (the other weight dimension's problem, with k and n swapped), where the
            weight is gathered again.  None: the baseline.
        grad_weight: ``dw``'s (a ``reduce_scatter_grad_weight`` problem: the product summed over the ring and
            scattered onto the weight's layout); ``fuse=True`` keeps the weight the forward gathered (``K x N``
            per device until the backward) for ``dx`` instead of gathering it again.  None:
            ``Decomposition.baseline(fuse=True)``, what autodiff of the plain product does.

    Returns:
        ``[B, ..., N]``, laid out as x (N sharded over ``tensor_axis`` with ``weight_dim="k"``).

    Raises:
        ValueError: if the shapes do not fit the mesh or a config is invalid for them.
    """
    x_spec, w_spec, out_spec = _weight_specs(x, w, mesh, axis, weight_dim, batch_axis, tensor_axis)
    xla = _left_to_xla(config, grad_input, grad_weight)
    if xla:
        x, w = placed(mesh, (x_spec, w_spec), x, w)
        y = jnp.matmul(x, w)
        sharding = NamedSharding(mesh, out_spec)
        return jax.sharding.reshard(y, sharding) if is_explicit(mesh) else lax.with_sharding_constraint(y, sharding)
    body = partial(weight_allgather_matmul_shard, axis=axis, weight_dim=weight_dim, config=config,
                   grad_input=grad_input, grad_weight=grad_weight, tensor_axis=tensor_axis)
    return _run(body, x, w, mesh=mesh, specs=(x_spec, w_spec, out_spec))


def reduce_scatter_grad_weight(
    u: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    config: Decomposition,
    batch_axis: BatchAxis = None,
) -> jax.Array:
    """``reduce_scatter(uᵀ @ v)`` over mesh axis ``axis`` (FSDP's weight gradient), decomposed: every row is
    contracted and the sum scattered onto the result's rows, the weight's layout.  Differentiable by JAX
    autodiff; `weight_allgather_matmul` runs it as its backward with its own config.

    Args:
        u: ``[B, ..., K]``, its first dimension sharded over ``batch_axis`` and ``axis``.
        v: ``[B, ..., N]``, the same rows, sharded alike.
        config: the decomposition (a ``reduce_scatter_grad_weight`` problem).
        batch_axis: mesh axis (or axes) that also shard the rows; the result is summed over them once.

    Returns:
        ``[K, N]`` with K sharded over ``axis``.

    Raises:
        ValueError: if the shapes do not fit the mesh or ``config`` is invalid for them.
    """
    if u.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"expected u [B, ..., K] and v [B, ..., N] with the same rows, got {u.shape} and {v.shape}")
    x_spec, _, out_spec = _weight_specs(u, jax.ShapeDtypeStruct((u.shape[-1], v.shape[-1]), v.dtype), mesh, axis,
                                        "k", batch_axis, None)
    out_spec = P(axis, None)
    if config.method == "xla":
        u, v = placed(mesh, (x_spec, x_spec), u, v)
        dims = tuple(range(u.ndim - 1))
        y = jnp.tensordot(u, v, axes=(dims, dims))
        sharding = NamedSharding(mesh, out_spec)
        return jax.sharding.reshard(y, sharding) if is_explicit(mesh) else lax.with_sharding_constraint(y, sharding)
    kernel = partial(reduce_scatter_grad_weight_shard, axis=axis, config=config)
    body = kernel if batch_axis is None else lambda a, b: lax.psum(kernel(a, b), batch_axis)
    return _run(body, u, v, mesh=mesh, specs=(x_spec, x_spec, out_spec))


def _weight_specs(x, w, mesh: Mesh, axis: str, weight_dim: str, batch_axis: BatchAxis,
                  tensor_axis: str | None) -> tuple[P, P, P]:
    """The specs of (x, w, y) of `weight_allgather_matmul`, the shapes checked against them."""
    if weight_dim not in ("k", "n"):
        raise ValueError(f"weight_dim={weight_dim!r}: give 'k' (the weight sharded on its contracting dimension, "
                         "FSDP's usual layout) or 'n' (on its output dimension)")
    if x.ndim < 2 or w.ndim != 2:
        raise ValueError(f"expected x [B, ..., K] and w [K, N], got shapes {x.shape} and {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"contraction mismatch: x has K={x.shape[-1]} but w has K={w.shape[0]}")
    batch = batch_names(batch_axis)
    for name in (axis, *batch, *([tensor_axis] if tensor_axis else [])):
        if name not in mesh.shape:
            raise ValueError(f"axis {name!r} is not an axis of the mesh {dict(mesh.shape)}")
    if axis in batch or tensor_axis in (axis, *batch):
        raise ValueError(f"the ring axis {axis!r}, batch_axis {batch_axis!r} and tensor_axis {tensor_axis!r} must "
                         "be different mesh axes")
    size, tensor = mesh.shape[axis], mesh.shape[tensor_axis] if tensor_axis else 1
    rows = size * axes_size(mesh, batch_axis)
    sharded, other = ("K", "N") if weight_dim == "k" else ("N", "K")
    checks = [(f"x's first dimension {x.shape[0]}", x.shape[0], rows, (*batch, axis)),
              (f"{sharded}={w.shape[0 if weight_dim == 'k' else 1]}", w.shape[0 if weight_dim == "k" else 1], size,
               axis)]
    if tensor_axis:
        checks.append((f"{other}={w.shape[1 if weight_dim == 'k' else 0]}", w.shape[1 if weight_dim == "k" else 0],
                       tensor, tensor_axis))
    for what, dim, parts, over in checks:
        if dim % parts:
            raise ValueError(f"{what} is not divisible by the {parts} devices of mesh axes {over!r}")
    lead = (*batch, axis) if batch else axis
    middle = (None,) * (x.ndim - 2)
    if weight_dim == "k":
        return P(lead, *middle, None), P(axis, tensor_axis), P(lead, *middle, tensor_axis)
    return P(lead, *middle, tensor_axis), P(tensor_axis, axis), P(lead, *middle, None)


def plain_baseline(
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    batch_axis: BatchAxis = None,
) -> jax.Array:
    """The baseline collective matmul in plain JAX: no custom VJP, JAX's autodiff makes the backward.

    What a user has without cmtune (``shard_map`` of the `collective_matmul.ops.baseline` kernel);
    the reference of a step measurement.  Same layouts and errors as `allgather_matmul` /
    `matmul_reduce_scatter`.
    """
    kernels = {Collective.ALLGATHER_MATMUL: (baseline_allgather_matmul_shard, ("N", -1, "w")),
               Collective.MATMUL_REDUCE_SCATTER: (baseline_matmul_reduce_scatter_shard, ("K", -1, "x"))}
    if collective not in kernels:
        raise ValueError(f"plain_baseline: unknown collective {collective!r}; "
                         f"expected one of {sorted(map(str, kernels))}")
    kernel, sharded = kernels[collective]
    lead = _check(x, w, mesh, axis, batch_axis, sharded=(("M", -2, "x"), sharded))
    return _run(partial(kernel, axis=axis), x, w, mesh=mesh, specs=_specs(collective, lead, axis))


_SHARDED = {Collective.ALLGATHER_MATMUL: (("M", -2, "x"), ("N", -1, "w")),
            Collective.MATMUL_REDUCE_SCATTER: (("M", -2, "x"), ("K", -1, "x"))}


def check_call(collective: Collective, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
               tensor_axis: str | None = None) -> None:
    """Raise `ValueError` (what does not fit, and why) if ``x`` and ``w`` do not fit ``collective``'s layout
    (``tensor_axis``: the weight's other sharded axis, for a weight-gathered collective)."""
    weight_dim = WEIGHT_DIM_OF.get(collective)
    if weight_dim is not None:
        _weight_specs(x, w, mesh, axis, weight_dim, batch_axis, tensor_axis)
        return
    if collective not in _SHARDED:
        known = sorted(map(str, _SHARDED)) + sorted(map(str, WEIGHT_DIM_OF))
        raise ValueError(f"unknown collective {collective!r}; expected one of {known}")
    if tensor_axis is not None:
        raise ValueError(f"tensor_axis is for a weight-gathered collective, not {collective}")
    _check(x, w, mesh, axis, batch_axis, sharded=_SHARDED[collective])


# (x, w, result) of the weight collectives on 2-D operands, "a" standing for the ring's axis
_WEIGHT_SPECS = {Collective.WEIGHT_ALLGATHER_MATMUL_K: (("a", None), ("a", None), ("a", None)),
                 Collective.WEIGHT_ALLGATHER_MATMUL_N: (("a", None), (None, "a"), ("a", None)),
                 Collective.REDUCE_SCATTER_GRAD_WEIGHT: (("a", None), ("a", None), ("a", None))}


def _specs(collective: Collective, lead: tuple, axis: str) -> tuple[P, P, P]:
    """Partition specs of (x, w, result), or (u, v, result), for a collective (docs/decompositions.md, layouts)."""
    if collective == Collective.ALLGATHER_MATMUL:
        return P(*lead, axis, None), P(None, axis), P(*lead, None, axis)
    if collective == Collective.MATMUL_REDUCE_SCATTER:
        return P(*lead, None, axis), P(axis, None), P(*lead, axis, None)
    if collective == Collective.ALLGATHER_GRAD_WEIGHT:
        return P(*lead, axis, None), P(*lead, None, axis), P(None, axis)
    if collective in _WEIGHT_SPECS and not lead:  # FSDP's: the rows are the ring's devices' own
        return tuple(P(*(axis if d == "a" else d for d in spec)) for spec in _WEIGHT_SPECS[collective])
    raise ValueError(f"unknown collective {collective!r}" if collective not in _WEIGHT_SPECS else
                     f"{collective}: its rows [m, k] are the ring's, give no batch dimensions")


def _left_to_xla(forward: Decomposition, grad_input: Decomposition | None, grad_weight: Decomposition | None) -> bool:
    """True if an op's configs leave it to XLA (``method="xla"``: all three, since the product's backward is then
    JAX's autodiff of it, which XLA decomposes or not as it does the forward).

    Raises:
        ValueError: if the forward and the backward disagree on it.
    """
    xla = [c is not None and c.method == "xla" for c in (forward, grad_input, grad_weight)]
    if xla[0] and not all(x or c is None for x, c in zip(xla[1:], (grad_input, grad_weight), strict=True)):
        raise ValueError("method='xla' leaves the whole op to XLA, its backward too: give grad_input and "
                         "grad_weight method='xla' (or leave them out)")
    if not xla[0] and any(xla[1:]):
        raise ValueError("method='xla' is for the whole op: a forward of cmtune's computes its own backward; give "
                         "the forward method='xla' too, or another decomposition to the backward")
    return xla[0]


def _as_written(collective: Collective, x: jax.Array, w: jax.Array, *, mesh: Mesh, specs: tuple[P, P, P]) -> jax.Array:
    """The product as a user writes it (``method="xla"``): one ``jnp`` product of the sharded operands, its result
    laid out as the op lays it, GSPMD placing the collective (XLA's windowed einsum may decompose it)."""
    x_spec, w_spec, out_spec = specs
    x, w = placed(mesh, (x_spec, w_spec), x, w)
    lead = "abcdefgh"[: x.ndim - 2]
    if collective == Collective.ALLGATHER_GRAD_WEIGHT:  # the rows and the leading dimensions contracted
        subscripts = f"{lead}mk,{lead}mn->kn"
    else:
        subscripts = f"{lead}mk,kn->{lead}mn"
    sharding = NamedSharding(mesh, out_spec)
    if is_explicit(mesh):  # the types say where the result lives
        return jnp.einsum(subscripts, x, w, out_sharding=sharding)
    return jax.lax.with_sharding_constraint(jnp.einsum(subscripts, x, w), sharding)


def _run(body, x, w, *, mesh: Mesh, specs: tuple[P, P, P]) -> jax.Array:
    x_spec, w_spec, out_spec = specs
    fn = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    return fn(*placed(mesh, (x_spec, w_spec), x, w))


def input_shardings(
    collective: Collective, mesh: Mesh, axis: str, *, batch_dims: int = 0, batch_axis: BatchAxis = None
) -> tuple[NamedSharding, NamedSharding]:
    """The shardings of an op's two inputs, for placing them with `device_put`.

    ``(x, w)`` for the matmuls; ``(u, v)`` for ``allgather_grad_weight``, where ``v`` has the
    same ``batch_dims`` leading dimensions as ``u``.
    """
    x_spec, w_spec, _ = _specs(collective, _lead_spec(batch_dims, batch_axis), axis)
    return NamedSharding(mesh, x_spec), NamedSharding(mesh, w_spec)


def problem_of(
    collective: Collective,
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    batch_axis: BatchAxis = None,
    tensor_axis: str | None = None,
) -> Problem:
    """The `Problem` one call of an op solves (batch dimensions fold into ``m`` per ring).

    For ``allgather_grad_weight`` and ``reduce_scatter_grad_weight`` pass ``(u, v)``: m is u's rows, k its width,
    n v's width.  A weight gathered under tensor parallelism (``tensor_axis``) solves one tensor shard's product.
    """
    batch_shards = axes_size(mesh, batch_axis)
    rows = math.prod(x.shape[:-1]) // batch_shards
    k, n = x.shape[-1], w.shape[-1]
    if tensor_axis is not None:
        tensor = mesh.shape[tensor_axis]
        k, n = (k, n // tensor) if collective == Collective.WEIGHT_ALLGATHER_MATMUL_K else (k // tensor, n)
    return Problem(
        collective=collective,
        m=rows,
        k=k,
        n=n,
        dtype=jnp.dtype(x.dtype).name,
        axis_size=mesh.shape[axis],
    )


def is_explicit(mesh: Mesh) -> bool:
    """True for a mesh with an Explicit axis (shardings are part of the types: reshard, not constrain)."""
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def placed(mesh: Mesh, specs: tuple, *arrays: jax.Array) -> tuple:
    """On a mesh with Explicit axes, reshard inputs to the specs (a no-op when they match)."""
    if not is_explicit(mesh):
        return arrays
    return tuple(
        jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs, strict=True)
    )


def batch_names(axes: BatchAxis) -> tuple[str, ...]:
    """A ``batch_axis`` as the tuple of its mesh axis names (none for None)."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def batch_axis_of(names: Sequence[str]) -> BatchAxis:
    """The ``batch_axis`` of mesh axis ``names``: None, the one name, or the tuple."""
    return None if not names else names[0] if len(names) == 1 else tuple(names)


def axes_size(mesh: Mesh, axes: BatchAxis) -> int:
    names = batch_names(axes)
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


def _check(x, w, mesh: Mesh, axis: str, batch_axis: BatchAxis, *, sharded, contraction: bool = True) -> tuple:
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    if contraction and (x.ndim < 2 or w.ndim != 2):
        raise ValueError(f"expected x [..., M, K] and w [K, N], got shapes {x.shape} and {w.shape}")
    if contraction and x.shape[-1] != w.shape[0]:
        raise ValueError(f"contraction mismatch: x has K={x.shape[-1]} but w has K={w.shape[0]}")
    if batch_axis is not None and (batch_axis == axis or axis in tuple(batch_axis)):
        raise ValueError(f"batch_axis must differ from the ring axis {axis!r}")
    size = mesh.shape[axis]
    for name, index, operand in sharded:
        dim = (x if operand == "x" else w).shape[index]
        if dim % size:
            raise ValueError(f"{name}={dim} is not divisible by the size {size} of mesh axis {axis!r}")
    shards = axes_size(mesh, batch_axis)
    if batch_axis is not None and x.ndim > 2 and x.shape[0] % shards:
        raise ValueError(f"batch dimension {x.shape[0]} is not divisible by {shards} ({batch_axis!r})")
    return _lead_spec(x.ndim - 2, batch_axis)


# The two forward ops by collective (what the drop-in, the block and the client call).
OPS = {Collective.ALLGATHER_MATMUL: allgather_matmul, Collective.MATMUL_REDUCE_SCATTER: matmul_reduce_scatter}
# The weight-gathered (FSDP) forward collectives: the weight's dimension sharded over the ring.
WEIGHT_DIM_OF = {Collective.WEIGHT_ALLGATHER_MATMUL_K: "k", Collective.WEIGHT_ALLGATHER_MATMUL_N: "n"}
