"""The custom VJPs: each op's backward runs its own configs (grad_input, grad_weight, fuse).

Gradients are checked against the float64 closed form (``dx = g wᵀ``, ``dW = xᵀ g`` contracting
the rows and leading dims); the lowered module (StableHLO, before XLA merges anything) shows
which collectives the backward runs.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul.ops.collective import allgather_matmul, input_shardings, matmul_reduce_scatter
from collective_matmul.ops.ring import allgather_matmul_shard, matmul_reduce_scatter_shard
from collective_matmul.planning.decomposition import Decomposition
from tests.collective_matmul.test_grad_weight import lowered_collectives
from tests.collective_matmul.test_ops import TOLERANCE, mesh_1d, mesh_2d, rel_error

OPS = {"allgather_matmul": allgather_matmul, "matmul_reduce_scatter": matmul_reduce_scatter}
D = Decomposition.from_id

# name: (mesh factory, x shape per collective, n, batch axis)
SHAPES = {
    "flat": (mesh_1d, {"allgather_matmul": (64, 16), "matmul_reduce_scatter": (64, 64)}, 32, None),
    "batched": (mesh_1d, {"allgather_matmul": (2, 32, 16), "matmul_reduce_scatter": (2, 32, 64)}, 16, None),
    "mesh2d": (mesh_2d, {"allgather_matmul": (4, 32, 16), "matmul_reduce_scatter": (4, 32, 32)}, 24, "data"),
}


def setup(collective, shape_name, dtype, seed=0):
    """Placed x, w, a float32 cotangent and the float64 (dx, dW) it gives."""
    mesh_factory, shapes, n, batch_axis = SHAPES[shape_name]
    mesh = mesh_factory()
    rng = np.random.default_rng(seed)
    x_shape = shapes[collective]
    x = jnp.asarray(rng.standard_normal(x_shape, dtype=np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((x_shape[-1], n), dtype=np.float32), dtype)
    g = rng.standard_normal((*x_shape[:-1], n))
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    dims = tuple(range(x.ndim - 1))
    want = (g @ w64.T, np.tensordot(x64, g, axes=(dims, dims)))
    sx, sw = input_shardings(collective, mesh, "model", batch_dims=x.ndim - 2, batch_axis=batch_axis)
    return mesh, batch_axis, jax.device_put(x, sx), jax.device_put(w, sw), jnp.asarray(g, jnp.float32), want


def loss_fn(collective, mesh, batch_axis, cotangent, config, grad_input=None, grad_weight=None):
    op = partial(OPS[collective], mesh=mesh, axis="model", config=config, batch_axis=batch_axis,
                 grad_input=grad_input, grad_weight=grad_weight)
    return lambda x, w: jnp.sum(op(x, w).astype(jnp.float32) * cotangent)


# (collective, shape, dtype, forward, grad_input, grad_weight): a sample of the space covering every
# direction, chunks 1-8, unroll full/1/2, each accumulate, fuse on and off, ring and baseline.
CASES = [
    ("allgather_matmul", "flat", "float32", "baseline", None, None),
    ("allgather_matmul", "flat", "float32", "ring-uni-c1-full-dus", "ring-bi-c2-u1-in", "ring-uni-c4-u2-in"),
    ("allgather_matmul", "batched", "float32", "ring-bi-c4-full-cat", "ring-uni-c8-full-in", "ring-bi-c2-full-in-fuse"),
    ("allgather_matmul", "batched", "bfloat16", "ring-uni-c2-u1-dus", "ring-bi-c1-full-f32", "ring-uni-c2-u2-f32"),
    ("allgather_matmul", "flat", "bfloat16", "ring-uni-c8-u2-cat", None, "baseline-fuse"),
    ("allgather_matmul", "mesh2d", "bfloat16", "ring-bi-c2-full-dus", "ring-uni-c2-u1-in", "ring-bi-c1-full-in-fuse"),
    ("allgather_matmul", "mesh2d", "float32", "baseline", "ring-uni-c4-u2-in", "baseline"),
    ("matmul_reduce_scatter", "flat", "float32", "baseline", None, None),
    ("matmul_reduce_scatter", "flat", "float32", "ring-uni-c1-full-in", "ring-bi-c2-u1-dus", "ring-uni-c4-u2-in"),
    ("matmul_reduce_scatter", "batched", "float32", "ring-bi-c4-full-in", "ring-uni-c8-u1-cat",
     "ring-uni-c1-full-in-fuse"),
    ("matmul_reduce_scatter", "batched", "bfloat16", "ring-uni-c2-u2-f32", "ring-bi-c2-full-cat", "ring-bi-c1-u1-f32"),
    ("matmul_reduce_scatter", "flat", "bfloat16", "ring-bi-c1-u2-in", None, "baseline"),
    ("matmul_reduce_scatter", "mesh2d", "bfloat16", "ring-bi-c2-full-f32", "ring-uni-c2-u1-dus", "baseline-fuse"),
    ("matmul_reduce_scatter", "mesh2d", "float32", "baseline", "baseline", "ring-bi-c2-full-in-fuse"),
]


@pytest.mark.parametrize("collective, shape_name, dtype, forward, grad_input, grad_weight", CASES)
def test_gradients_with_backward_configs_match_float64(collective, shape_name, dtype, forward, grad_input,
                                                       grad_weight):
    mesh, batch_axis, x, w, g, want = setup(collective, shape_name, dtype, seed=len(forward))
    loss = loss_fn(collective, mesh, batch_axis, g, D(forward), grad_input and D(grad_input),
                   grad_weight and D(grad_weight))
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    for name, grad, primal, expected in zip(("dx", "dW"), got, (x, w), want, strict=True):
        assert grad.dtype == primal.dtype and grad.shape == primal.shape
        assert rel_error(grad, expected) <= TOLERANCE[dtype], f"{name}: {forward} / {grad_input} / {grad_weight}"


PERMUTES = "collective_permute"
# (collective, forward, grad_input, grad_weight, lowered collectives of value_and_grad) on 8 devices:
# an unrolled ring makes chunks x hops permutes, 7 hops either direction.
LOWERED = [
    # the defaults are what autodiff of the baseline does: one gather (kept, or of dy for both)
    ("allgather_matmul", "baseline", None, None, dict(all_gather=1, reduce_scatter=1)),
    ("matmul_reduce_scatter", "baseline", None, None, dict(all_gather=1, reduce_scatter=1)),
    # forward baseline + grad_input ring: every permute is the backward's
    ("allgather_matmul", "baseline", "ring-uni-c2-full-in", None, {PERMUTES: 14, "all_gather": 1}),
    ("matmul_reduce_scatter", "baseline", "ring-bi-c4-full-dus", None, {PERMUTES: 28, "reduce_scatter": 1}),
    # unfused: the weight gradient runs its own op (a second gather, or a second ring)
    ("allgather_matmul", "baseline", None, "baseline", dict(all_gather=2, reduce_scatter=1)),
    ("allgather_matmul", "baseline", "ring-uni-c2-full-in", "ring-bi-c1-full-in", {PERMUTES: 14 + 7, "all_gather": 1}),
    ("matmul_reduce_scatter", "baseline", None, "baseline", dict(all_gather=2, reduce_scatter=1)),
    ("matmul_reduce_scatter", "baseline", "ring-uni-c2-full-dus", "ring-uni-c4-full-in", {PERMUTES: 14 + 28,
                                                                                         "reduce_scatter": 1}),
    # fused: one loop serves both (the forward ring keeps x; one ring over dy for dx and dW)
    ("allgather_matmul", "ring-uni-c1-full-dus", None, None, {PERMUTES: 7, "reduce_scatter": 1}),
    ("allgather_matmul", "ring-bi-c2-full-cat", "ring-uni-c1-full-in", "ring-uni-c4-full-in-fuse", {PERMUTES: 14 + 7}),
    ("matmul_reduce_scatter", "baseline", "ring-uni-c2-full-dus", "ring-bi-c1-full-in-fuse", {PERMUTES: 14,
                                                                                             "reduce_scatter": 1}),
    # a forward ring with baseline backward configs
    ("allgather_matmul", "ring-uni-c2-full-dus", "ring-bi-c1-full-in", "ring-uni-c1-full-in", {PERMUTES: 14 + 7 + 7}),
    ("matmul_reduce_scatter", "ring-uni-c1-full-in", "baseline", "baseline", {PERMUTES: 7, "all_gather": 2}),
]


@pytest.mark.parametrize("collective, forward, grad_input, grad_weight, expected", LOWERED)
def test_lowered_backward_runs_the_backward_configs(collective, forward, grad_input, grad_weight, expected):
    mesh, batch_axis, x, w, g, _ = setup(collective, "flat", "float32")
    loss = loss_fn(collective, mesh, batch_axis, g, D(forward), grad_input and D(grad_input),
                   grad_weight and D(grad_weight))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    assert +lowered_collectives(text) == expected


def data_axis_reductions(text: str, mesh) -> int:
    """All-reduces of a lowered module whose replica groups are exactly the data axis's (devices differing in
    'data'), in either form JAX writes them: listed devices (GSPMD) or the mesh axis by name (Shardy)."""
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    groups = ", ".join("[" + ", ".join(map(str, column)) + "]" for column in ids.T)
    listed = f"replica_groups = dense<[{groups}]>"
    named = re.compile(r'replica_groups = #stablehlo\.replica_group_mesh_axes<mesh = @\w+, axes = '
                       r'\[#stablehlo\.axis_ref<name = "data">\]>')
    return sum(1 for line in text.splitlines()
               if "stablehlo.all_reduce" in line and (listed in line or named.search(line)))


@pytest.mark.parametrize(
    "collective, forward, grad_input, grad_weight",
    [
        ("allgather_matmul", "ring-uni-c4-full-dus", "ring-uni-c2-full-in", "ring-uni-c4-full-in"),
        ("allgather_matmul", "ring-bi-c2-full-cat", None, None),
        ("allgather_matmul", "baseline", None, "ring-uni-c2-u1-in"),
        ("matmul_reduce_scatter", "ring-uni-c4-full-in", "ring-uni-c4-full-dus", "ring-bi-c2-full-in"),
        ("matmul_reduce_scatter", "ring-bi-c2-full-in", "ring-uni-c4-full-cat", "ring-uni-c1-full-in-fuse"),
        ("matmul_reduce_scatter", "baseline", None, None),
    ],
)
def test_weight_gradient_is_reduced_over_the_data_axis_once(collective, forward, grad_input, grad_weight):
    """One data-axis all-reduce per op, whatever the chunks (autodiff of a ring would make one per piece)."""
    mesh, batch_axis, x, w, g, _ = setup(collective, "mesh2d", "float32")
    loss = loss_fn(collective, mesh, batch_axis, g, D(forward), grad_input and D(grad_input),
                   grad_weight and D(grad_weight))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    assert lowered_collectives(text)["all_reduce"] == 1
    assert data_axis_reductions(text, mesh) == 1


def mlp_reference(x, layers, g):
    """float64 value and gradients of ``x_{l+1} = x_l + (x_l A_l) B_l``, loss ``sum(x_L * g)``."""
    xs = [x]
    for a, b in layers:
        xs.append(xs[-1] + xs[-1] @ a @ b)
    dx, grads = g, []
    dims = tuple(range(x.ndim - 1))
    for (a, b), x_l in zip(reversed(layers), reversed(xs[:-1]), strict=True):
        dh = dx @ b.T
        grads.append((np.tensordot(x_l, dh, axes=(dims, dims)), np.tensordot(x_l @ a, dx, axes=(dims, dims))))
        dx = dx + dh @ a.T
    return float(np.sum(xs[-1] * g)), dx, grads[::-1]


UP = dict(config=D("ring-bi-c2-full-dus"), grad_input=D("ring-uni-c2-u1-in"), grad_weight=D("ring-uni-c1-full-in"))
DOWN = dict(config=D("ring-uni-c2-u1-in"), grad_input=D("ring-bi-c2-full-cat"),
            grad_weight=D("ring-uni-c2-full-in-fuse"))


@pytest.mark.parametrize("remat", [False, True])
def test_layers_in_scan_under_checkpoint(remat):
    """A stack of up/down projections in `lax.scan`, with `jax.checkpoint`, on a data x model mesh."""
    mesh = mesh_2d()
    rng = np.random.default_rng(21)
    layers_n, d, f = 2, 16, 32
    x = rng.standard_normal((4, 16, d))
    a = rng.standard_normal((layers_n, d, f)) / 4
    b = rng.standard_normal((layers_n, f, d)) / 4
    g = rng.standard_normal(x.shape)
    ops = dict(mesh=mesh, axis="model", batch_axis="data")

    def layer(h, params):
        a_l, b_l = params
        up = allgather_matmul(h, a_l, **ops, **UP)
        return h + matmul_reduce_scatter(up, b_l, **ops, **DOWN), None

    body = jax.checkpoint(layer) if remat else layer

    def loss(h, a_s, b_s):
        out, _ = lax.scan(body, h, (a_s, b_s))
        return jnp.sum(out * jnp.asarray(g, jnp.float32))

    place = lambda array, spec: jax.device_put(jnp.asarray(array, jnp.float32), NamedSharding(mesh, spec))  # noqa: E731
    args = (place(x, P("data", "model", None)), place(a, P(None, None, "model")), place(b, P(None, "model", None)))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    # the scan body holds both ops once: one data-axis reduction of each weight gradient
    assert data_axis_reductions(step.lower(*args).as_text(), mesh) == 2
    value, (dx, da, db) = step(*args)
    want_value, want_dx, want_grads = mlp_reference(x, list(zip(a, b, strict=True)), g)
    assert abs(float(value) - want_value) <= 1e-5 * abs(want_value)
    assert rel_error(dx, want_dx) < 1e-5
    assert rel_error(da, np.stack([ga for ga, _ in want_grads])) < 1e-5
    assert rel_error(db, np.stack([gb for _, gb in want_grads])) < 1e-5


def test_per_shard_kernels_in_a_users_shard_map_without_check_vma():
    """Without `check_vma` nothing is known to vary: `shard_map` sums w's cotangent over 'data' once."""
    mesh = mesh_2d()
    rng = np.random.default_rng(30)
    x, w1, w2 = (rng.standard_normal(s) for s in ((4, 16, 8), (8, 16), (16, 8)))
    g = rng.standard_normal((4, 16, 8))
    configs = dict(config=D("ring-uni-c2-full-dus"), grad_input=D("ring-uni-c2-full-in"),
                   grad_weight=D("ring-uni-c2-full-in"))

    def body(x_s, w1_s, w2_s):
        h = allgather_matmul_shard(x_s, w1_s, axis="model", **configs)
        return matmul_reduce_scatter_shard(h, w2_s, axis="model", config=D("ring-uni-c2-full-in"),
                                           grad_weight=D("baseline-fuse"))

    specs = (P("data", "model", None), P(None, "model"), P("model", None))
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("data", "model", None), check_vma=False)
    loss = lambda *args: jnp.sum(fn(*args) * jnp.asarray(g, jnp.float32))  # noqa: E731
    args = [jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, s)) for a, s in zip((x, w1, w2), specs,
                                                                                                strict=True)]
    dx, dw1, dw2 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    dims = (0, 1)
    assert rel_error(dx, g @ w2.T @ w1.T) < 1e-5
    assert rel_error(dw1, np.tensordot(x, g @ w2.T, axes=(dims, dims))) < 1e-5
    assert rel_error(dw2, np.tensordot(x @ w1, g, axes=(dims, dims))) < 1e-5


