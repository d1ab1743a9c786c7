"""The decomposed ops against the unsharded float64 product, their gradients, and their HLO."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from collective_matmul import Decomposition, Problem, allgather_matmul, matmul_reduce_scatter
from collective_matmul.ops.collective import input_shardings, problem_of
from collective_matmul.ops.ring import allgather_matmul_shard
from collective_matmul.ops.ring_schedule import RingSchedule
from collective_matmul.planning.space import candidates

OPS = {"allgather_matmul": allgather_matmul, "matmul_reduce_scatter": matmul_reduce_scatter}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def mesh_1d():
    return jax.make_mesh((8,), ("model",))  # Explicit axes (the JAX default)


def mesh_2d():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def operands(collective, x_shape, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    k = x_shape[-1]
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    return x, w, expected


def place(collective, mesh, x, w, batch_axis=None):
    sx, sw = input_shardings(collective, mesh, "model", batch_dims=x.ndim - 2, batch_axis=batch_axis)
    return jax.device_put(x, sx), jax.device_put(w, sw)


def compile_op(collective, mesh, config, x, w, batch_axis=None):
    op = OPS[collective]
    fn = jax.jit(lambda a, b: op(a, b, mesh=mesh, axis="model", config=config, batch_axis=batch_axis))
    return fn.lower(x, w).compile()


def rel_error(actual, expected):
    actual = np.asarray(actual, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def hlo_body(compiled) -> str:
    """Compiled HLO without names and source metadata, so equal programs give equal text."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    return re.sub(r"^HloModule \S+", "HloModule", text)


def assert_collectives(collective, config, hlo):
    if config.method == "baseline":
        assert ("all-gather" if collective == "allgather_matmul" else "reduce-scatter") in hlo
        assert "collective-permute" not in hlo
        return
    assert "collective-permute" in hlo, config.id
    for banned in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"):
        assert banned not in hlo, f"{config.id} still has {banned}"


SHAPES = {
    # name: (mesh factory, x shape per collective, n, batch axis)
    "flat": (mesh_1d, {"allgather_matmul": (64, 32), "matmul_reduce_scatter": (64, 64)}, 32, None),
    "batched": (mesh_1d, {"allgather_matmul": (2, 3, 32, 16), "matmul_reduce_scatter": (2, 3, 32, 64)}, 16, None),
    "mesh2d": (mesh_2d, {"allgather_matmul": (4, 32, 24), "matmul_reduce_scatter": (4, 32, 48)}, 24, "data"),
}


def space(collective, shape_name, dtype):
    mesh_factory, shapes, n, batch_axis = SHAPES[shape_name]
    x_shape = shapes[collective]
    p = 8 if mesh_factory is mesh_1d else 4
    rows = int(np.prod(x_shape[:-1])) // (2 if batch_axis else 1)
    k = x_shape[-1]
    problem = Problem(collective=collective, m=rows, k=k, n=n, dtype=dtype, axis_size=p)
    return problem, candidates(problem)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("collective", list(OPS))
@pytest.mark.parametrize("every", [pytest.param(4, id="a quarter"), pytest.param(1, id="all", marks=pytest.mark.slow)])
def test_every_candidate_matches_float64_product(collective, dtype, every):
    """Every valid decomposition (a quarter of them, every field value among them, in the quick tier), on the flat
    shape, equals the plain product; HLO is as designed, and each field value gives its own program."""
    mesh = mesh_1d()
    problem, space_ = space(collective, "flat", dtype)
    fields = ("method", "direction", "chunks", "unroll", "accumulate")
    seen, configs = set(), []
    for i, config in enumerate(space_):  # every field value at least once, then every ``every``-th
        values = {(f, getattr(config, f)) for f in fields}
        if i % every == 0 or not values <= seen:
            configs.append(config)
            seen |= values
    x, w, expected = operands(collective, SHAPES["flat"][1][collective], SHAPES["flat"][2], dtype)
    x, w = place(collective, mesh, x, w)
    programs = set()
    for config in configs:
        compiled = compile_op(collective, mesh, config, x, w)
        err = rel_error(compiled(x, w), expected)
        assert err <= TOLERANCE[dtype], f"{config.id}: relative error {err:.2e}"
        hlo = hlo_body(compiled)
        assert_collectives(collective, config, hlo)
        programs.add(hlo)
    assert problem_of(collective, x, w, mesh=mesh, axis="model") == problem
    # every field value gives a different compiled program
    assert len(programs) == len(configs)


