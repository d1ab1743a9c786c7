"""`weight_allgather_matmul`: the collective matmuls of FSDP, the weight's shards on the ring.

Values and both gradients against the float64 closed form (``y = x w``, ``dx = g wᵀ``, ``dw = xᵀ g`` contracting
every row), for random shapes, meshes (FSDP alone, with a data axis beside it, with a tensor axis on the weight's
other dimension), dtypes and configs of all three products; the lowered module shows which collectives each
form runs (a ring: permutes, no all-gather of the weight, no reduce-scatter of its gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

from collective_matmul.ops.collective import _weight_specs, weight_allgather_matmul
from collective_matmul.planning.decomposition import Decomposition
from tests.collective_matmul.test_grad_weight import lowered_collectives
from tests.collective_matmul.test_ops import TOLERANCE, rel_error

D = Decomposition.from_id
MESHES = {  # name: (axes, sizes, ring axis, batch axis, tensor axis)
    "fsdp8": ((8,), ("fsdp",), "fsdp", None, None),
    "data2-fsdp4": ((2, 4), ("data", "fsdp"), "fsdp", "data", None),
    "fsdp4-model2": ((4, 2), ("fsdp", "model"), "fsdp", None, "model"),
}


def setup(mesh_name: str, weight_dim: str, x_shape: tuple, n: int, dtype: str, seed: int = 0):
    """The mesh, placed x and w, a float32 cotangent, and the float64 (y, dx, dw)."""
    sizes, names, axis, batch, tensor = MESHES[mesh_name]
    mesh = jax.make_mesh(sizes, names, axis_types=(AxisType.Explicit,) * len(sizes))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(x_shape, dtype=np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((x_shape[-1], n), dtype=np.float32), dtype)
    g = rng.standard_normal((*x_shape[:-1], n))
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    dims = tuple(range(x.ndim - 1))
    want = (x64 @ w64, g @ w64.T, np.tensordot(x64, g, axes=(dims, dims)))
    x_spec, w_spec, _ = _weight_specs(x, w, mesh, axis, weight_dim, batch, tensor)
    x, w = jax.device_put(x, NamedSharding(mesh, x_spec)), jax.device_put(w, NamedSharding(mesh, w_spec))
    options = dict(mesh=mesh, axis=axis, weight_dim=weight_dim, batch_axis=batch, tensor_axis=tensor)
    return options, x, w, jnp.asarray(g, jnp.float32), want


def run(options, x, w, g, config, grad_input=None, grad_weight=None):
    """``(y, dx, dw)`` of the op under jit."""
    def loss(x, w):
        y = weight_allgather_matmul(x, w, config=config, grad_input=grad_input, grad_weight=grad_weight, **options)
        return jnp.sum(y.astype(jnp.float32) * g), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    return y, dx, dw


# (mesh, weight dim, x shape, n, dtype, forward, grad_input, grad_weight): a sample covering every knob of each
# of the three products, both weight dimensions, batch and tensor axes, and the kept weight (fuse)
CASES = [
    ("fsdp8", "k", (16, 64), 24, "float32", "baseline", "baseline", "baseline"),
    ("fsdp8", "k", (16, 64), 24, "float32", "ring-uni-c1-full-auto", "ring-uni-c1-full-dus", "ring-uni-c1-full-in"),
    ("fsdp8", "k", (8, 4, 32), 16, "float32", "ring-bi-c2-full-in", "ring-bi-c2-u1-cat", "ring-bi-c2-u2-in"),
    ("fsdp8", "n", (16, 24), 64, "float32", "ring-uni-c2-u1-dus", "ring-bi-c1-full-in", "ring-uni-c1-u1-in"),
    ("fsdp8", "n", (8, 2, 24), 32, "float32", "ring-bi-c1-full-cat", "ring-uni-c2-u2-in", "ring-bi-c2-full-in"),
    ("fsdp8", "k", (16, 64), 24, "float32", "ring-bi-c1-full-in", "baseline", "ring-bi-c1-u1-in-fuse"),
    ("fsdp8", "n", (16, 24), 64, "float32", "ring-uni-c1-full-cat", "ring-uni-c1-full-in", "baseline-fuse"),
    ("data2-fsdp4", "k", (8, 4, 32), 16, "float32", "ring-uni-c1-u1-in", "ring-uni-c1-full-dus", "ring-bi-c2-full-in"),
    ("data2-fsdp4", "n", (16, 24), 32, "float32", "ring-uni-c1-full-dus", "baseline", "ring-uni-c2-u1-in"),
    ("fsdp4-model2", "k", (8, 32), 16, "float32", "ring-uni-c2-full-in", "ring-bi-c1-full-cat", "ring-uni-c1-u1-in"),
    ("fsdp4-model2", "n", (8, 2, 32), 24, "float32", "ring-uni-c1-u1-dus", "ring-uni-c1-full-in", "ring-bi-c1-full-in"),
    ("fsdp8", "k", (16, 64), 32, "bfloat16", "ring-bi-c2-full-f32", "ring-uni-c1-u1-dus", "ring-bi-c1-full-f32"),
    ("fsdp8", "n", (16, 32), 64, "bfloat16", "ring-uni-c1-full-dus", "ring-bi-c1-full-f32", "ring-uni-c2-full-f32"),
]


@pytest.mark.parametrize("mesh_name, weight_dim, x_shape, n, dtype, forward, grad_input, grad_weight", CASES)
def test_values_and_gradients_equal_float64(mesh_name, weight_dim, x_shape, n, dtype, forward, grad_input,
                                            grad_weight):
    options, x, w, g, want = setup(mesh_name, weight_dim, x_shape, n, dtype)
    got = run(options, x, w, g, D(forward), D(grad_input), D(grad_weight))
    for name, actual, expected in zip(("y", "dx", "dw"), got, want, strict=True):
        assert actual.shape == expected.shape and actual.dtype == jnp.dtype(dtype), name
        assert rel_error(actual, expected) < TOLERANCE[dtype], (name, rel_error(actual, expected))
    assert got[2].sharding.spec == _weight_specs(x, w, options["mesh"], options["axis"], weight_dim,
                                                 options["batch_axis"], options["tensor_axis"])[1]


@pytest.mark.parametrize("weight_dim", ["k", "n"])
def test_random_shapes_meshes_and_configs_equal_float64(weight_dim):
    """Six draws of mesh, shape, dtype and, for each product, a candidate of its slot's problem."""
    from collective_matmul.planning.models import SLOTS, WEIGHT_K, WEIGHT_N, slot_problems
    from collective_matmul.planning.space import candidates

    rng = np.random.default_rng(7 if weight_dim == "k" else 8)
    for _ in range(6):
        mesh_name = str(rng.choice(list(MESHES)))
        ring = MESHES[mesh_name][0][MESHES[mesh_name][1].index("fsdp")]
        rows = ring * int(rng.choice([2, 4]))
        k, n = (int(v) * ring * 2 for v in rng.choice([1, 2, 4], size=2))
        dtype = str(rng.choice(["float32", "bfloat16"]))
        lead = (rows,) if rng.random() < 0.5 else (rows, 2)
        options, x, w, g, want = setup(mesh_name, weight_dim, (*lead, k), n, dtype, seed=int(rng.integers(1 << 20)))
        # each slot's config drawn from its own problem's candidates (the keys a tuned config is stored under)
        tensor = 2 if MESHES[mesh_name][4] else 1
        forward = WEIGHT_K if weight_dim == "k" else WEIGHT_N
        m = rows // (2 if MESHES[mesh_name][3] else 1) * int(np.prod(lead[1:]))  # one ring's rows, batch folded
        slots = slot_problems(forward, m=m, k=k // (tensor if weight_dim == "n" else 1),
                              n=n // (tensor if weight_dim == "k" else 1), dtype=dtype, axis_size=ring)
        pick = []
        for slot in SLOTS:
            space = [c for c in candidates(slots[slot]) if c.method != "xla"]
            pick.append(space[int(rng.integers(len(space)))])
        got = run(options, x, w, g, *pick)
        for name, actual, expected in zip(("y", "dx", "dw"), got, want, strict=True):
            assert rel_error(actual, expected) < TOLERANCE[dtype], (mesh_name, lead, k, n, dtype, pick, name)


def lowered(options, x, w, g, *configs):
    """The collectives of the value and both gradients, lowered (StableHLO, before XLA's passes)."""
    def loss(x, w):
        return jnp.sum(weight_allgather_matmul(x, w, config=configs[0], grad_input=configs[1],
                                               grad_weight=configs[2], **options) * g)
    return lowered_collectives(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text())


@pytest.mark.parametrize("weight_dim, x_shape, n, grad_input", [("k", (16, 64), 24, "ring-uni-c1-full-dus"),
                                                                ("n", (16, 24), 64, "ring-uni-c1-full-in")])
def test_a_ring_moves_the_weight_with_permutes_and_the_baseline_gathers_it(weight_dim, x_shape, n, grad_input):
    """A ring of every product is collective-permutes only; the baseline all-gathers the weight (forward and input
    gradient) and reduce-scatters its gradient; a kept weight is not gathered again."""
    operands = setup("fsdp8", weight_dim, x_shape, n, "float32")[:4]
    ring = lowered(*operands, D("ring-uni-c1-full-auto"), D(grad_input), D("ring-uni-c1-full-in"))
    assert ring["collective_permute"] == 3 * 7 and ring["all_gather"] == ring["reduce_scatter"] == 0, ring
    base = lowered(*operands, Decomposition.baseline(), Decomposition.baseline(), Decomposition.baseline())
    assert base["all_gather"] == 2 and base["reduce_scatter"] == 1 and base["collective_permute"] == 0, base
    autodiff = lowered(*operands, Decomposition.baseline(), None, None)  # the defaults: the weight kept
    assert autodiff["all_gather"] == 1 and autodiff["reduce_scatter"] == 1, autodiff
    kept = lowered(*operands, D("ring-uni-c1-full-auto"), Decomposition.baseline(), D("ring-uni-c1-full-in-fuse"))
    assert kept["collective_permute"] == 2 * 7 and kept["all_gather"] == 0, kept  # no second gather


def test_xla_leaves_the_product_as_written():
    options, x, w, g, want = setup("fsdp8", "k", (16, 64), 24, "float32")
    got = run(options, x, w, g, Decomposition.xla(), Decomposition.xla(), Decomposition.xla())
    assert all(rel_error(a, e) < 1e-5 for a, e in zip(got, want, strict=True))


@pytest.mark.parametrize("change, message", [
    (dict(weight_dim="m"), "weight_dim='m': give 'k'"),
    (dict(config=D("ring-uni-c64-full-auto")), "chunks=64"),
    (dict(grad_weight=D("ring-uni-c1-full-dus")), "grad_weight: "),
    (dict(config=Decomposition.baseline(fuse=True)), "fuse=True is the weight gradient's"),
    (dict(grad_input=Decomposition.baseline(fuse=True)), "grad_input: fuse=True is the weight gradient's"),
    (dict(grad_input=Decomposition.xla()), "method='xla' is for the whole op"),
])
def test_what_does_not_fit_is_refused_saying_why(change, message):
    options, x, w, g, _ = setup("fsdp8", "k", (16, 64), 24, "float32")
    args = dict(options, config=D("ring-uni-c1-full-auto")) | change
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        jax.jit(jax.grad(lambda x, w: jnp.sum(weight_allgather_matmul(x, w, **args)), argnums=(0, 1)))(x, w)


def test_shapes_that_do_not_shard_are_refused_saying_which():
    options, x, w, g, _ = setup("fsdp8", "k", (16, 64), 24, "float32")
    mesh = options["mesh"]
    with pytest.raises(ValueError, match="x's first dimension 12 is not divisible by the 8 devices"):
        weight_allgather_matmul(jnp.ones((12, 64)), w, mesh=mesh, axis="fsdp", config=Decomposition.baseline())
    with pytest.raises(ValueError, match="K=60 is not divisible by the 8 devices"):
        weight_allgather_matmul(jnp.ones((16, 60)), jnp.ones((60, 8)), mesh=mesh, axis="fsdp",
                                config=Decomposition.baseline())
    with pytest.raises(ValueError, match="'model' is not an axis of the mesh"):
        weight_allgather_matmul(x, w, mesh=mesh, axis="fsdp", tensor_axis="model", config=Decomposition.baseline())
