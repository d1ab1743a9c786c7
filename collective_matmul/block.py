"""The reference transformer block: how to call the collective matmuls in a training step.

Megatron tensor parallelism with sequence parallelism over one mesh axis (``axis``, P devices),
and optionally data parallelism over others (``batch_axis``).  The layout, step by step:

1. Between blocks the activations ``x [batch, seq, d_model]`` are sharded on seq over ``axis``
   (and on batch over ``batch_axis``).  The weights are sharded over ``axis`` only (replicated
   over the data axes); the RMSNorm scales are replicated.
2. Attention: ``h = rmsnorm(x)``; ``qkv = allgather_matmul(h, w_qkv)`` gathers seq and
   multiplies by ``w_qkv [d_model, qkv_dim]`` sharded on its columns, so each device holds every
   token for its own heads.  Device i's column block is ``[q_i | k_i | v_i]``: its heads/P query
   heads, then its kv_heads/P key heads and value heads (GQA: query head j uses kv head
   ``j // (heads / kv_heads)``, so a device's query heads only need its own kv heads).
3. Causal attention runs on the local heads inside `jax.shard_map`; its output
   ``[batch, seq, attn_dim]`` is sharded on the attention columns (heads in order).
4. ``attn_out = matmul_reduce_scatter(o, w_o)``: ``w_o [attn_dim, d_model]`` is sharded on its
   rows, so the product sums over the devices, scattered back onto seq; ``x = x + attn_out``.
5. MLP: ``h = rmsnorm(x)``; ``u = allgather_matmul(h, w_up)`` with ``w_up [d_model, mlp_up_dim]``
   sharded on its columns; gated (SwiGLU), device i's block is ``[gate_i | up_i]`` and the
   activation is ``silu(gate) * up``, else ``gelu(u)``, both per device in `jax.shard_map`.
6. ``mlp_down = matmul_reduce_scatter(a, w_down)``, ``w_down [d_ff, d_model]`` sharded on its
   rows; ``x = x + mlp_down``, sharded on seq again, ready for the next block.

Each of the four ops (roles ``qkv``, ``attn_out``, ``mlp_up``, ``mlp_down``) takes its forward,
``grad_input`` and ``grad_weight`` configs from a `ConfigSource`: fixed configs
(`FixedConfigs`) or a `collective_matmul.Tuned` client.  `AS_WRITTEN` is the block as a user
writes it without cmtune: each projection a plain einsum under a named scope of its role, with the
sharding of its result stated, the attention and the MLP activation mapped over each device's
column block (`jax.vmap`, no `shard_map`), so that XLA's partitioner places the all-gathers and
reduce-scatters (GSPMD), and JAX's autodiff for the backward — the reference of a step
measurement.  (Over the 2-process cluster it runs as fast as the same block with `shard_map` for
the attention: 0.858 s against 0.857 s, 9 interleaved rounds, demo preset.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul.client.sources import ConfigSource
from collective_matmul.ops.collective import OPS, BatchAxis, axes_size, batch_names, is_explicit, placed
from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.planning.models import ROLES as MODEL_ROLES
from collective_matmul.planning.models import TransformerBlock
from collective_matmul.planning.problem import Collective

# The collective of each role's forward (models.py derives the same problems).
ROLE_COLLECTIVES: dict[str, str] = {
    "qkv": Collective.ALLGATHER_MATMUL,
    "attn_out": Collective.MATMUL_REDUCE_SCATTER,
    "mlp_up": Collective.ALLGATHER_MATMUL,
    "mlp_down": Collective.MATMUL_REDUCE_SCATTER,
}
ROLES: tuple[str, ...] = MODEL_ROLES  # in models.py, the JAX-free home of the roles
PARAM_NAMES: tuple[str, ...] = ("attn_norm", "w_qkv", "w_o", "mlp_norm", "w_up", "w_down")
RMS_EPS = 1e-6

Params = dict[str, jax.Array]


@dataclass(frozen=True)
class FixedConfigs:
    """The same configs for every call of a role; ``default`` for roles not named.

    Raises:
        ValueError: if ``per_role`` names a role that is not in `ROLES`.
    """

    per_role: Mapping[str, OpConfigs] = field(default_factory=dict)
    default: OpConfigs = OpConfigs()

    def __post_init__(self):
        unknown = sorted(set(self.per_role) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown roles {unknown}; the block's roles are {list(ROLES)}")

    def configs(self, role: str | None, collective: str, x, w, *, mesh: Mesh, axis: str,
                batch_axis: BatchAxis = None, tensor_axis: str | None = None, site: str = "",
                via: str = "op") -> OpConfigs:
        return self.per_role.get(role, self.default)

    def fell_back(self, role: str, reason: str, *, site: str = "") -> None:
        """Nothing to record: fixed configs keep no report of the calls."""


class AsWritten:
    """The block as written (GSPMD), the reference of a step measurement; use the `AS_WRITTEN` instance.

    Its `configs` (the baselines) only describe it: the block calls no op of cmtune in this mode.
    """

    def configs(self, role: str | None, collective: str, x, w, *, mesh: Mesh, axis: str,
                batch_axis: BatchAxis = None, tensor_axis: str | None = None, site: str = "",
                via: str = "op") -> OpConfigs:
        return OpConfigs()

    def fell_back(self, role: str, reason: str, *, site: str = "") -> None:
        """Nothing to record: the block as written calls no op of cmtune."""

    def __repr__(self) -> str:
        return "AS_WRITTEN"


AS_WRITTEN = AsWritten()


def check_block(
    block: TransformerBlock, *, tensor_size: int, batch_shards: int = 1, batch: int | None = None
) -> None:
    """Check that ``block`` shards over a tensor axis of ``tensor_size`` and ``batch_shards`` data shards.

    Raises:
        ValueError: naming the dimension that does not divide and what to change.
    """
    kv_heads = block.kv_heads or block.heads
    for name, size in (("heads", block.heads), ("kv_heads", kv_heads), ("d_ff", block.d_ff),
                       ("seq_len", block.seq_len)):
        if size % tensor_size:
            raise ValueError(
                f"{block.name}: {name}={size} is not divisible by the tensor axis size {tensor_size}; "
                f"choose a tensor axis size dividing {name}"
            )
    batch = block.global_batch if batch is None else batch
    if batch % batch_shards:
        raise ValueError(
            f"{block.name}: batch {batch} is not divisible by the {batch_shards} data-parallel shards; "
            f"choose a batch that is a multiple of {batch_shards}"
        )


def param_shardings(mesh: Mesh, *, axis: str) -> dict[str, NamedSharding]:
    """The sharding of each parameter (see the module docstring, step 1)."""
    specs = {"attn_norm": P(), "w_qkv": P(None, axis), "w_o": P(axis, None),
             "mlp_norm": P(), "w_up": P(None, axis), "w_down": P(axis, None)}
    return {name: NamedSharding(mesh, spec) for name, spec in specs.items()}


def activation_sharding(mesh: Mesh, *, axis: str, batch_axis: BatchAxis = None) -> NamedSharding:
    """The sharding of ``x [batch, seq, d_model]`` between blocks: seq over ``axis``, batch over ``batch_axis``."""
    return NamedSharding(mesh, P(batch_axis, axis, None))


def param_shapes(block: TransformerBlock) -> dict[str, tuple[int, ...]]:
    """The global shape of each parameter."""
    return {
        "attn_norm": (block.d_model,),
        "w_qkv": (block.d_model, block.qkv_dim),
        "w_o": (block.attn_dim, block.d_model),
        "mlp_norm": (block.d_model,),
        "w_up": (block.d_model, block.mlp_up_dim),
        "w_down": (block.d_ff, block.d_model),
    }


def init_params(key: jax.Array, block: TransformerBlock, mesh: Mesh, *, axis: str, dtype=None) -> Params:
    """Random parameters of ``block``, placed with `param_shardings`.

    Matrices are normal with variance 1/fan-in; the RMSNorm scales are ones.

    Args:
        key: a `jax.random` key.
        block: the shapes.
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis.
        dtype: the parameter dtype (default: ``block.dtype``).

    Returns:
        ``{name: array}`` for the names in `PARAM_NAMES`.

    Raises:
        ValueError: if ``axis`` is not a mesh axis or the block does not shard over it.
    """
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    check_block(block, tensor_size=mesh.shape[axis])
    dtype = jnp.dtype(dtype or block.dtype)
    shapes, shardings = param_shapes(block), param_shardings(mesh, axis=axis)

    def make(key):
        keys = dict(zip(PARAM_NAMES, jax.random.split(key, len(PARAM_NAMES)), strict=True))
        params = {}
        for name, shape in shapes.items():
            if name.endswith("_norm"):
                params[name] = jnp.ones(shape, dtype)
            else:
                params[name] = (jax.random.normal(keys[name], shape, jnp.float32) / math.sqrt(shape[0])).astype(dtype)
        return params

    return jax.jit(make, out_shardings=shardings)(key)


def apply(
    params: Params,
    x: jax.Array,
    *,
    block: TransformerBlock,
    mesh: Mesh,
    axis: str,
    source: ConfigSource,
    batch_axis: BatchAxis = None,
) -> jax.Array:
    """The block's forward: ``x + attention(rmsnorm(x))``, then ``+ mlp(rmsnorm(.))``.

    Args:
        params: from `init_params`.
        x: ``[batch, seq, d_model]``, seq sharded over ``axis`` (batch over ``batch_axis``).
        block: the shapes (heads, kv_heads, head_dim, gated_mlp; x's batch and seq may differ
            from ``block.global_batch`` and ``block.seq_len``).
        mesh: the device mesh.
        axis: the tensor-parallel mesh axis (the ring).
        source: the configs of each op call (`FixedConfigs`, a `Tuned`, or `AS_WRITTEN`).
        batch_axis: mesh axis (or axes) sharding the batch.

    Returns:
        ``[batch, seq, d_model]`` laid out as ``x``.

    Raises:
        ValueError: if x or the block do not fit the mesh, or a config is invalid for its call.
    """
    _check_call(block, x, mesh, axis, batch_axis)
    op = partial(_op, source=source, mesh=mesh, axis=axis, batch_axis=batch_axis)
    h = _rmsnorm(x, params["attn_norm"])
    qkv = op("qkv", h, params["w_qkv"])
    local = _per_device_block if isinstance(source, AsWritten) else _local
    o = _attention(qkv, block=block, mesh=mesh, axis=axis, batch_axis=batch_axis, local=local)
    x = x + op("attn_out", o, params["w_o"])
    h = _rmsnorm(x, params["mlp_norm"])
    u = op("mlp_up", h, params["w_up"])
    a = _mlp_activation(u, gated=block.gated_mlp, mesh=mesh, axis=axis, batch_axis=batch_axis, local=local)
    return x + op("mlp_down", a, params["w_down"])


def loss(
    params: Params,
    x: jax.Array,
    target: jax.Array,
    *,
    block: TransformerBlock,
    mesh: Mesh,
    axis: str,
    source: ConfigSource,
    batch_axis: BatchAxis = None,
) -> jax.Array:
    """Mean squared error of `apply` against ``target`` (laid out as ``x``), in float32."""
    y = apply(params, x, block=block, mesh=mesh, axis=axis, source=source, batch_axis=batch_axis)
    return jnp.mean(jnp.square(y.astype(jnp.float32) - target.astype(jnp.float32)))


def loss_and_grads(params: Params, x: jax.Array, target: jax.Array, **kwargs) -> tuple[jax.Array, Params]:
    """``jax.value_and_grad`` of `loss` with respect to ``params`` (``kwargs`` as for `loss`)."""
    return jax.value_and_grad(partial(loss, **kwargs))(params, x, target)


def train_step(
    params: Params,
    x: jax.Array,
    target: jax.Array,
    *,
    block: TransformerBlock,
    mesh: Mesh,
    axis: str,
    source: ConfigSource,
    batch_axis: BatchAxis = None,
    lr: float = 1e-3,
) -> tuple[Params, jax.Array]:
    """One SGD step: `loss_and_grads`, then ``p - lr * g`` for every parameter.

    Args:
        params, x, target: as for `loss`.
        block, mesh, axis, source, batch_axis: as for `apply`.
        lr: the learning rate.

    Returns:
        ``(new_params, loss)``, the parameters laid out as ``params``.

    Raises:
        ValueError: as `apply`.
    """
    value, grads = loss_and_grads(params, x, target, block=block, mesh=mesh, axis=axis, source=source,
                                  batch_axis=batch_axis)
    new = jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)
    return new, value


def configs_per_role(
    source: ConfigSource,
    block: TransformerBlock,
    *,
    mesh: Mesh,
    axis: str,
    batch_axis: BatchAxis = None,
    batch: int | None = None,
) -> dict[str, OpConfigs]:
    """The configs ``source`` gives each role's op call for a batch of ``batch`` (default: the block's).

    Calls ``source.configs`` with abstract operands of the shapes `apply` passes, so a `Tuned`
    client resolves (and records) all twelve problems of the step without running anything.
    """
    batch = block.global_batch if batch is None else batch
    dtype = jnp.dtype(block.dtype)
    shapes = param_shapes(block)
    widths = {"qkv": block.d_model, "attn_out": block.attn_dim, "mlp_up": block.d_model, "mlp_down": block.d_ff}
    weights = {"qkv": "w_qkv", "attn_out": "w_o", "mlp_up": "w_up", "mlp_down": "w_down"}
    out = {}
    for role, collective in ROLE_COLLECTIVES.items():
        x = jax.ShapeDtypeStruct((batch, block.seq_len, widths[role]), dtype)
        w = jax.ShapeDtypeStruct(shapes[weights[role]], dtype)
        out[role] = source.configs(role, collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
    return out


# ---- the pieces ---------------------------------------------------------------------------


def _op(role: str, x, w, *, source: ConfigSource, mesh: Mesh, axis: str, batch_axis: BatchAxis):
    collective = ROLE_COLLECTIVES[role]
    if isinstance(source, AsWritten):
        return _as_written(role, collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
    configs = source.configs(role, collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
    try:
        return OPS[collective](x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, config=configs.forward,
                  grad_input=configs.grad_input, grad_weight=configs.grad_weight)
    except ValueError as exc:
        raise ValueError(f"{role}: {exc}") from None


def _as_written(role: str, collective: str, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis):
    """One projection as a user writes it: an einsum whose result is sharded as the layout says.

    Column-parallel (``qkv``, ``mlp_up``): the result sharded on its columns, so XLA gathers the
    rows of x.  Row-parallel (``attn_out``, ``mlp_down``): the result sharded on its rows, so XLA
    sums the partial products and scatters them.  On a mesh with Explicit axes the sharding is
    the einsum's ``out_sharding``; on one with Auto axes a sharding constraint.
    """
    lead = (batch_axis, *([None] * (x.ndim - 3))) if x.ndim > 2 else ()
    out = P(*lead, None, axis) if collective == Collective.ALLGATHER_MATMUL else P(*lead, axis, None)
    sharding = NamedSharding(mesh, out)
    with jax.named_scope(role):
        if is_explicit(mesh):
            return jnp.einsum("...k,kn->...n", x, w, out_sharding=sharding)
        return jax.lax.with_sharding_constraint(jnp.einsum("...k,kn->...n", x, w), sharding)


def _rmsnorm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + RMS_EPS)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def _local(fn, y: jax.Array, *, mesh: Mesh, axis: str, batch_axis: BatchAxis) -> jax.Array:
    """Run ``fn`` on each device's ``[batch/D, seq, columns/P]`` block of ``y`` (columns sharded)."""
    spec = P(batch_axis, None, axis)
    (y,) = placed(mesh, (spec,), y)
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)(y)


