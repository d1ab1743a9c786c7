"""A step with long labels, as a real model has them: a deep named scope (its matmul's role) and a
long mesh axis name.  In a table of its problems every column is wide, the problem key's too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "tensor_parallel_axis_across_the_chips_of_one_host"
ROLE = "decoder/transformer_layer_with_a_long_name/self_attention_block/query_key_value_projection"
PROBLEM = "allgather_matmul:2048x1024x384:float32:8"  # on 8 devices


def long_names_step(tuned=None):
    """x sharded on its rows times w sharded on its columns, the result sharded on its columns: an all-gather matmul."""
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(AxisType.Auto,))
    x = jax.device_put(jnp.ones((2048, 1024)), NamedSharding(mesh, P(AXIS, None)))
    w = jax.device_put(jnp.ones((1024, 384)), NamedSharding(mesh, P(None, AXIS)))

    def step(x, w):
        with jax.named_scope(ROLE):
            return jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P(None, AXIS)))

    return jax.jit(step), (x, w), mesh
