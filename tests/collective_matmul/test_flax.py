"""The Flax drop-in against float64: linen and NNX, column and row projections with multi-dimensional
kernels, a data axis sharding the batch, layers under scan and remat, float32 and bfloat16; and every call
it cannot decompose reported with the reason."""

from __future__ import annotations

import logging
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul import Decomposition, OpConfigs, Tuned
from collective_matmul.client import flax as cm_flax

D = Decomposition.from_id
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
BATCH, SEQ, D_MODEL, HEADS, HEAD_DIM, D_FF, LAYERS = 4, 32, 32, 4, 8, 64, 2
# rings in every slot of both kinds (forward, input gradient, weight gradient fused and not)
COLUMN = OpConfigs(forward=D("ring-bi-c2-full-dus"), grad_input=D("ring-uni-c1-full-in"),
                   grad_weight=D("ring-uni-c1-full-in"))
ROW = OpConfigs(forward=D("ring-uni-c2-full-in"), grad_input=D("ring-bi-c1-full-dus"),
                grad_weight=D("ring-uni-c1-full-in-fuse"))


def rings(tuned: Tuned) -> Tuned:
    return tuned.variant("rings", lambda role, configs: COLUMN if role.endswith(("qkv", "up")) else ROW)


def mesh_2d():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def attention(qkv):
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HEAD_DIM)
    scores = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), scores, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def shard(mesh, y, *spec):
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(*spec)))


# ---- linen: DenseGeneral heads x head_dim kernels and Dense, nn.scan over nn.remat layers ---------------


class LinenBlock(nn.Module):
    mesh: object
    tuned: object = None

    @nn.compact
    def __call__(self, x, _):
        def layer(cls, kind, spec, **kwargs):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), spec)
            return cls(use_bias=False, kernel_init=init, dot_general=cm_flax.dot_general(
                self.tuned, mesh=self.mesh, kind=kind), **kwargs)

        mesh = self.mesh
        qkv = layer(nn.DenseGeneral, "column", (None, "model", None, None), features=(HEADS, 3, HEAD_DIM),
                    name="qkv")(x)
        o = shard(mesh, attention(shard(mesh, qkv, "data", None, "model", None, None)), "data", None, "model", None)
        x = x + shard(mesh, layer(nn.DenseGeneral, "row", ("model", None, None), features=D_MODEL, axis=(-2, -1),
                                  name="out")(o), "data", "model", None)
        h = shard(mesh, jax.nn.gelu(layer(nn.Dense, "column", (None, "model"), features=D_FF, name="up")(x)),
                  "data", None, "model")
        return x + shard(mesh, layer(nn.Dense, "row", ("model", None), features=D_MODEL, name="down")(h),
                         "data", "model", None), None


class LinenModel(nn.Module):
    mesh: object
    tuned: object = None

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(nn.remat(LinenBlock), variable_axes={"params": 0}, split_rngs={"params": True},
                        length=LAYERS, metadata_params={nn.PARTITION_NAME: None})
        x, _ = stack(self.mesh, self.tuned, name="layers")(x, None)
        return x


def linen_setup(mesh, dtype):
    model = LinenModel(mesh)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((BATCH, SEQ, D_MODEL)), dtype)
    x = jax.device_put(x, NamedSharding(mesh, P("data", "model", None)))
    x32 = x.astype(jnp.float32)  # initialised in float32, then cast (a scan's carry keeps its dtype)
    boxed = jax.eval_shape(model.init, jax.random.key(0), x32)
    specs = nn.get_partition_spec(boxed)
    params = jax.jit(lambda k: jax.tree.map(lambda a: a.astype(dtype), nn.unbox(model.init(k, x32))),
                     out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), specs))(jax.random.key(0))
    return params, x


def linen_loss_and_grads(mesh, tuned, params, x):
    model = LinenModel(mesh, tuned)
    return jax.jit(jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)))(params)


# ---- NNX: LinearGeneral and Linear, nnx.scan over nnx.remat layers built with nnx.vmap -----------------


