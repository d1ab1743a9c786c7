"""Parts of the NNX GPT example as step specs: where its gain goes (``bench/step.py --example --parts``).

    cmtune verify --step bench/gpt_parts.py:blocks_sgd_step --devices processes:2x4 --bundle tuned.json --name gpt_step

Each spec builds its step from the example's own `Block`s (`examples/flax_nnx_gpt.py`), so the
drop-in's calls carry the example's roles (their source lines) and take the same bundle's configs,
and the decision's overrides with ``--name gpt_step``:

- `blocks_sgd_step`: the example's two blocks alone on activations ``[batch, seq, d_model]``
  (sharded as between blocks), a mean squared error and SGD: the reference block's kind of step.
- `blocks_adamw_step`: the same with the example's AdamW.
- `gpt_sgd_step`: the whole example (token embedding, tied logits, cross-entropy) with SGD.

The example itself (`gpt_step`: the whole model with AdamW) completes the set.  The difference
between two parts is work no collective matmul touches (the embedding's gradient all-reduce, the
tied logits, the optimizer), so each part's speedup says how much of the step the tuned projections
are.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import flax_nnx_gpt as example  # noqa: E402  (the example is a script, not a package)


class Blocks(nnx.Module):
    """The example's blocks without the embedding and the logits."""

    def __init__(self, cfg: example.Config, mesh, tuned=None, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([example.Block(cfg, mesh, tuned, rngs=rngs) for _ in range(cfg.layers)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _mse(model: Blocks, x, target):
    return jnp.mean(jnp.square(model(x).astype(jnp.float32) - target.astype(jnp.float32)))


def _blocks(tuned, optimizer: str, cfg: example.Config = example.DEMO, seed: int = 0):
    mesh = example.make_mesh()
    tx = optax.adamw(cfg.learning_rate) if optimizer == "adamw" else optax.sgd(cfg.learning_rate)
    with jax.set_mesh(mesh):
        model = Blocks(cfg, mesh, tuned, rngs=nnx.Rngs(seed))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    normal = jax.jit(partial(jax.random.normal, shape=(cfg.batch, cfg.seq, cfg.d_model), dtype=jnp.dtype(cfg.dtype)),
                     out_shardings=NamedSharding(mesh, P("data", "model", None)))
    x, target = (normal(key) for key in jax.random.split(jax.random.key(seed + 1)))
    return example.train_step(graphdef, _mse), (state, x, target), mesh


def blocks_sgd_step(tuned=None):
    """The example's blocks alone, mean squared error, SGD."""
    return _blocks(tuned, "sgd")


def blocks_adamw_step(tuned=None):
    """The example's blocks alone, mean squared error, AdamW."""
    return _blocks(tuned, "adamw")


def gpt_sgd_step(tuned=None):
    """The whole example (embedding, tied logits, cross-entropy) with SGD instead of AdamW."""
    return example.build(example.DEMO, tuned, optimizer=optax.sgd(example.DEMO.learning_rate))
