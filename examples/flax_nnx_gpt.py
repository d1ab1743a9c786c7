"""A small GPT in Flax NNX, trained with cmtune's drop-in: tensor and sequence parallelism on a data × model mesh.

    cmtune problems --step examples/flax_nnx_gpt.py:gpt_step --devices processes:2x4
    cmtune tune     --step examples/flax_nnx_gpt.py:gpt_step --devices processes:2x4 --out tuned.json
    cmtune verify   --step examples/flax_nnx_gpt.py:gpt_step --devices processes:2x4 --bundle tuned.json --decide
    python examples/flax_nnx_gpt.py --bundle tuned.json --steps 10      # train with them (2 processes x 4 devices)

The model as a user writes it: token embedding, blocks of causal self-attention and an MLP with
RMSNorm and residuals, tied output embedding, AdamW.  The layout is Megatron's with sequence
parallelism: between blocks the activations ``[batch, seq, d_model]`` are sharded on the batch
over ``data`` and on the sequence over ``model``; the fused QKV projection and the MLP's up
projection are column-parallel (kernel sharded on its heads / hidden columns), the attention
output and the MLP's down projection row-parallel (kernel sharded on its input rows).  Written
plainly (``tuned=None``), XLA's partitioner places the all-gathers and reduce-scatters; with a
`collective_matmul.Tuned` client the same layers take cmtune's ``dot_general``
(`collective_matmul.client.flax`), which runs the tuned decompositions.

`gpt_step` is the step spec cmtune's commands take: ``gpt_step(tuned=None, devices=None) -> (step, args,
mesh)`` builds the model, the optimizer and a batch on a mesh of ``devices`` (cmtune's; model axis up to 8
devices, data axis the rest) and returns the jitted training step (it donates its state) and its
arguments; on a TPU slice compiled for ahead of time (``--devices tpu:v5p:2x2x1``) the arguments are
abstract and nothing runs.  `tiny_gpt_step` is the same at a size for tests, on a 2 × 4 mesh.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul.client import flax as cm_flax
from collective_matmul.programs.topology import compile_only, mesh_of


@dataclass(frozen=True)
class Config:
    vocab: int = 1024
    d_model: int = 1024
    heads: int = 8
    head_dim: int = 128
    d_ff: int = 2048
    layers: int = 2
    seq: int = 512
    batch: int = 4
    dtype: str = "float32"
    learning_rate: float = 1e-3


DEMO = Config(head_dim=16)  # the demo preset's shapes (`cmtune demo`): d_model 1024, d_ff 2048, 8 heads of 16
WIDE = Config()  # the same with heads of 128 (attention as wide as d_model): more compute per collective
TINY = Config(vocab=128, d_model=64, heads=4, head_dim=16, d_ff=128, layers=2, seq=64, batch=4)


class Block(nnx.Module):
    def __init__(self, cfg: Config, mesh, tuned, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        dtype = jnp.dtype(cfg.dtype)

        def drop_in(kind):  # lax.dot_general when tuned is None: the model as written
            return cm_flax.dot_general(tuned, mesh=mesh, axis="model", kind=kind)

        self.cfg, self.mesh = cfg, mesh
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.qkv = nnx.LinearGeneral(cfg.d_model, (cfg.heads, 3, cfg.head_dim), use_bias=False, dtype=dtype,
                                     kernel_init=nnx.with_partitioning(init, (None, "model", None, None)),
                                     dot_general=drop_in("column"), rngs=rngs)
        self.attn_out = nnx.LinearGeneral((cfg.heads, cfg.head_dim), cfg.d_model, axis=(-2, -1), use_bias=False,
                                          dtype=dtype, kernel_init=nnx.with_partitioning(init, ("model", None, None)),
                                          dot_general=drop_in("row"), rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=False, dtype=dtype,
                             kernel_init=nnx.with_partitioning(init, (None, "model")), dot_general=drop_in("column"),
                             rngs=rngs)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=False, dtype=dtype,
                               kernel_init=nnx.with_partitioning(init, ("model", None)), dot_general=drop_in("row"),
                               rngs=rngs)

    def _shard(self, x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))

    def __call__(self, x):
        qkv = self._shard(self.qkv(self.attn_norm(x)), "data", None, "model", None, None)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(v.dtype)
        o = self._shard(jnp.einsum("bhqk,bkhd->bqhd", probs, v), "data", None, "model", None)
        x = x + self._shard(self.attn_out(o), "data", "model", None)
        h = self._shard(jax.nn.gelu(self.up(self.mlp_norm(x))), "data", None, "model")
        return x + self._shard(self.down(h), "data", "model", None)


class GPT(nnx.Module):
    def __init__(self, cfg: Config, mesh, tuned=None, *, rngs: nnx.Rngs):
        self.mesh = mesh
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, mesh, tuned, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=jnp.dtype(cfg.dtype), rngs=rngs)

    def __call__(self, tokens):
        x = jax.lax.with_sharding_constraint(self.embed(tokens), NamedSharding(self.mesh, P("data", "model", None)))
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)


def make_mesh(model: int | None = None, devices=None):
    """A data × model mesh of ``devices`` (default ``jax.devices()``): the model axis up to 8 devices (or
    ``model``), data the rest."""
    devices = list(devices) if devices is not None else jax.devices()
    model = model or math.gcd(len(devices), 8)
    return mesh_of(devices, (len(devices) // model, model), ("data", "model"), axis_types=AxisType.Auto)


def loss_fn(model: GPT, tokens, targets):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_step(graphdef, loss):
    """The jitted training step of a split ``(model, optimizer)``: ``value_and_grad`` of ``loss``, then the optimizer's
    update; it donates the state it is given and returns ``(new state, loss)``."""

    def step(state, *batch):
        model, optimizer = nnx.merge(graphdef, state)
        value, grads = nnx.value_and_grad(loss)(model, *batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), value

    return jax.jit(step, donate_argnums=0)


def build(cfg: Config, tuned=None, *, model_axis: int | None = None, seed: int = 0, optimizer=None, devices=None):
    """``(step, (state, tokens, targets), mesh)``: the training step, its arguments and the mesh.

    ``optimizer``: an optax transformation (default AdamW at ``cfg.learning_rate``); ``devices``: the mesh's
    (default ``jax.devices()``).  On devices that cannot run here (a TPU slice compiled ahead of time,
    `collective_matmul.programs.topology.compile_only`) the arguments are abstract: shapes, dtypes and shardings.
    """
    mesh = make_mesh(model_axis, devices)

    def create():
        model = GPT(cfg, mesh, tuned, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optimizer or optax.adamw(cfg.learning_rate), wrt=nnx.Param)

    batch_sharding = NamedSharding(mesh, P("data", "model"))
    if devices is not None and compile_only(devices):
        with jax.set_mesh(mesh):
            graphdef, state = nnx.split(nnx.eval_shape(create))
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                             nnx.get_named_sharding(state, mesh))
        batch = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32, sharding=batch_sharding)
        return train_step(graphdef, loss_fn), (state, batch, batch), mesh
    with jax.set_mesh(mesh):  # parameters and optimizer state are created sharded as annotated
        graphdef, state = nnx.split(create())
    keys = jax.random.split(jax.random.key(seed + 1))
    tokens, targets = (jax.jit(partial(jax.random.randint, shape=(cfg.batch, cfg.seq), minval=0, maxval=cfg.vocab),
                               out_shardings=batch_sharding)(k) for k in keys)
    return train_step(graphdef, loss_fn), (state, tokens, targets), mesh


def gpt_step(tuned=None, devices=None):
    """The step spec at the demo's size (see the module docstring)."""
    return build(DEMO, tuned, devices=devices)