class NnxBlock(nnx.Module):
    def __init__(self, mesh, tuned, dtype, *, rngs):
        def layer(cls, kind, role, spec, *args, **kwargs):  # NNX records no module path: roles given here
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), spec)
            return cls(*args, use_bias=False, kernel_init=init, param_dtype=dtype, rngs=rngs,
                       dot_general=cm_flax.dot_general(tuned, mesh=mesh, kind=kind, role=role), **kwargs)

        self.mesh = mesh
        self.qkv = layer(nnx.LinearGeneral, "column", "qkv", (None, "model", None, None), D_MODEL,
                         (HEADS, 3, HEAD_DIM))
        self.out = layer(nnx.LinearGeneral, "row", "out", ("model", None, None), (HEADS, HEAD_DIM), D_MODEL,
                         axis=(-2, -1))
        self.up = layer(nnx.Linear, "column", "up", (None, "model"), D_MODEL, D_FF)
        self.down = layer(nnx.Linear, "row", "down", ("model", None), D_FF, D_MODEL)

    def __call__(self, x):
        mesh = self.mesh
        o = shard(mesh, attention(shard(mesh, self.qkv(x), "data", None, "model", None, None)),
                  "data", None, "model", None)
        x = x + shard(mesh, self.out(o), "data", "model", None)
        h = shard(mesh, jax.nn.gelu(self.up(x)), "data", None, "model")
        return x + shard(mesh, self.down(h), "data", "model", None)


class NnxModel(nnx.Module):
    def __init__(self, mesh, tuned, dtype, *, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def create(rngs):
            return NnxBlock(mesh, tuned, dtype, rngs=rngs)

        self.layers = create(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def body(x, block):
            return block(x)

        return body(x, self.layers)


def nnx_build(mesh, tuned, dtype):
    with jax.set_mesh(mesh):
        return NnxModel(mesh, tuned, dtype, rngs=nnx.Rngs(0))


def nnx_loss_and_grads(mesh, tuned, state, x, dtype):
    graphdef, _ = nnx.split(nnx_build(mesh, tuned, dtype))
    return jax.jit(jax.value_and_grad(
        lambda s: jnp.mean(nnx.merge(graphdef, s)(x).astype(jnp.float32) ** 2)))(state)


# ---- the tests ------------------------------------------------------------------------------------------


def rel_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def to64(tree):
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)


def check(value, grads, want_value, want_grads, dtype):
    tolerance = TOLERANCE[dtype]
    assert abs(float(value) - want_value) <= tolerance * abs(want_value)
    errors = jax.tree.leaves(jax.tree.map(rel_error, grads, want_grads))
    assert errors and max(errors) <= tolerance, errors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linen_drop_in_gradients_match_float64(dtype):
    mesh = mesh_2d()
    params, x = linen_setup(mesh, jnp.dtype(dtype))
    tuned = rings(Tuned())
    value, grads = linen_loss_and_grads(mesh, tuned, params, x)
    with jax.enable_x64(True):
        want_value, want_grads = linen_loss_and_grads(mesh, None, to64(params), to64(x))
    check(value, grads, float(want_value), want_grads, dtype)
    sites = tuned.report()
    assert {s.role.rsplit("/", 1)[-1] for s in sites} == {"qkv", "out", "up", "down"} and not sites.fell_back
    assert {s.found["forward"].decomposition for s in sites} == {COLUMN.forward, ROW.forward}
    qkv = next(s for s in sites if s.role.endswith("qkv"))  # a heads x 3 x head_dim kernel, folded
    assert qkv.problems["forward"].key == f"allgather_matmul:64x{D_MODEL}x{HEADS * 3 * HEAD_DIM}:{dtype}:4"
    text = jax.jit(lambda p: linen_loss_and_grads(mesh, tuned, p, x)).lower(params).compile().as_text()
    assert "collective-permute" in text  # rings, not the baseline's collectives


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nnx_drop_in_gradients_match_float64(dtype):
    mesh = mesh_2d()
    _, state = nnx.split(nnx_build(mesh, None, jnp.dtype(dtype)))
    x = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((BATCH, SEQ, D_MODEL)), dtype),
                       NamedSharding(mesh, P("data", "model", None)))
    tuned = rings(Tuned())
    value, grads = nnx_loss_and_grads(mesh, tuned, state, x, jnp.dtype(dtype))
    with jax.enable_x64(True):
        want_value, want_grads = nnx_loss_and_grads(mesh, None, to64(state), to64(x), jnp.float64)
    check(value, grads, float(want_value), want_grads, dtype)
    sites = tuned.report()
    assert {s.role for s in sites} == {"qkv", "out", "up", "down"} and not sites.fell_back


