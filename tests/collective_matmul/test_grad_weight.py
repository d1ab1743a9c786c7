"""The weight-gradient collective (all-gather on the contracting dimension): values, HLO, space."""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from collective_matmul.ops.collective import allgather_grad_weight, input_shardings, problem_of
from collective_matmul.planning.costmodel import PROFILES, estimate, rank
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Problem
from collective_matmul.planning.space import candidates
from tests.collective_matmul.test_ops import TOLERANCE, hlo_body, mesh_1d, mesh_2d, rel_error

GW = "allgather_grad_weight"


def gw_operands(lead_shape, m, a, b, dtype, seed=0):
    """u [..., M, A], v [..., M, B] and the float64 ``uᵀ v`` contracting M and the leading dims."""
    rng = np.random.default_rng(seed)
    u = jnp.asarray(rng.standard_normal((*lead_shape, m, a), dtype=np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((*lead_shape, m, b), dtype=np.float32), dtype)
    dims = tuple(range(len(lead_shape) + 1))
    expected = np.tensordot(np.asarray(u, np.float64), np.asarray(v, np.float64), axes=(dims, dims))
    return u, v, expected


def gw_place(mesh, u, v, batch_axis=None):
    su, sv = input_shardings(GW, mesh, "model", batch_dims=u.ndim - 2, batch_axis=batch_axis)
    return jax.device_put(u, su), jax.device_put(v, sv)


def gw_fn(mesh, config, batch_axis=None):
    return jax.jit(lambda u, v: allgather_grad_weight(u, v, mesh=mesh, axis="model", config=config,
                                                      batch_axis=batch_axis))


def lowered_collectives(text: str) -> Counter:
    """Collective ops of a lowered (StableHLO, before XLA's passes) module, by name."""
    ops = ("collective_permute", "all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    return Counter({op: len(re.findall(rf"stablehlo\.{op}\b", text)) for op in ops})


def test_whole_space_matches_float64_and_compiles_to_distinct_rings():
    """Every decomposition of a float32 gw problem is right, distinct, and a ring is only permutes."""
    mesh = mesh_1d()
    u, v, expected = gw_operands((), 64, 16, 32, "float32")
    u, v = gw_place(mesh, u, v)
    problem = problem_of(GW, u, v, mesh=mesh, axis="model")
    assert problem == Problem.parse("gw:64x16x32:float32:8")
    configs = candidates(problem)
    assert len(configs) == 25 and configs[0] == Decomposition.baseline()
    programs = set()
    for config in configs:
        compiled = gw_fn(mesh, config).lower(u, v).compile()
        out = compiled(u, v)
        assert out.shape == expected.shape and out.dtype == jnp.float32
        assert rel_error(out, expected) <= TOLERANCE["float32"], config.id
        hlo = hlo_body(compiled)
        if config.method == "baseline":
            assert "all-gather" in hlo and "collective-permute" not in hlo
        else:
            assert "collective-permute" in hlo, config.id
            for banned in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"):
                assert banned not in hlo, f"{config.id} still has {banned}"
        programs.add(hlo)
    assert len(programs) == len(configs)


def test_float32_accumulator_is_a_distinct_and_more_accurate_program_in_bfloat16():
    mesh = mesh_1d()
    u, v, expected = gw_operands((), 512, 32, 64, "bfloat16", seed=5)
    u, v = gw_place(mesh, u, v)
    programs, errors = set(), {}
    for accumulate in ("input_dtype", "float32"):
        compiled = gw_fn(mesh, Decomposition(chunks=4, accumulate=accumulate)).lower(u, v).compile()
        programs.add(hlo_body(compiled))
        out = compiled(u, v)
        assert out.dtype == jnp.bfloat16
        errors[accumulate] = rel_error(out, expected)
    assert len(programs) == 2
    assert errors["float32"] < errors["input_dtype"] <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize(
    "mesh_factory, lead, batch_axis, dtype, config_ids",
    [
        (mesh_1d, (2, 3), None, "float32", ["ring-bi-c4-u1-in", "ring-uni-c8-u2-in", "ring-uni-c2-full-in"]),
        (mesh_1d, (2,), None, "bfloat16", ["baseline", "ring-bi-c2-full-f32", "ring-uni-c4-u1-in"]),
        (mesh_2d, (4,), "data", "float32", ["baseline", "ring-bi-c4-full-in", "ring-uni-c2-u2-in"]),
        (mesh_2d, (4,), "data", "bfloat16", ["ring-uni-c1-u1-f32", "ring-bi-c8-full-in"]),
    ],
)
def test_batched_and_data_parallel_weight_gradients(mesh_factory, lead, batch_axis, dtype, config_ids):
    """Leading dims are contracted; with ``batch_axis`` the result is summed over it by ONE all-reduce."""
    mesh = mesh_factory()
    u, v, expected = gw_operands(lead, 32, 16, 24, dtype, seed=len(lead))
    u, v = gw_place(mesh, u, v, batch_axis)
    p = mesh.shape["model"]
    rows = int(np.prod(lead)) * 32 // (mesh.shape[batch_axis] if batch_axis else 1)
    assert problem_of(GW, u, v, mesh=mesh, axis="model", batch_axis=batch_axis) == Problem(
        collective=GW, m=rows, k=16, n=24, dtype=dtype, axis_size=p
    )
    for config_id in config_ids:
        fn = gw_fn(mesh, Decomposition.from_id(config_id), batch_axis)
        out = fn(u, v)
        assert out.shape == (16, 24)
        assert rel_error(out, expected) <= TOLERANCE[dtype], config_id
        ops = lowered_collectives(fn.lower(u, v).as_text())
        assert ops["all_reduce"] == (1 if batch_axis else 0), config_id
        assert ops["all_gather"] == (config_id == "baseline"), config_id


def test_unrolled_ring_issues_chunks_times_hops_permutes():
    mesh = mesh_1d()
    u, v, _ = gw_operands((), 64, 16, 32, "float32")
    u, v = gw_place(mesh, u, v)
    for config_id, permutes in [("ring-uni-c1-full-in", 7), ("ring-uni-c4-full-in", 28), ("ring-bi-c2-full-in", 14)]:
        text = gw_fn(mesh, Decomposition.from_id(config_id)).lower(u, v).as_text()
        assert lowered_collectives(text) == Counter(collective_permute=permutes), config_id


@pytest.mark.parametrize("config_id", ["ring-bi-c2-u1-in", "ring-uni-c4-full-in"])
def test_weight_gradient_op_is_differentiable(config_id):
    """AsWritten of ``uᵀ v``: d/du = v gᵀ, d/dv = u g, against float64."""
    mesh = mesh_1d()
    u, v, expected = gw_operands((2,), 32, 16, 24, "float32", seed=9)
    u, v = gw_place(mesh, u, v)
    g = np.random.default_rng(10).standard_normal(expected.shape)

    def loss(a, b):
        out = allgather_grad_weight(a, b, mesh=mesh, axis="model", config=Decomposition.from_id(config_id))
        return jnp.sum(out * jnp.asarray(g, jnp.float32))

    du, dv = jax.jit(jax.grad(loss, argnums=(0, 1)))(u, v)
    u64, v64 = np.asarray(u, np.float64), np.asarray(v, np.float64)
    assert rel_error(du, v64 @ g.T) < 1e-5
    assert rel_error(dv, u64 @ g) < 1e-5


@pytest.mark.parametrize(
    "u_shape, v_shape, kwargs, message",
    [
        ((60, 16), (60, 32), {}, "M=60 is not divisible by the size 8"),
        ((64, 16), (64, 30), {}, "B=30 is not divisible by the size 8"),
        ((64, 16), (32, 32), {}, "equal leading dims"),
        ((64, 16), (64, 32), {"config": Decomposition(accumulate="concat")},
         "'concat' is not for allgather_grad_weight"),
        ((64, 16), (64, 32), {"config": Decomposition(chunks=16)}, "chunks=16 does not divide a block of 8"),
    ],
)
def test_bad_shapes_and_configs_raise_value_error(u_shape, v_shape, kwargs, message):
    args = {"mesh": mesh_1d(), "axis": "model", "config": Decomposition()} | kwargs
    with pytest.raises(ValueError, match=message):
        allgather_grad_weight(jnp.ones(u_shape), jnp.ones(v_shape), **args)


def test_cost_model_covers_the_weight_gradient():
    big = Problem.parse("gw:262144x8192x10240:bfloat16:8")
    tpu = PROFILES["tpu-v4"]
    assert estimate(big, Decomposition(direction="bidirectional"), tpu) < estimate(big, Decomposition.baseline(), tpu)
    # the float32 accumulator only adds local memory traffic (the links carry u either way):
    # visible where nothing overlaps (CPU), hidden behind the transfers on a link-bound TPU step
    cpu = PROFILES["cpu"]
    f32, narrow = (Decomposition(chunks=2, accumulate=acc) for acc in ("float32", "input_dtype"))
    assert estimate(big, f32, cpu) > estimate(big, narrow, cpu)
    assert estimate(big, f32, tpu) >= estimate(big, narrow, tpu)
    small = Problem.parse("gw:64x16x32:float32:8")
    for name in ("cpu", "h100-nvlink"):
        assert all(estimate(small, c, PROFILES[name]) > 0 for c in candidates(small))
    assert sorted(map(str, rank(small, candidates(small), tpu))) == sorted(map(str, candidates(small)))