@pytest.mark.parametrize("shape_name, offset", [("batched", 0), ("batched", 2), ("mesh2d", 1), ("mesh2d", 3)])
@pytest.mark.parametrize("collective", list(OPS))
def test_sampled_candidates_on_batched_and_2d_meshes(collective, shape_name, offset):
    mesh_factory, shapes, n, batch_axis = SHAPES[shape_name]
    mesh = mesh_factory()
    dtype = "bfloat16" if offset % 2 else "float32"
    problem, configs = space(collective, shape_name, dtype)
    x, w, expected = operands(collective, shapes[collective], n, dtype, seed=offset)
    x, w = place(collective, mesh, x, w, batch_axis)
    assert problem_of(collective, x, w, mesh=mesh, axis="model", batch_axis=batch_axis) == problem
    for config in [configs[0], *configs[1 + offset :: 4]]:
        compiled = compile_op(collective, mesh, config, x, w, batch_axis)
        out = compiled(x, w)
        assert out.shape == expected.shape
        assert rel_error(out, expected) <= TOLERANCE[dtype], config.id
        assert_collectives(collective, config, hlo_body(compiled))


GRAD_CONFIGS = {
    "allgather_matmul": [
        "ring-uni-c1-full-dus", "ring-bi-c2-u1-cat", "ring-uni-c4-u2-cat", "ring-bi-c8-full-dus",
        "ring-uni-c2-u1-dus", "ring-bi-c1-u2-dus", "ring-uni-c8-full-cat", "ring-bi-c4-u2-cat",
    ],
    "matmul_reduce_scatter": [
        "ring-uni-c1-full-in", "ring-bi-c2-u1-in", "ring-uni-c4-u2-in", "ring-bi-c8-full-in",
        "ring-uni-c8-u1-in", "ring-bi-c1-u2-in",
    ],
}


def grads(collective, mesh, config, x, w, cotangent, batch_axis=None):
    op = OPS[collective]

    def loss(a, b):
        out = op(a, b, mesh=mesh, axis="model", config=config, batch_axis=batch_axis)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("collective", list(OPS))
def test_gradients_equal_baseline_gradients(collective):
    """Every forward ring, with the default backward (which keeps the x a ring gathered), gives the
    baseline's gradients; `test_backward.py` covers the backward configs."""
    mesh = mesh_1d()
    _, shapes, n, _ = SHAPES["flat"]
    x, w, expected = operands(collective, shapes[collective], n, "float32", seed=7)
    x, w = place(collective, mesh, x, w)
    cotangent = jnp.asarray(np.random.default_rng(8).standard_normal(expected.shape), jnp.float32)
    want = grads(collective, mesh, Decomposition.baseline(), x, w, cotangent)
    # the baseline itself against the float64 closed form: dx = g w^T, dw = x^T g
    g = np.asarray(cotangent, np.float64)
    assert rel_error(want[0], g @ np.asarray(w, np.float64).T) < 1e-5
    assert rel_error(want[1], np.asarray(x, np.float64).T @ g) < 1e-5
    for config_id in GRAD_CONFIGS[collective]:
        got = grads(collective, mesh, Decomposition.from_id(config_id), x, w, cotangent)
        for name, a, b in zip("xw", got, want, strict=True):
            assert rel_error(a, np.asarray(b, np.float64)) < 1e-5, f"{config_id} d{name}"