def test_kernel_axes_decide_the_kind_maxtext_style():
    mesh = mesh_2d()
    tuned = Tuned()
    x = jax.ShapeDtypeStruct((BATCH, SEQ, D_MODEL), jnp.float32)
    up = cm_flax.dot_general(tuned, mesh=mesh, kernel_axes=("embed", "mlp"), role="up")
    down = cm_flax.dot_general(tuned, mesh=mesh, kernel_axes=("mlp", "embed"), role="down")
    plain = cm_flax.dot_general(tuned, mesh=mesh, kernel_axes=("embed", "embed"), role="replicated")
    def trace(dg, a, b):
        jax.eval_shape(lambda a, b: dg(a, b, (((2,), (0,)), ((), ()))), a, b)

    trace(up, x, jax.ShapeDtypeStruct((D_MODEL, D_FF), jnp.float32))
    trace(down, jax.ShapeDtypeStruct((BATCH, SEQ, D_FF), jnp.float32), jax.ShapeDtypeStruct((D_FF, D_MODEL),
                                                                                            jnp.float32))
    trace(plain, x, jax.ShapeDtypeStruct((D_MODEL, D_MODEL), jnp.float32))
    by_role = {s.role: s for s in tuned.report()}
    assert by_role["up"].collective == "allgather_matmul" and by_role["down"].collective == "matmul_reduce_scatter"
    assert not by_role["replicated"].applied and "not sharded over a ring" in by_role["replicated"].reason
    assert cm_flax.dot_general(None, mesh=mesh, kind="column") is lax.dot_general  # the step as written
    with pytest.raises(ValueError, match="kind"):
        cm_flax.dot_general(tuned, mesh=mesh)


# ---- FSDP: kernels sharded on their embed axis, the weight gathered (alone and under tensor parallelism) ----

FSDP_BATCH = 8
# rings in every slot of both weight-gathered collectives (the input gradient's is the other one's problem)
WEIGHT_K = OpConfigs(forward=D("ring-bi-c2-full-in"), grad_input=D("ring-uni-c1-u1-dus"),
                     grad_weight=D("ring-uni-c2-full-in"))
WEIGHT_N = OpConfigs(forward=D("ring-uni-c1-u1-dus"), grad_input=D("ring-bi-c2-full-in"),
                     grad_weight=D("ring-uni-c2-full-in-fuse"))


class FsdpMlp(nn.Module):
    """MaxText's MLP shape: ``wi`` (embed, mlp) and ``wo`` (mlp, embed), embed sharded over ``fsdp``."""

    mesh: object
    tuned: object = None

    @nn.compact
    def __call__(self, x):
        model = "model" if "model" in self.mesh.shape else None

        def dense(features, axes, name):
            spec = tuple("fsdp" if a == "embed" else model for a in axes)
            return nn.Dense(features, use_bias=False, name=name,
                            kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), spec),
                            dot_general=cm_flax.dot_general(self.tuned, mesh=self.mesh, axis=model, kernel_axes=axes,
                                                            fsdp_axis="fsdp"))

        batch = tuple(a for a in self.mesh.axis_names if a != "model")
        h = shard(self.mesh, jax.nn.gelu(dense(D_FF, ("embed", "mlp"), "wi")(x)), batch, None, model)
        return shard(self.mesh, dense(D_MODEL, ("mlp", "embed"), "wo")(h), batch, None, None)


