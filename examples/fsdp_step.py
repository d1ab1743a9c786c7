"""A plain-JAX FSDP training step (as JAX's sharding docs write it) and its step specs for cmtune.

The batch and both MLP weights are sharded on their first dimension over one ``fsdp`` axis: XLA gathers each
weight before its product (forward and input gradient) and reduce-scatters each weight gradient after its
product.  With a `collective_matmul.Tuned` client the two products run `weight_allgather_matmul` (the weight's
shards on a ring) under the same named scopes, with the tuned configs of all three of their products.

    cmtune problems --step examples/fsdp_step.py:fsdp_step --devices virtual:8
    cmtune tune --step examples/fsdp_step.py:fsdp_step --devices processes:2x4
    cmtune verify --step examples/fsdp_step.py:fsdp_step --devices processes:2x4

``fsdp_tp_step`` adds tensor parallelism: the weights' other dimension over a ``model`` axis (the up
projection's output, the down projection's input), FSDP over ``fsdp`` beside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def make_step(tuned=None, *, batch: int, seq: int, d_model: int, d_ff: int, model: int = 1, devices=None):
    """``(step, args, mesh)``: one SGD step of a residual MLP, FSDP over ``fsdp`` (and ``model`` when > 1)."""
    devices = list(devices) if devices is not None else jax.devices()
    mesh = jax.make_mesh((len(devices) // model, model), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=devices)
    tensor = "model" if model > 1 else None

    def shard(*spec):
        return NamedSharding(mesh, P(*spec))

    def project(name, x, w, weight_dim):
        with jax.named_scope(name):
            if tuned is None:
                return x @ w
            return tuned.weight_allgather_matmul(x, w, mesh=mesh, axis="fsdp", weight_dim=weight_dim,
                                                 tensor_axis=tensor)

    def mlp(params, x):
        h = jax.nn.gelu(project("mlp_up", x, params["w_up"], "k"))  # w_up [D, F]: D (contracting) over fsdp
        # w_down [F, D]: with tensor parallelism F is the model axis's, D (its output) fsdp's
        return x + project("mlp_down", h, params["w_down"], "n" if tensor else "k")

    def loss(params, x, target):
        return jnp.mean((mlp(params, x) - target) ** 2)

    @jax.jit
    def step(params, x, target):
        value, grads = jax.value_and_grad(loss)(params, x, target)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "w_up": jax.device_put(jax.random.normal(k1, (d_model, d_ff)) / d_model**0.5, shard("fsdp", tensor)),
        "w_down": jax.device_put(jax.random.normal(k2, (d_ff, d_model)) / d_ff**0.5,
                                 shard(tensor, "fsdp") if tensor else shard("fsdp", None)),
    }
    x = jax.device_put(jax.random.normal(k3, (batch, seq, d_model)), shard("fsdp", None, None))
    target = jax.device_put(jax.random.normal(k4, (batch, seq, d_model)), shard("fsdp", None, None))
    return step, (params, x, target), mesh


def fsdp_step(tuned=None, devices=None):
    """FSDP alone: 8 devices, a batch of 16 sequences of 256, d_model 1024, d_ff 2048, float32."""
    return make_step(tuned, batch=16, seq=256, d_model=1024, d_ff=2048, devices=devices)


def tiny_fsdp_step(tuned=None, devices=None):
    """The same step, small enough to tune in a test."""
    return make_step(tuned, batch=16, seq=16, d_model=128, d_ff=256, devices=devices)


def fsdp_tp_step(tuned=None, devices=None):
    """FSDP x tensor parallelism: fsdp=4, model=2."""
    return make_step(tuned, batch=16, seq=16, d_model=128, d_ff=256, model=2, devices=devices)
