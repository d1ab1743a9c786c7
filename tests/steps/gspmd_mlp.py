"""An MLP block written plainly with `jax.jit` and `NamedSharding` on a mesh with Auto axes (XLA places the
collectives), as a user has it, plus the step spec cmtune takes; with a tuned client, the two projections
run cmtune's ops under the same named scopes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH, SEQ, D_MODEL, D_FF = 4, 64, 64, 128


def make_step(tuned=None, *, axis_types=AxisType.Auto):
    mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "model"), axis_types=(axis_types,) * 2)

    def shard(*spec):
        return NamedSharding(mesh, P(*spec))

    def constrain(x, *spec):
        if axis_types == AxisType.Explicit:
            return jax.sharding.reshard(x, shard(*spec))
        return jax.lax.with_sharding_constraint(x, shard(*spec))

    def mlp(params, x):
        with jax.named_scope("mlp_up"):
            if tuned is None:
                h = constrain(jnp.einsum("bsd,df->bsf", x, params["w_up"],
                                         **({"out_sharding": shard("data", None, "model")}
                                            if axis_types == AxisType.Explicit else {})), "data", None, "model")
            else:
                h = tuned.allgather_matmul(x, params["w_up"], mesh=mesh, axis="model", batch_axis="data")
        h = jax.nn.gelu(h)
        with jax.named_scope("mlp_down"):
            if tuned is None:
                y = constrain(jnp.einsum("bsf,fd->bsd", h, params["w_down"],
                                         **({"out_sharding": shard("data", "model", None)}
                                            if axis_types == AxisType.Explicit else {})), "data", "model", None)
            else:
                y = tuned.matmul_reduce_scatter(h, params["w_down"], mesh=mesh, axis="model", batch_axis="data")
        return x + y

    def loss(params, x, target):
        return jnp.mean((mlp(params, x) - target) ** 2)

    @jax.jit
    def step(params, x, target):
        value, grads = jax.value_and_grad(loss)(params, x, target)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w_up": jax.device_put(jax.random.normal(k1, (D_MODEL, D_FF)) / D_MODEL**0.5, shard(None, "model")),
              "w_down": jax.device_put(jax.random.normal(k2, (D_FF, D_MODEL)) / D_FF**0.5, shard("model", None))}
    x = jax.device_put(jax.random.normal(k3, (BATCH, SEQ, D_MODEL)), shard("data", "model", None))
    target = jax.device_put(jax.random.normal(k4, (BATCH, SEQ, D_MODEL)), shard("data", "model", None))
    return step, (params, x, target), mesh


def mlp_step(tuned=None):
    return make_step(tuned)


def explicit_mlp_step(tuned=None):
    return make_step(tuned, axis_types=AxisType.Explicit)


def abstract_mlp_step(tuned=None):
    """The same step from abstract arguments (shapes and shardings only): enough to discover and tune."""
    step, args, mesh = make_step(tuned)
    return step, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args), mesh


def no_collective_step(tuned=None):
    """A step whose matmul needs no collective: every array replicated."""
    mesh = jax.make_mesh((jax.device_count(),), ("model",), axis_types=(AxisType.Auto,))
    w = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P()))
    return jax.jit(lambda w, x: jnp.sum(x @ w)), (w, jnp.ones((8, 16))), mesh


def broken_step(tuned=None):
    raise RuntimeError("the user's code is broken here")


def not_a_triple(tuned=None):
    return "step"