@pytest.mark.parametrize(
    "collective, config_id",
    [("allgather_matmul", "ring-bi-c2-full-cat"), ("matmul_reduce_scatter", "ring-uni-c2-u1-f32")],
)
def test_gradients_on_2d_mesh_in_bfloat16(collective, config_id):
    mesh = mesh_2d()
    _, shapes, n, batch_axis = SHAPES["mesh2d"]
    x, w, expected = operands(collective, shapes[collective], n, "bfloat16", seed=3)
    x, w = place(collective, mesh, x, w, batch_axis)
    cotangent = jnp.asarray(np.random.default_rng(4).standard_normal(expected.shape), jnp.float32)
    want = grads(collective, mesh, Decomposition.baseline(), x, w, cotangent, batch_axis)
    got = grads(collective, mesh, Decomposition.from_id(config_id), x, w, cotangent, batch_axis)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == jnp.bfloat16
        assert rel_error(a, np.asarray(b, np.float64)) < 2e-2


def test_float32_accumulator_is_more_accurate_in_bfloat16():
    """accumulate='float32' carries the partial sums in float32: less rounding than bfloat16."""
    collective = "matmul_reduce_scatter"
    mesh = mesh_1d()
    x, w, expected = operands(collective, (64, 512), 64, "bfloat16", seed=11)
    x, w = place(collective, mesh, x, w)
    errors = {}
    for acc in ("input_dtype", "float32"):
        config = Decomposition(chunks=1, accumulate=acc)
        errors[acc] = rel_error(compile_op(collective, mesh, config, x, w)(x, w), expected)
    assert errors["float32"] < errors["input_dtype"]


def test_ring_has_the_expected_number_of_permutes():
    """Unrolled rings issue one permute per chunk per hop: P-1 hops one way, P/2 + (P-1)/2 both ways."""
    mesh = mesh_1d()
    x, w, _ = operands("allgather_matmul", (64, 32), 32, "float32")
    x, w = place("allgather_matmul", mesh, x, w)
    for config_id, permutes in [("ring-uni-c1-full-dus", 7), ("ring-uni-c2-full-dus", 14), ("ring-bi-c1-full-dus", 7)]:
        config = Decomposition.from_id(config_id)
        op = partial(allgather_matmul, mesh=mesh, axis="model", config=config)
        text = jax.jit(op).lower(x, w).as_text()
        assert text.count("collective_permute") == permutes, config_id


def test_per_shard_form_inside_users_shard_map():
    mesh = mesh_1d()
    x, w, expected = operands("allgather_matmul", (64, 32), 32, "float32")
    x, w = place("allgather_matmul", mesh, x, w)
    P = jax.sharding.PartitionSpec
    config = Decomposition(direction="bidirectional", chunks=2, unroll=1, accumulate="update_slice")

    @jax.jit
    def user_layer(a, b):
        def body(a_s, b_s):
            return jax.nn.relu(allgather_matmul_shard(a_s, b_s, axis="model", config=config))

        return jax.shard_map(body, mesh=mesh, in_specs=(P("model", None), P(None, "model")),
                             out_specs=P(None, "model"))(a, b)

    assert rel_error(user_layer(x, w), np.maximum(expected, 0)) < 1e-5


@pytest.mark.parametrize(
    "x_shape, w_shape, kwargs, message",
    [
        ((60, 32), (32, 64), {}, "M=60 is not divisible by the size 8"),
        ((64, 32), (16, 64), {}, "contraction mismatch"),
        ((64, 32), (32, 64), {"axis": "tensor"}, "axis 'tensor' is not an axis"),
        ((64,), (32, 64), {}, r"expected x \[..., M, K\]"),
        ((64, 32), (32, 64), {"config": Decomposition(chunks=16)}, "chunks=16 does not divide a block of 8"),
    ],
)
def test_bad_shapes_and_configs_raise_value_error(x_shape, w_shape, kwargs, message):
    mesh = mesh_1d()
    args = {"mesh": mesh, "axis": "model", "config": Decomposition()} | kwargs
    with pytest.raises(ValueError, match=message):
        allgather_matmul(jnp.ones(x_shape), jnp.ones(w_shape), **args)


