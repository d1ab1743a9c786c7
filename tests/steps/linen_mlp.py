"""A two-layer MLP in Flax linen with tensor and sequence parallelism (logical axes as MaxText names them), and
its step spec: with a tuned client, the Dense layers take cmtune's drop-in through `dot_general_cls`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul.client import flax as cm_flax

BATCH, SEQ, D_MODEL, D_FF, LAYERS = 4, 64, 64, 128, 2
RULES = (("embed", None), ("mlp", "model"))


class Mlp(nn.Module):
    mesh: object
    tuned: object = None

    @nn.compact
    def __call__(self, x):
        def dense(features, axes, name):
            return nn.Dense(features, use_bias=False, name=name,
                            kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
                            dot_general_cls=cm_flax.dot_general_cls(self.tuned, mesh=self.mesh, kernel_axes=axes)
                            if self.tuned is not None else None)

        def shard(y, *spec):
            return jax.lax.with_sharding_constraint(y, NamedSharding(self.mesh, P(*spec)))

        h = shard(nn.gelu(dense(D_FF, ("embed", "mlp"), "up")(x)), "data", None, "model")
        return x + shard(dense(D_MODEL, ("mlp", "embed"), "down")(h), "data", "model", None)


class Model(nn.Module):
    mesh: object
    tuned: object = None

    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = Mlp(self.mesh, self.tuned, name=f"layer{i}")(x)
        return x


def linen_step(tuned=None):
    mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    model = Model(mesh, tuned)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (BATCH, SEQ, D_MODEL)),
                       NamedSharding(mesh, P("data", "model", None)))
    with nn.logical_axis_rules(RULES):
        boxed = model.init(jax.random.key(0), x)
        specs = nn.logical_to_mesh(nn.get_partition_spec(boxed))
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), nn.unbox(boxed), specs)

    def loss(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    @jax.jit
    def step(p, x):
        value, grads = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value

    return step, (params, x), mesh
