"""A transformer MLP block trained with tuned collective matmuls (sequence parallelism).

    python examples/mlp_block.py --bundle tuned.json        # configs from a bundle file
    python examples/mlp_block.py --server http://127.0.0.1:8470 --token cmt_...

x ``[batch, seq, d_model]`` is sharded on seq over the ``model`` axis between blocks.  The MLP
up-projection is an all-gather matmul (gather seq, w_up sharded on d_ff), the down-projection
a matmul reduce-scatter (w_down sharded on d_ff, scatter seq): the Megatron-SP layout.  The
whole transformer block (attention too) is `collective_matmul.block`.
"""

from __future__ import annotations

import argparse
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul import Tuned


def init(key, *, batch=2, seq=64, d_model=64, d_ff=256, mesh):
    kx, ky, ku, kd = jax.random.split(key, 4)
    seq_sharded = NamedSharding(mesh, P(None, "model", None))
    x = jax.device_put(jax.random.normal(kx, (batch, seq, d_model)), seq_sharded)
    target = jax.device_put(jax.random.normal(ky, (batch, seq, d_model)), seq_sharded)
    w_up = jax.random.normal(ku, (d_model, d_ff)) / d_model**0.5
    w_down = jax.random.normal(kd, (d_ff, d_model)) / d_ff**0.5
    params = {
        "w_up": jax.device_put(w_up, NamedSharding(mesh, P(None, "model"))),
        "w_down": jax.device_put(w_down, NamedSharding(mesh, P("model", None))),
    }
    return params, x, target


def mlp(params, x, *, ops, mesh):
    """``ops`` provides allgather_matmul / matmul_reduce_scatter (a `Tuned`, or the baseline).

    A `Tuned` looks up each op's forward and backward configs (``role`` labels them in
    ``tuned.resolved_by_role``).
    """
    h = ops.allgather_matmul(x, params["w_up"], mesh=mesh, axis="model", role="mlp_up")
    return ops.matmul_reduce_scatter(jax.nn.gelu(h), params["w_down"], mesh=mesh, axis="model", role="mlp_down")


def loss_fn(params, x, target, *, ops, mesh):
    return jnp.mean((mlp(params, x, ops=ops, mesh=mesh) + x - target) ** 2)


def train_step(params, x, target, *, ops, mesh, lr=0.1):
    loss, grads = jax.value_and_grad(partial(loss_fn, ops=ops, mesh=mesh))(params, x, target)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server")
    parser.add_argument("--token")
    parser.add_argument("--bundle")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    mesh = jax.make_mesh((8,), ("model",))
    tuned = Tuned(args.server, token=args.token, bundle=args.bundle)
    params, x, target = init(jax.random.key(0), mesh=mesh)
    step = jax.jit(partial(train_step, ops=tuned, mesh=mesh))
    for i in range(args.steps):
        params, loss, _ = step(params, x, target)
        print(f"step {i}: loss {float(loss):.4f}")
    for role, slots in tuned.resolved_by_role.items():
        for slot, (problem, found) in slots.items():
            print(f"{role}.{slot} {problem.key}: {found.decomposition.id} ({found.match} from {found.origin})")


if __name__ == "__main__":
    main()