@pytest.mark.parametrize("axes", [("data", "fsdp"), ("fsdp", "model")])
def test_fsdp_kernels_run_the_weight_rings_and_match_float64(axes):
    """kernel_axes with ``fsdp_axis``: ``wi`` (embed on its input rows) is a weight gathered on K, ``wo`` (on its
    output columns) one gathered on N; beside a data axis, and with the model axis sharding their other dimension
    (FSDP x tensor parallelism); loss and every gradient equal float64's of the layers as written."""
    mesh = jax.make_mesh((2, 4) if axes[0] == "data" else (4, 2), axes, axis_types=(AxisType.Auto,) * 2)
    batch = tuple(a for a in axes if a != "model")
    x = jax.device_put(jnp.asarray(np.random.default_rng(2).standard_normal((FSDP_BATCH, SEQ, D_MODEL)), jnp.float32),
                       NamedSharding(mesh, P(batch, None, None)))
    specs = nn.get_partition_spec(jax.eval_shape(FsdpMlp(mesh).init, jax.random.key(0), x))
    params = jax.jit(lambda k: nn.unbox(FsdpMlp(mesh).init(k, x)),
                     out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), specs))(jax.random.key(0))

    def loss_and_grads(tuned, params, x):
        return jax.jit(jax.value_and_grad(lambda p: jnp.mean(FsdpMlp(mesh, tuned).apply(p, x) ** 2)))(params)

    tuned = Tuned().variant("rings", lambda role, configs: WEIGHT_K if role.endswith("wi") else WEIGHT_N)
    value, grads = loss_and_grads(tuned, params, x)
    with jax.enable_x64(True):
        want_value, want_grads = loss_and_grads(None, to64(params), to64(x))
    check(value, grads, float(want_value), want_grads, "float32")
    sites = {s.role.rsplit("/", 1)[-1]: s for s in tuned.report()}
    assert set(sites) == {"wi", "wo"} and all(s.applied for s in sites.values()), tuned.report()
    tensor = mesh.shape.get("model", 1)
    rows = FSDP_BATCH * SEQ // (2 if "data" in axes else 1)  # a ring's rows: the data axis shards the batch
    keys = {name: site.problems["forward"].key for name, site in sites.items()}
    assert keys == {"wi": f"weight_allgather_matmul_k:{rows}x{D_MODEL}x{D_FF // tensor}:float32:4",
                    "wo": f"weight_allgather_matmul_n:{rows}x{D_FF // tensor}x{D_MODEL}:float32:4"}
    assert sites["wi"].problems["grad_weight"].collective == "reduce_scatter_grad_weight"
    assert "weight_allgather_matmul_k" in sites["wi"].line() and sites["wi"].axis == "fsdp"
    text = jax.jit(lambda p: loss_and_grads(tuned, p, x)).lower(params).compile().as_text()
    assert "collective-permute" in text