def wide_gpt_step(tuned=None, devices=None):
    """The step spec with heads of 128 (see `WIDE`)."""
    return build(WIDE, tuned, devices=devices)


def one_layer_gpt_step(tuned=None, devices=None):
    """The step spec with one block (the demo preset's shapes): the layer count's share of the gain."""
    return build(Config(head_dim=16, layers=1), tuned, devices=devices)


def tiny_gpt_step(tuned=None, devices=None):
    """The step spec at a test size, on a 2 × 4 (data × model) mesh."""
    return build(TINY, tuned, model_axis=4, devices=devices)


def main() -> None:
    import os
    import sys

    from cmtune.workers.cluster import DeviceSpec, configure, launch
    from collective_matmul import Tuned

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", help="tuned configs from a bundle file")
    parser.add_argument("--server", help="tuned configs from a cmtune service at this URL")
    parser.add_argument("--model-name", default="gpt_step", help="the name the step was verified under (overrides)")
    parser.add_argument("--devices", default="processes:2x4",
                        help="virtual:N, or processes:PxD (the devices the configs were tuned on)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the test size")
    args = parser.parse_args()
    devices = DeviceSpec.parse(args.devices)
    if devices.needs_group:  # run this script as a group of processes on loopback, as cmtune's commands do
        launch(devices.count, sys.argv, local_devices=devices.local or 4, timeout_s=3600, echo_first=True)
        return
    configure(devices)
    # a reader token for --server from CMTUNE_TOKEN: never on the command line
    tuned = Tuned(args.server, token=os.environ.get("CMTUNE_TOKEN"), bundle=args.bundle, model=args.model_name)
    step, (state, tokens, targets), _ = (tiny_gpt_step if args.tiny else gpt_step)(tuned)
    leader = jax.process_index() == 0
    for i in range(args.steps):
        state, loss = step(state, tokens, targets)
        if leader:
            print(f"step {i}: loss {float(loss):.4f}", flush=True)
    if leader:
        print(tuned.report(), flush=True)


if __name__ == "__main__":
    main()
