"""A data-parallel step: the batch sharded, the weight replicated; no collective matmul for cmtune to decompose
(its only collective is the gradients' all-reduce over the batch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def step(tuned=None):
    mesh = jax.make_mesh((jax.device_count(),), ("data",))

    @jax.jit
    def train(w, x):
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * grad, loss

    w = jax.device_put(jnp.ones((32, 32), jnp.float32), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((64, 32), jnp.float32), NamedSharding(mesh, P("data", None)))
    return train, (w, x), mesh