@pytest.mark.parametrize("collective", list(OPS))
def test_the_product_left_to_xla_equals_float64_and_so_do_its_gradients(collective):
    """``method="xla"``: the product as written (no shard_map, no custom VJP); on CPU, which has no windowed
    einsum, GSPMD's collective and JAX's autodiff, equal to the closed forms."""
    mesh = mesh_1d()
    _, shapes, n, _ = SHAPES["flat"]
    x, w, expected = operands(collective, shapes[collective], n, "float32", seed=5)
    x, w = place(collective, mesh, x, w)
    out = jax.jit(lambda x, w: OPS[collective](x, w, mesh=mesh, axis="model", config=Decomposition.xla()))(x, w)
    assert rel_error(out, expected) < 1e-5 and out.sharding.spec == compile_op(
        collective, mesh, Decomposition.baseline(), x, w)(x, w).sharding.spec
    cotangent = jnp.asarray(np.random.default_rng(6).standard_normal(expected.shape), jnp.float32)
    got = grads(collective, mesh, Decomposition.xla(), x, w, cotangent)
    g = np.asarray(cotangent, np.float64)
    assert rel_error(got[0], g @ np.asarray(w, np.float64).T) < 1e-5
    assert rel_error(got[1], np.asarray(x, np.float64).T @ g) < 1e-5
    hlo = compile_op(collective, mesh, Decomposition.xla(), x, w).as_text()
    assert "collective-permute" not in hlo  # CPU: the plain collective


def test_the_product_left_to_xla_is_one_choice_for_the_whole_op():
    assert Decomposition.from_id("xla") == Decomposition.xla() and Decomposition.xla().id == "xla"
    with pytest.raises(ValueError, match="takes no ring fields"):
        Decomposition(method="xla", chunks=2)
    mesh = mesh_1d()
    _, shapes, n, _ = SHAPES["flat"]
    x, w, _ = operands("allgather_matmul", shapes["allgather_matmul"], n, "float32")
    x, w = place("allgather_matmul", mesh, x, w)
    ring = Decomposition.from_id("ring-uni-c1-full-in")
    with pytest.raises(ValueError, match="leaves the whole op to XLA, its backward too"):
        allgather_matmul(x, w, mesh=mesh, axis="model", config=Decomposition.xla(), grad_input=ring)
    with pytest.raises(ValueError, match="method='xla' is for the whole op"):
        allgather_matmul(x, w, mesh=mesh, axis="model", config=Decomposition.baseline(), grad_input=Decomposition.xla())


@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
@pytest.mark.parametrize("size", [3, 4, 5, 8])
def test_ring_schedule_brings_every_block_once_in_the_order_its_stream_goes(direction, size):
    schedule = RingSchedule.of(direction, size)
    arrivals = [a for step in range(schedule.steps) for a in schedule.arrivals(step)]
    for device in range(size):
        assert sorted((device + a.offset) % size for a in arrivals) == list(range(size))
    assert schedule.first == min(a.offset for a in arrivals)
    for j, stream in enumerate(schedule.streams):
        steps = [a.step for a in arrivals if a.stream == j and a.step > 0]
        assert steps == list(range(1, stream.hops + 1))
        assert all(a.offset == stream.sign * a.step for a in arrivals if a.stream == j)
        # a block used after step 0 was sent by the stream at the step before
        assert all(j in schedule.sends(step - 1) for step in steps)
        assert not any(j in schedule.sends(step) for step in range(stream.hops, schedule.steps))
    lower, upper = schedule.loop
    for step in range(lower, upper):  # one loop body serves these steps: every stream sends and uses its own block
        assert schedule.sends(step) == tuple(range(len(schedule.streams)))
        used = schedule.arrivals(step)
        assert [a.stream for a in used] == ([0] if step == 0 else list(range(len(schedule.streams))))
    expected = {"unidirectional": ((1, size - 1),), "bidirectional": ((1, size // 2), (-1, (size - 1) // 2))}
    assert tuple((s.sign, s.hops) for s in schedule.streams) == expected[direction]