def _per_device_block(fn, y: jax.Array, *, mesh: Mesh, axis: str, batch_axis: BatchAxis) -> jax.Array:
    """``fn`` on each device's column block of ``y``, as written in GSPMD style (no `shard_map`): the
    columns split as ``[batch, seq, P, columns/P]``, sharded on the P dimension, and ``fn`` mapped over it."""
    b, s, columns = y.shape
    size = mesh.shape[axis]
    split = _reshaped(y, (b, s, size, columns // size), P(batch_axis, None, axis, None), mesh)
    out = jax.vmap(fn, in_axes=2, out_axes=2)(split)
    return _reshaped(out, (b, s, size * out.shape[-1]), P(batch_axis, None, axis), mesh)


def _reshaped(y: jax.Array, shape: tuple, spec: P, mesh: Mesh) -> jax.Array:
    sharding = NamedSharding(mesh, spec)
    if is_explicit(mesh):
        return jnp.reshape(y, shape, out_sharding=sharding)
    return jax.lax.with_sharding_constraint(jnp.reshape(y, shape), sharding)


def _attention(qkv: jax.Array, *, block: TransformerBlock, mesh: Mesh, axis: str, batch_axis: BatchAxis, local=_local):
    """Causal attention of each device's heads (its ``[q_i | k_i | v_i]`` column block)."""
    size = mesh.shape[axis]
    heads, kv_heads, dim = block.heads // size, (block.kv_heads or block.heads) // size, block.head_dim
    group = heads // kv_heads

    def core(local: jax.Array) -> jax.Array:
        b, s, _ = local.shape
        q = local[..., : heads * dim].reshape(b, s, kv_heads, group, dim)
        k = local[..., heads * dim : (heads + kv_heads) * dim].reshape(b, s, kv_heads, dim)
        v = local[..., (heads + kv_heads) * dim :].reshape(b, s, kv_heads, dim)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(dim)
        causal = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
        return out.reshape(b, s, heads * dim)

    return local(core, qkv, mesh=mesh, axis=axis, batch_axis=batch_axis)


def _mlp_activation(u: jax.Array, *, gated: bool, mesh: Mesh, axis: str, batch_axis: BatchAxis, local=_local):
    """``silu(gate) * up`` of each device's ``[gate_i | up_i]`` block, or ``gelu(u)``."""

    def act(local: jax.Array) -> jax.Array:
        if not gated:
            return jax.nn.gelu(local)
        half = local.shape[-1] // 2
        return jax.nn.silu(local[..., :half]) * local[..., half:]

    return local(act, u, mesh=mesh, axis=axis, batch_axis=batch_axis)


def _check_call(block: TransformerBlock, x, mesh: Mesh, axis: str, batch_axis: BatchAxis) -> None:
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    if x.ndim != 3 or x.shape[-1] != block.d_model:
        raise ValueError(f"expected x [batch, seq, d_model={block.d_model}], got shape {x.shape}")
    if axis in batch_names(batch_axis):
        raise ValueError(f"batch_axis must differ from the tensor axis {axis!r}")
    shaped = block.model_copy(update={"seq_len": x.shape[1]})
    check_block(shaped, tensor_size=mesh.shape[axis], batch_shards=axes_size(mesh, batch_axis), batch=x.shape[0])
