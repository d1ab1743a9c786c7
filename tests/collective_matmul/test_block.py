"""The reference transformer block against a float64 single-device block, and `Tuned.configs`.

The reference takes the same global parameters and reads the column layout of the docstring
(device i's ``w_qkv`` block is ``[q_i | k_i | v_i]``, its gated ``w_up`` block ``[gate_i | up_i]``)
with plain reshapes; JAX's autodiff in float64 gives the gradients.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from collective_matmul import Bundle, Decomposition, OpConfigs, Problem, Tuned
from collective_matmul.block import (
    AS_WRITTEN,
    RMS_EPS,
    ROLES,
    FixedConfigs,
    activation_sharding,
    apply,
    configs_per_role,
    init_params,
    loss_and_grads,
    train_step,
)
from collective_matmul.client.tuned import ring_hardware
from collective_matmul.planning.models import MeshSpec, TransformerBlock, model_problems
from collective_matmul.wire.bundle import TunedConfig
from collective_matmul.wire.lookup import NOT_MEASURED

D = Decomposition.from_id
# the measurement protocol's bounds (relative error in norm); measured: float32 ~5e-7, bfloat16 ~8e-3
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}

MHA_GATED = TransformerBlock(name="mha", d_model=64, d_ff=128, heads=8, head_dim=8, gated_mlp=True, seq_len=64,
                             global_batch=2, dtype="float32")
GQA_PLAIN = TransformerBlock(name="gqa", d_model=64, d_ff=128, heads=16, head_dim=8, kv_heads=8, seq_len=64,
                             global_batch=2, dtype="float32")
GQA_2D = TransformerBlock(name="gqa2d", d_model=64, d_ff=128, heads=8, head_dim=8, kv_heads=4, gated_mlp=True,
                          seq_len=64, global_batch=4, dtype="float32")


def ops(fwd, gi, gw):
    return OpConfigs(forward=D(fwd), grad_input=D(gi), grad_weight=D(gw))


# rings everywhere: both directions, chunks, unroll, accumulate modes, backward rings, fuse on and off
RINGS = FixedConfigs({
    "qkv": ops("ring-bi-c2-full-dus", "ring-uni-c1-u1-in", "ring-bi-c1-full-in"),
    "attn_out": ops("ring-uni-c2-full-in", "baseline", "baseline-fuse"),
    "mlp_up": ops("ring-uni-c1-full-cat", "ring-bi-c2-full-in", "ring-uni-c2-full-in-fuse"),
    "mlp_down": ops("ring-bi-c1-full-in", "ring-uni-c2-full-dus", "ring-uni-c1-full-in-fuse"),
})
RINGS_BF16 = FixedConfigs({
    "qkv": ops("ring-uni-c2-u1-dus", "ring-bi-c1-full-f32", "ring-uni-c2-full-f32"),
    "attn_out": ops("ring-bi-c1-full-f32", "ring-uni-c2-full-cat", "ring-bi-c1-full-f32-fuse"),
    "mlp_up": ops("baseline", "ring-uni-c1-full-in", "baseline"),
    "mlp_down": ops("ring-uni-c1-full-in", "baseline", "baseline-fuse"),
})


def mesh_1d():
    return jax.make_mesh((8,), ("model",))  # Explicit axes


def mesh_2d():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def setup(block, mesh, batch_axis=None, dtype=None, seed=0):
    dtype = dtype or block.dtype
    params = init_params(jax.random.key(seed), block, mesh, axis="model", dtype=dtype)
    # non-trivial norm scales, so their gradients and their use are checked too
    rng = np.random.default_rng(seed)
    for name in ("attn_norm", "mlp_norm"):
        scale = 1 + 0.3 * rng.standard_normal(block.d_model)
        params[name] = jax.device_put(jnp.asarray(scale, dtype), params[name].sharding)
    shape = (block.global_batch, block.seq_len, block.d_model)
    sharding = activation_sharding(mesh, axis="model", batch_axis=batch_axis)
    x = jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype), sharding)
    target = jax.device_put(jnp.asarray(rng.standard_normal(shape), dtype), sharding)
    return params, x, target


def reference(block, size, params, x, target):
    """(output, loss, grads) of the block in float64 on one device."""
    heads, kv, hd = block.heads // size, (block.kv_heads or block.heads) // size, block.head_dim
    group = block.heads // (block.kv_heads or block.heads)

    def rms(v, scale):
        return v / jnp.sqrt(jnp.mean(v**2, axis=-1, keepdims=True) + RMS_EPS) * scale

    def forward(p, x):
        b, s, _ = x.shape
        qkv = (rms(x, p["attn_norm"]) @ p["w_qkv"]).reshape(b, s, size, (heads + 2 * kv) * hd)
        q = qkv[..., : heads * hd].reshape(b, s, size * heads, hd)
        k = qkv[..., heads * hd : (heads + kv) * hd].reshape(b, s, size * kv, hd)
        v = qkv[..., (heads + kv) * hd :].reshape(b, s, size * kv, hd)
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # query head j -> kv head j // group
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, -1)
        x = x + o @ p["w_o"]
        u = rms(x, p["mlp_norm"]) @ p["w_up"]
        if block.gated_mlp:
            u = u.reshape(b, s, size, 2, block.d_ff // size)
            a = (jax.nn.silu(u[..., 0, :]) * u[..., 1, :]).reshape(b, s, block.d_ff)
        else:
            a = jax.nn.gelu(u)
        return x + a @ p["w_down"]

    with jax.enable_x64(True):
        p64 = {name: jnp.asarray(np.asarray(value, np.float64)) for name, value in params.items()}
        x64, t64 = jnp.asarray(np.asarray(x, np.float64)), jnp.asarray(np.asarray(target, np.float64))

        def loss(p):
            y = forward(p, x64)
            return jnp.mean((y - t64) ** 2), y

        (value, y), grads = jax.value_and_grad(loss, has_aux=True)(p64)
        return np.asarray(y), float(value), {name: np.asarray(g) for name, g in grads.items()}


def rel_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def run_block(block, mesh, source, params, x, target, batch_axis=None):
    kwargs = dict(block=block, mesh=mesh, axis="model", source=source, batch_axis=batch_axis)

    def both(params, x, target):
        return apply(params, x, **kwargs), loss_and_grads(params, x, target, **kwargs)

    y, (value, grads) = jax.jit(both)(params, x, target)
    return y, value, grads


CASES = [
    # (block, mesh, batch_axis, dtype, source)
    ("mha-baseline", MHA_GATED, mesh_1d, None, "float32", FixedConfigs()),
    ("mha-as-written", MHA_GATED, mesh_1d, None, "float32", AS_WRITTEN),
    ("mha-rings", MHA_GATED, mesh_1d, None, "float32", RINGS),
    ("gqa-plain-rings", GQA_PLAIN, mesh_1d, None, "float32", RINGS),
    ("gqa-2d-rings", GQA_2D, mesh_2d, "data", "float32", RINGS),
    ("gqa-2d-as-written", GQA_2D, mesh_2d, "data", "float32", AS_WRITTEN),
    ("mha-bf16-rings", MHA_GATED, mesh_1d, None, "bfloat16", RINGS_BF16),
    ("gqa-2d-bf16-as-written", GQA_2D, mesh_2d, "data", "bfloat16", AS_WRITTEN),
]


@pytest.mark.parametrize("name, block, mesh_factory, batch_axis, dtype, source", CASES, ids=[c[0] for c in CASES])
def test_block_output_and_gradients_match_float64(name, block, mesh_factory, batch_axis, dtype, source):
    mesh = mesh_factory()
    params, x, target = setup(block, mesh, batch_axis, dtype)
    y, value, grads = run_block(block, mesh, source, params, x, target, batch_axis)
    want_y, want_loss, want_grads = reference(block, mesh.shape["model"], params, x, target)
    tol = TOLERANCE[dtype]
    assert y.dtype == jnp.dtype(dtype) and y.sharding.is_equivalent_to(x.sharding, 3)
    assert rel_error(y, want_y) <= tol
    assert abs(float(value) - want_loss) / want_loss <= tol
    assert set(grads) == set(want_grads)
    for param, grad in grads.items():
        assert grad.dtype == params[param].dtype and grad.shape == params[param].shape
        assert grad.sharding.is_equivalent_to(params[param].sharding, grad.ndim), param
        assert rel_error(grad, want_grads[param]) <= tol, f"{name}: d{param} {rel_error(grad, want_grads[param])}"


def test_train_step_updates_every_parameter_by_its_gradient():
    mesh = mesh_1d()
    params, x, target = setup(MHA_GATED, mesh)
    new, value = jax.jit(partial(train_step, block=MHA_GATED, mesh=mesh, axis="model", source=RINGS, lr=0.5))(
        params, x, target)
    _, want_loss, want_grads = reference(MHA_GATED, 8, params, x, target)
    assert abs(float(value) - want_loss) / want_loss <= 1e-5
    for name, grad in want_grads.items():
        assert new[name].sharding.is_equivalent_to(params[name].sharding, grad.ndim)
        step = (np.asarray(params[name], np.float64) - np.asarray(new[name], np.float64)) / 0.5
        assert rel_error(step, grad) <= 1e-3, name


@pytest.mark.parametrize("block, mesh_factory, message", [
    (MHA_GATED.model_copy(update={"heads": 12}), mesh_1d, "heads=12 is not divisible by the tensor axis size 8"),
    (GQA_2D.model_copy(update={"kv_heads": 2}), mesh_2d, "kv_heads=2 is not divisible by the tensor axis size 4"),
    (MHA_GATED.model_copy(update={"d_ff": 132}), mesh_1d, "d_ff=132 is not divisible"),
])
def test_a_block_that_does_not_shard_is_rejected(block, mesh_factory, message):
    with pytest.raises(ValueError, match=message):
        init_params(jax.random.key(0), block, mesh_factory(), axis="model")


@pytest.mark.parametrize("block, mesh_factory, shape, batch_axis, message", [
    (MHA_GATED, mesh_1d, (2, 60, 64), None, "seq_len=60 is not divisible by the tensor axis size 8"),
    (GQA_2D, mesh_2d, (3, 64, 64), "data", "batch 3 is not divisible by the 2 data-parallel shards"),
    (MHA_GATED, mesh_1d, (2, 64, 32), None, r"expected x \[batch, seq, d_model=64\]"),
    (MHA_GATED, mesh_1d, (2, 64, 64), "model", "batch_axis must differ from the tensor axis"),
])
def test_inputs_that_do_not_fit_are_rejected(block, mesh_factory, shape, batch_axis, message):
    mesh = mesh_factory()
    params = init_params(jax.random.key(0), block, mesh, axis="model")
    with pytest.raises(ValueError, match=message):
        apply(params, jnp.zeros(shape), block=block, mesh=mesh, axis="model", source=AS_WRITTEN, batch_axis=batch_axis)


def test_an_invalid_config_names_its_role():
    mesh = mesh_1d()
    params, x, _ = setup(MHA_GATED, mesh)
    bad = FixedConfigs({"mlp_down": ops("ring-uni-c1-full-in", "ring-uni-c1-full-f32", "baseline")})
    with pytest.raises(ValueError, match="mlp_down: grad_input: accumulate='float32'"):
        apply(params, x, block=MHA_GATED, mesh=mesh, axis="model", source=bad)
    with pytest.raises(ValueError, match="unknown roles"):
        FixedConfigs({"mlp": OpConfigs()})


# ---- Tuned.configs ---------------------------------------------------------------------------


def expected_problems(block, mesh_spec):
    """role.slot -> problem, from `model_problems` (the service's view of the same step)."""
    out = {}
    for mp in model_problems(block, mesh_spec):
        for role in mp.roles:
            name, _, slot = role.partition(".")
            out[(name, slot or "forward")] = mp.problem
    return out


@pytest.mark.parametrize("block, mesh_factory, batch_axis, spec", [
    (MHA_GATED, mesh_1d, None, "model=8"),
    (GQA_2D, mesh_2d, "data", "data=2,model=4"),
])
def test_tuned_configs_derive_the_three_problems_of_each_role(block, mesh_factory, batch_axis, spec):
    mesh = mesh_factory()
    tuned = Tuned()  # no server, no bundle: nothing measured, the baselines
    configs = configs_per_role(tuned, block, mesh=mesh, axis="model", batch_axis=batch_axis)
    assert set(configs) == set(ROLES)
    want = expected_problems(block, MeshSpec.parse(spec))
    by_role = tuned.resolved_by_role
    got = {(role, slot): problem for role, slots in by_role.items() for slot, (problem, _) in slots.items()}
    assert got == want
    assert len(tuned.resolved) == 12
    for role, slots in by_role.items():
        assert configs[role] == OpConfigs(**{slot: found.decomposition for slot, (_, found) in slots.items()})
        for problem, found in slots.values():
            assert (found.match, found.origin) == ("baseline", "baseline") and found.note.startswith(NOT_MEASURED)
            assert problem.accepts(found.decomposition)


def test_tuned_configs_use_the_bundle_then_fall_back_to_the_baseline(tmp_path):
    mesh = mesh_1d()
    ring = ring_hardware(mesh, "model")
    hw = ring.identity()
    tokens = MHA_GATED.global_batch * MHA_GATED.seq_len
    down = Problem(collective="matmul_reduce_scatter", m=tokens, k=128, n=64, dtype="float32", axis_size=8)
    down_gi = Problem(collective="allgather_matmul", m=tokens, k=64, n=128, dtype="float32", axis_size=8)
    up_gw = Problem(collective="allgather_grad_weight", m=tokens, k=64, n=256, dtype="float32", axis_size=8)
    entries = {down: D("ring-bi-c1-full-in"), down_gi: D("ring-uni-c2-full-dus"), up_gw: D("baseline")}
    bundle = Bundle(configs=[TunedConfig(problem=p, hardware=hw, decomposition=d, time_s=1.0, baseline_s=1.0,
                                         speedup=1.0, software=ring.software) for p, d in entries.items()])
    bundle.save(tmp_path / "b.json")
    tuned = Tuned(bundle=tmp_path / "b.json")
    configs = configs_per_role(tuned, MHA_GATED, mesh=mesh, axis="model")
    roles = tuned.resolved_by_role
    # exact entries; every other problem takes the nearest tuned shape of its collective
    assert configs["mlp_down"] == OpConfigs(forward=D("ring-bi-c1-full-in"), grad_input=D("ring-uni-c2-full-dus"))
    assert [roles["mlp_down"][slot][1].match for slot in ("forward", "grad_input", "grad_weight")] == [
        "exact", "exact", "nearest"]
    assert configs["mlp_up"] == OpConfigs(forward=D("ring-uni-c2-full-dus"), grad_input=D("ring-bi-c1-full-in"))
    # a baseline weight gradient runs fused (what autodiff does), wherever it came from
    up_gw = roles["mlp_up"]["grad_weight"][1]
    assert (up_gw.decomposition, up_gw.match, up_gw.origin) == (D("baseline-fuse"), "exact", "bundle")
    assert {found.origin for slots in roles.values() for _, found in slots.values()} == {"bundle"}
    # nothing tuned: the baselines
    bare = Tuned()
    assert configs_per_role(bare, MHA_GATED, mesh=mesh, axis="model") == {role: OpConfigs() for role in ROLES}
    assert {(found.match, found.origin) for _, found in bare.resolved} == {("baseline", "baseline")}
    # the block with the Tuned source equals the block as written
    params, x, target = setup(MHA_GATED, mesh)
    _, value, grads = run_block(MHA_GATED, mesh, tuned, params, x, target)
    _, want_value, want_grads = run_block(MHA_GATED, mesh, AS_WRITTEN, params, x, target)
    assert abs(float(value) - float(want_value)) <= 1e-6 * float(want_value)
    for name, grad in grads.items():
        assert rel_error(grad, want_grads[name]) <= 1e-5


def test_tuned_op_methods_pass_the_backward_configs(monkeypatch):
    import collective_matmul.client.calls as client

    seen = {}

    def spy(x, w, **kwargs):
        seen.update(kwargs)
        return x

    monkeypatch.setitem(client.OPS, "matmul_reduce_scatter", spy)
    tuned = Tuned()
    mesh = mesh_1d()
    x, w = jax.ShapeDtypeStruct((2, 64, 128), jnp.float32), jax.ShapeDtypeStruct((128, 64), jnp.float32)
    tuned.matmul_reduce_scatter(x, w, mesh=mesh, axis="model", role="mlp_down")
    configs = tuned.configs("mlp_down", "matmul_reduce_scatter", x, w, mesh=mesh, axis="model")
    assert (seen["config"], seen["grad_input"], seen["grad_weight"]) == (
        configs.forward, configs.grad_input, configs.grad_weight)
    assert set(tuned.resolved_by_role) == {"mlp_down"}


def test_a_role_override_of_the_model_comes_first_and_old_bundles_still_load(tmp_path):
    from collective_matmul.wire.bundle import RoleOverride

    mesh = mesh_1d()
    hw = ring_hardware(mesh, "model").identity()
    ring = OpConfigs(forward=D("ring-uni-c1-full-dus"), grad_input=D("ring-uni-c1-full-in"))
    bundle = Bundle(overrides=[RoleOverride(model="mha", role="mlp_up", hardware=hw, configs=ring,
                                            reason="measured", step_speedup=1.2)])
    bundle.save(tmp_path / "v2.json")
    tuned = Tuned(bundle=tmp_path / "v2.json", model="mha")
    configs = configs_per_role(tuned, MHA_GATED, mesh=mesh, axis="model")
    assert configs["mlp_up"] == ring and configs["mlp_down"] == OpConfigs()
    found = tuned.resolved_by_role["mlp_up"]["forward"][1]
    assert (found.match, found.origin) == ("override", "bundle")
    # another model, or no model: the override does not apply
    assert configs_per_role(Tuned(bundle=tmp_path / "v2.json", model="other"), MHA_GATED, mesh=mesh,
                            axis="model")["mlp_up"] != ring
    # a version-1 file (no overrides) still loads; saving it writes version 4
    old = tmp_path / "v1.json"
    old.write_text('{"format": "cmtune.bundle", "version": 1, "created_at": "2026-11-30T00:00:00+00:00", '
                   '"configs": []}')
    assert Bundle.load(old).overrides == []
    Bundle.load(old).save(old)
    assert '"version": 4' in old.read_text()


def test_an_override_no_call_matches_is_reported_not_dropped_silently(tmp_path):
    """A decision names a role the step no longer has (a source-line label moved when its file was edited):
    the report names the override it could not apply; the overrides that matched are not listed."""
    from collective_matmul.wire.bundle import RoleOverride

    mesh = mesh_1d()
    hw = ring_hardware(mesh, "model").identity()
    ring = OpConfigs(forward=D("ring-uni-c1-full-dus"), grad_input=D("ring-uni-c1-full-in"))
    bundle = Bundle(overrides=[RoleOverride(model="mha", role=role, hardware=hw, configs=ring, reason="measured",
                                            step_speedup=1.2) for role in ("mlp_up", "model.py:94")])
    bundle.save(tmp_path / "decided.json")
    tuned = Tuned(bundle=tmp_path / "decided.json", model="mha")
    configs_per_role(tuned, MHA_GATED, mesh=mesh, axis="model")
    report = tuned.report()
    assert report.unmatched == ["model.py:94"]
    assert "1 override(s) of model 'mha' matched no call site, not applied: model.py:94" in str(report)
    # a variant keeps its own record: what it traced decides what it reports
    variant = tuned.variant("baseline", lambda role, c: OpConfigs())
    assert variant.report().unmatched == [] and variant.report().unmatched_line() == ""
    configs_per_role(variant, MHA_GATED, mesh=mesh, axis="model")
    assert variant.report().unmatched == ["model.py:94"]
    # every override matched: nothing to say
    bundle.overrides.pop()
    bundle.save(tmp_path / "decided.json")
    matched = Tuned(bundle=tmp_path / "decided.json", model="mha")
    configs_per_role(matched, MHA_GATED, mesh=mesh, axis="model")
    assert matched.report().unmatched == [] and "override" not in str(matched.report()).splitlines()[-1]


def test_the_bundle_example_in_the_docs_loads(tmp_path):
    text = (Path(__file__).resolve().parents[2] / "docs" / "tuning.md").read_text()
    example = text[text.index("```json", text.index("## Bundle format")) + len("```json"):]
    (tmp_path / "example.json").write_text(example[: example.index("```")])
    bundle = Bundle.load(tmp_path / "example.json")
    assert bundle.version == 4 and len(bundle.configs) == 1
    assert (bundle.configs[0].overlap, bundle.configs[0].memory_bytes) == ("overlaps", 12713984)
    assert bundle.configs[0].software.jax == "0.10.2" and bundle.overrides[0].software.platform_version == "cpu"
    assert bundle.overrides[0].role == "mlp_down" and bundle.overrides[0].configs.forward.method == "baseline"


def test_a_served_override_that_does_not_fit_is_skipped_with_one_warning_and_the_step_runs(tmp_path):
    """Issue 18: a bundle (or server) override the call's problem rejects (a ring of 64 chunks on blocks of
    8 rows) must not raise inside the training step: it is skipped, warned about once and reported."""
    import warnings

    from collective_matmul.wire.bundle import RoleOverride

    mesh = mesh_1d()
    hw = ring_hardware(mesh, "model").identity()
    bad = OpConfigs(forward=Decomposition(direction="unidirectional", chunks=64, unroll="full"))
    Bundle(overrides=[RoleOverride(model="mha", role="qkv", hardware=hw, configs=bad, reason="forged",
                                   step_speedup=1000.0)]).save(tmp_path / "b.json")
    tuned = Tuned(bundle=tmp_path / "b.json", model="mha")
    params, x, target = setup(MHA_GATED, mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y, value, grads = run_block(MHA_GATED, mesh, tuned, params, x, target)
        run_block(MHA_GATED, mesh, tuned, params, x * 2, target)  # traced again: still one warning
    want_y, want_loss, _ = reference(MHA_GATED, 8, params, x, target)
    assert rel_error(y, want_y) <= TOLERANCE["float32"]
    skipped = [w for w in caught if "does not fit" in str(w.message)]
    assert len(skipped) == 1 and "qkv" in str(skipped[0].message) and "c64" in str(skipped[0].message)
    found = tuned.resolved_by_role["qkv"]["forward"][1]
    assert found.match == "baseline" and "override did not fit" in found.origin  # the look-up decided instead
    (site,) = [s for s in tuned.report().applied if s.role == "qkv"]
    assert any("skipped" in note for note in site.notes)