def test_forward_is_unchanged_by_backward_configs():
    """Backward configs do not touch the forward program (outside autodiff)."""
    mesh, batch_axis, x, w, _, _ = setup("allgather_matmul", "flat", "float32")
    texts = {
        jax.jit(partial(allgather_matmul, mesh=mesh, axis="model", config=D("ring-uni-c2-full-dus"), **kw))
        .lower(x, w).as_text()
        for kw in ({}, dict(grad_input=D("ring-bi-c4-full-in"), grad_weight=D("ring-uni-c1-full-in")))
    }
    assert len(texts) == 1


@pytest.mark.parametrize(
    "collective, kwargs, message",
    [
        ("allgather_matmul", dict(config=D("baseline-fuse")), "fuse=True is not for allgather_matmul"),
        ("allgather_matmul", dict(grad_input=D("ring-uni-c1-full-in-fuse")),
         "grad_input: fuse=True is not for matmul_reduce_scatter"),
        ("allgather_matmul", dict(grad_input=D("ring-uni-c1-full-dus")),
         "grad_input: accumulate='update_slice' is not for matmul_reduce_scatter"),
        ("allgather_matmul", dict(grad_weight=D("ring-uni-c1-full-cat")),
         "grad_weight: accumulate='concat' is not for allgather_grad_weight"),
        ("matmul_reduce_scatter", dict(grad_input=D("ring-uni-c16-full-dus")),
         "grad_input: chunks=16 does not divide a block of 8"),
        ("matmul_reduce_scatter", dict(grad_weight=D("ring-uni-c1-full-f32")), "grad_weight: .*same program"),
        ("matmul_reduce_scatter", dict(config=D("ring-uni-c1-full-in-fuse")),
         "fuse=True is not for matmul_reduce_scatter"),
    ],
)
def test_invalid_backward_configs_raise_value_error_naming_them(collective, kwargs, message):
    mesh, _, x, w, _, _ = setup(collective, "flat", "float32")
    args = {"mesh": mesh, "axis": "model", "config": Decomposition()} | kwargs
    with pytest.raises(ValueError, match=message):
        OPS[collective](x, w, **args)
