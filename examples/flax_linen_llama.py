"""A Llama-shaped decoder in Flax linen, trained with cmtune's drop-in: tensor and sequence parallelism on a
data × model mesh, written as MaxText writes its layers.

    cmtune problems --step examples/flax_linen_llama.py:llama_step --devices processes:2x4
    cmtune problems --step examples/flax_linen_llama.py:llama_step --devices tpu:v5p:2x2x2   # compiled, not run
    cmtune tune     --step examples/flax_linen_llama.py:llama_step --devices processes:2x4 --out tuned.json
    cmtune verify   --step examples/flax_linen_llama.py:llama_step --devices processes:2x4 --bundle tuned.json

The model: token embedding, decoder layers of RMSNorm → separate query, key and value projections of the
same normed activation (`DenseGeneral`, heads × head_dim) → causal attention → output projection, and
RMSNorm → SwiGLU (gate and up projections of the same activation, then down), residuals around both;
``nn.scan`` over ``nn.remat`` layers (one compiled layer, its activations recomputed in the backward), a
vocabulary-parallel output head and AdamW.  Every kernel names its logical axes (``embed``, ``heads``,
``mlp``, ``vocab``) and `RULES` maps them to the mesh, as MaxText's ``logical_axis_rules`` do: written
plainly (``tuned=None``) XLA places the collectives; with a `collective_matmul.Tuned` client each dense
layer takes cmtune's drop-in through ``dot_general_cls``, its kind read from its ``kernel_axes``.

`llama_step(tuned=None, devices=None)` is the step spec cmtune's commands take; on devices that cannot
run here (a TPU slice compiled for ahead of time) its arguments are abstract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul.client import flax as cm_flax
from collective_matmul.programs.topology import compile_only, mesh_of

RULES = (("batch", "data"), ("activation_length", "model"), ("embed", None), ("heads", "model"),
         ("kv", None), ("mlp", "model"), ("vocab", "model"), ("layers", None))


@dataclass(frozen=True)
class Config:
    vocab: int = 2048
    d_model: int = 1024
    heads: int = 8
    head_dim: int = 128
    d_ff: int = 2048
    layers: int = 2
    seq: int = 512
    batch: int = 8
    dtype: str = "float32"
    learning_rate: float = 1e-3


SMALL = Config()
BF16 = Config(dtype="bfloat16")
TINY = Config(vocab=128, d_model=64, heads=4, head_dim=16, d_ff=128, layers=2, seq=64, batch=4)
TINY_BF16 = Config(vocab=128, d_model=64, heads=4, head_dim=16, d_ff=128, layers=2, seq=64, batch=4, dtype="bfloat16")


class Layer(nn.Module):
    cfg: Config
    mesh: object
    tuned: object = None

    def dense(self, features, axes, name, *, in_axes=-1):
        """A dense layer of logical ``axes`` (input axes first), with cmtune's drop-in when tuned."""
        cfg = self.cfg
        return nn.DenseGeneral(
            features, axis=in_axes, use_bias=False, dtype=jnp.dtype(cfg.dtype), name=name,
            kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
            dot_general_cls=cm_flax.dot_general_cls(self.tuned, mesh=self.mesh, kernel_axes=axes)
            if self.tuned is not None else None)

    def shard(self, y, *spec):
        return jax.lax.with_sharding_constraint(y, NamedSharding(self.mesh, P(*spec)))

    @nn.compact
    def __call__(self, x, _):
        cfg = self.cfg
        h = nn.RMSNorm(dtype=jnp.dtype(cfg.dtype), name="attn_norm")(x)
        q, k, v = (self.shard(self.dense((cfg.heads, cfg.head_dim), ("embed", "heads", "kv"), name)(h),
                              "data", None, "model", None) for name in ("query", "key", "value"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(cfg.head_dim)
        causal = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(v.dtype)
        o = self.shard(jnp.einsum("bhqk,bkhd->bqhd", probs, v), "data", None, "model", None)
        x = x + self.shard(self.dense(cfg.d_model, ("heads", "kv", "embed"), "out", in_axes=(-2, -1))(o),
                           "data", "model", None)
        h = nn.RMSNorm(dtype=jnp.dtype(cfg.dtype), name="mlp_norm")(x)
        gate = self.shard(self.dense(cfg.d_ff, ("embed", "mlp"), "gate")(h), "data", None, "model")
        up = self.shard(self.dense(cfg.d_ff, ("embed", "mlp"), "up")(h), "data", None, "model")
        down = self.dense(cfg.d_model, ("mlp", "embed"), "down")(nn.silu(gate) * up)
        return x + self.shard(down, "data", "model", None), None


class Llama(nn.Module):
    cfg: Config
    mesh: object
    tuned: object = None

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d_model, dtype=jnp.dtype(cfg.dtype), name="embed",
                         embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")))
        x = jax.lax.with_sharding_constraint(embed(tokens), NamedSharding(self.mesh, P("data", "model", None)))
        layers = nn.scan(nn.remat(Layer), variable_axes={"params": 0}, split_rngs={"params": True},
                         length=cfg.layers, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = layers(cfg, self.mesh, self.tuned, name="layers")(x, None)
        x = nn.RMSNorm(dtype=jnp.dtype(cfg.dtype), name="norm")(x)
        head = nn.DenseGeneral(cfg.vocab, use_bias=False, dtype=jnp.dtype(cfg.dtype), name="head",
                               kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                        ("embed", "vocab")))
        return head(x).astype(jnp.float32)


def build(cfg: Config, tuned=None, *, devices=None, model_axis: int = 4, seed: int = 0):
    """``(step, (params, opt_state, tokens, targets), mesh)`` on a data × model mesh of ``devices`` (default
    ``jax.devices()``; the model axis ``model_axis`` wide), abstract where `compile_only` says so."""
    devices = list(devices) if devices is not None else jax.devices()
    mesh = mesh_of(devices, (len(devices) // model_axis, model_axis), ("data", "model"), axis_types=AxisType.Auto)
    model, optimizer = Llama(cfg, mesh, tuned), optax.adamw(cfg.learning_rate)
    batch = NamedSharding(mesh, P("data", "model"))
    example = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)

    def init(key):
        params = model.init(key, example)
        return params, optimizer.init(params)

    with nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(init, jax.random.key(seed))
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)

    def loss(params, tokens, targets):
        with nn.logical_axis_rules(RULES):
            logits = model.apply(params, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(params, opt_state, tokens, targets):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    if compile_only(devices):
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(abstract),
                             shardings)
        tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32, sharding=batch)
        return step, (*state, tokens, tokens), mesh
    params, opt_state = jax.jit(init, out_shardings=shardings)(jax.random.key(seed))
    keys = jax.random.split(jax.random.key(seed + 1))
    tokens, targets = (jax.device_put(jax.random.randint(k, (cfg.batch, cfg.seq), 0, cfg.vocab), batch) for k in keys)
    return step, (params, opt_state, tokens, targets), mesh


def llama_step(tuned=None, devices=None):
    """The step spec (float32, d_model 1024, d_ff 2048, 2 layers, data × model=4)."""
    return build(SMALL, tuned, devices=devices)


def bf16_llama_step(tuned=None, devices=None):
    """The same in bfloat16."""
    return build(BF16, tuned, devices=devices)


def tiny_llama_step(tuned=None, devices=None):
    """The step spec at a test size."""
    return build(TINY, tuned, devices=devices)


def tiny_bf16_llama_step(tuned=None, devices=None):
    """The step spec at a test size, in bfloat16."""
    return build(TINY_BF16, tuned, devices=devices)