def test_fsdp_kinds_and_their_axes_are_checked():
    mesh = jax.make_mesh((4, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    tuned = Tuned()
    by_kind = cm_flax.dot_general(tuned, mesh=mesh, axis="fsdp", kind="fsdp", tensor_axis="model", role="up")
    x = jax.ShapeDtypeStruct((FSDP_BATCH, SEQ, D_MODEL), jnp.float32)
    jax.eval_shape(lambda a, b: by_kind(a, b, (((2,), (0,)), ((), ()))), x,
                   jax.ShapeDtypeStruct((D_MODEL, D_FF), jnp.float32))
    (site,) = tuned.report()
    assert site.collective == "weight_allgather_matmul_k" and site.problems["forward"].n == D_FF // 2
    with pytest.raises(ValueError, match="tensor_axis is the weight's other sharded axis"):
        cm_flax.dot_general(tuned, mesh=mesh, kind="column", tensor_axis="model")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        cm_flax.dot_general(tuned, mesh=mesh, kernel_axes=("embed", "mlp"), fsdp_axis="data")
    with pytest.raises(ValueError, match="axis=None runs FSDP kernels only"):
        cm_flax.dot_general(tuned, mesh=mesh, axis=None, kind="fsdp")
    with pytest.raises(ValueError, match="kind must be"):
        cm_flax.dot_general(tuned, mesh=mesh, kind="weights")
    with pytest.raises(ValueError, match="tensor_axis 'fsdp' is the ring's axis"):
        cm_flax.dot_general(tuned, mesh=mesh, axis="fsdp", kind="fsdp", tensor_axis="fsdp")
    with pytest.raises(ValueError, match="fsdp_axis 'model' is the tensor-parallel axis too"):
        cm_flax.dot_general(tuned, mesh=mesh, kernel_axes=("embed", "mlp"), fsdp_axis="model")
    with pytest.raises(ValueError, match="fsdp_axis decides an FSDP kernel from its kernel_axes"):
        cm_flax.dot_general(tuned, mesh=mesh, axis="fsdp", kind="fsdp", fsdp_axis="fsdp")


def test_a_batch_axis_given_for_every_layer_leaves_an_fsdp_calls_ring_out():
    """``batch_axis=("data", "fsdp")`` (the activation's rows, as a tensor-parallel layer takes them) with
    ``fsdp_axis``: an FSDP kernel's call shards its rows over data, then its ring, instead of running plain."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    tuned = Tuned()
    dense = cm_flax.dot_general(tuned, mesh=mesh, axis=None, kernel_axes=("embed", "mlp"), fsdp_axis="fsdp",
                                batch_axis=("data", "fsdp"), role="up")
    x = jax.ShapeDtypeStruct((FSDP_BATCH, SEQ, D_MODEL), jnp.float32)
    jax.eval_shape(lambda a, b: dense(a, b, (((2,), (0,)), ((), ()))), x,
                   jax.ShapeDtypeStruct((D_MODEL, D_FF), jnp.float32))
    report = tuned.report()
    assert not report.fell_back, report.fell_back
    (site,) = report.applied
    assert site.collective == "weight_allgather_matmul_k" and site.problems["forward"].m == FSDP_BATCH * SEQ // 2


def test_an_fsdp_kernel_without_a_tensor_name_takes_no_tensor_axis_as_its_batch():
    """A kernel ``("embed", None)`` on fsdp x model: a weight ring over fsdp of the whole product (no tensor axis),
    and the model axis, which shards nothing of it, is not taken as the input's batch axis."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    tuned = Tuned()
    dense = cm_flax.dot_general(tuned, mesh=mesh, kernel_axes=("embed", None), fsdp_axis="fsdp", role="up")
    x = jax.ShapeDtypeStruct((FSDP_BATCH, SEQ, D_MODEL), jnp.float32)
    jax.eval_shape(lambda a, b: dense(a, b, (((2,), (0,)), ((), ()))), x,
                   jax.ShapeDtypeStruct((D_MODEL, D_FF), jnp.float32))
    (site,) = tuned.report()
    forward = site.problems["forward"]
    assert site.collective == "weight_allgather_matmul_k" and (forward.k, forward.n) == (D_MODEL, D_FF)
    assert forward.m == FSDP_BATCH * SEQ and forward.axis_size == 4  # every row on the fsdp ring: no batch axis


def test_every_call_that_does_not_fit_runs_plain_and_is_reported(caplog):
    mesh = mesh_2d()
    tuned = Tuned()
    column = cm_flax.dot_general(tuned, mesh=mesh, kind="column")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, SEQ, D_MODEL)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((D_MODEL, D_FF)), jnp.float32)
    calls = {
        "batched": (jnp.ones((4, 8, 16)), jnp.ones((4, 16, 8)), (((2,), (1,)), ((0,), (0,))), {}),
        "transposed": (x, w.T, (((2,), (1,)), ((), ())), {}),
        "precise": (x, w, (((2,), (0,)), ((), ())), {"precision": lax.Precision.HIGHEST}),
        "accumulated": (x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), (((2,), (0,)), ((), ())),
                        {"preferred_element_type": jnp.float32}),
        "uneven": (jnp.ones((BATCH, 30, D_MODEL)), w, (((2,), (0,)), ((), ())), {}),
    }
    with caplog.at_level(logging.INFO, logger="collective_matmul"):
        for role, (a, b, dims, kwargs) in calls.items():
            dg = cm_flax.DotGeneral(tuned, mesh=mesh, kind="column", role=role)
            out = jax.jit(lambda a, b, dg=dg, dims=dims, kwargs=kwargs: dg(a, b, dims, **kwargs))(a, b)
            want = lax.dot_general(a, b, dims, **kwargs)
            np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), rtol=1e-5)
        applied = jax.jit(lambda a, b: column(a, b, (((2,), (0,)), ((), ()))))(x, w)
    np.testing.assert_allclose(np.asarray(applied), np.asarray(x @ w), rtol=1e-4, atol=1e-4)
    report = tuned.report()
    reasons = {s.role: s.reason for s in report.fell_back}
    assert set(reasons) == set(calls)
    assert "batch dimensions" in reasons["batched"] and "transposed kernel" in reasons["transposed"]
    assert "precision" in reasons["precise"] and "preferred_element_type" in reasons["accumulated"]
    assert "divisible" in reasons["uneven"]
    assert len(report.applied) == 1 and report.applied[0].site.startswith("test_flax.py:")
    assert "fell back to lax.dot_general" in str(report) and f"{len(calls)} fell back" in str(report)
    logged = [r.getMessage() for r in caplog.records if r.name == "collective_matmul"]
    assert len(logged) == len(calls) + 1  # one line per role, on its first trace
