"""Discovery on real compiled steps: the reference block written in GSPMD style, linen, NNX and plain JAX.

Each step is lowered and compiled for 8 virtual CPU devices (never run); the problems found must be the
ones the layout implies, and the drop-in must label its calls as discovery labels the projections.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from collective_matmul import Tuned, discover
from collective_matmul.block import AS_WRITTEN, activation_sharding, apply, init_params
from collective_matmul.planning.models import MeshSpec, TransformerBlock, model_problems
from collective_matmul.programs.discovery.scanning import in_backward
from collective_matmul.programs.hlo import parse_module
from collective_matmul.programs.roles import agree, label, scopes, transforms

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
BLOCK = TransformerBlock(name="t", d_model=64, d_ff=128, heads=8, head_dim=8, seq_len=64, global_batch=4,
                         dtype="float32", layers=3)


def block_step(mesh, batch_axis):
    """The reference block written as a user would in GSPMD style, three layers in a scan, SGD."""
    params = init_params(jax.random.key(0), BLOCK, mesh, axis="model")
    stacked = jax.tree.map(lambda p: jnp.stack([p] * BLOCK.layers), params)
    stacked = jax.tree.map(lambda p, q: jax.device_put(p, NamedSharding(mesh, P(None, *q.sharding.spec))),
                           stacked, params)
    x = jax.ShapeDtypeStruct((BLOCK.global_batch, BLOCK.seq_len, BLOCK.d_model), jnp.float32,
                             sharding=activation_sharding(mesh, axis="model", batch_axis=batch_axis))
    layer = partial(apply, block=BLOCK, mesh=mesh, axis="model", source=AS_WRITTEN, batch_axis=batch_axis)

    def loss(params, x):
        y, _ = jax.lax.scan(lambda h, p: (layer(p, h), None), x, params)
        return jnp.mean(y**2)

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    return jax.jit(step), (stacked, x)


@pytest.mark.parametrize("shape, names, types, spec, batch_axis", [
    ((2, 4), ("data", "model"), AxisType.Auto, "data=2,model=4", "data"),
    ((8,), ("model",), AxisType.Explicit, "model=8", None),
])
def test_the_block_as_written_yields_the_problems_of_its_preset(shape, names, types, spec, batch_axis):
    mesh = jax.make_mesh(shape, names, axis_types=(types,) * len(names))
    step, args = block_step(mesh, batch_axis)
    found = discover(step, args, mesh)
    want = model_problems(BLOCK, MeshSpec.parse(spec))
    assert {p.problem.key for p in found.problems} == {mp.problem.key for mp in want}
    per_role = {(p.role, p.slot): (p.problem.key, p.count, p.axis) for p in found.problems}
    assert {role for role, _ in per_role} == {"qkv", "attn_out", "mlp_up", "mlp_down"}
    for mp in want:  # each role and slot of the preset, once per layer (the scan's trip count)
        for role_slot in mp.roles:
            role, _, slot = role_slot.partition(".")
            assert per_role[(role, slot or "forward")] == (mp.problem.key, BLOCK.layers, "model")
    assert not found.skipped and not found.warnings


def test_linen_roles_are_module_paths_and_the_drop_in_agrees():
    from tests.steps.linen_mlp import linen_step

    step, args, mesh = linen_step(None)
    found = discover(step, args, mesh)
    discovered = {p.role: p.problem.key for p in found.problems if p.slot == "forward"}
    assert discovered == {"Model/layer0/up": "allgather_matmul:128x64x128:float32:4",
                          "Model/layer0/down": "matmul_reduce_scatter:128x128x64:float32:4",
                          "Model/layer1/up": "allgather_matmul:128x64x128:float32:4",
                          "Model/layer1/down": "matmul_reduce_scatter:128x128x64:float32:4"}
    tuned = Tuned()
    tuned_step, tuned_args, _ = linen_step(tuned)
    tuned_step.lower(*tuned_args)
    sites = tuned.report()
    assert len(sites) == 4 and not sites.fell_back
    for site in sites:  # each call the drop-in ran is a discovered projection, with the same problem
        (match,) = [role for role in discovered if agree(site.role, role)]
        assert discovered[match] == site.problems["forward"].key


@pytest.mark.slow  # an NNX model discovered and traced through the drop-in (5 s)
def test_nnx_roles_are_source_locations_and_the_drop_in_agrees():
    import flax_nnx_gpt

    step, args, mesh = flax_nnx_gpt.tiny_gpt_step(None)
    found = discover(step, args, mesh)
    forward = {p.role: p.problem.key for p in found.problems if p.slot == "forward"}
    assert len(forward) == 4 and all(role.startswith("flax_nnx_gpt.py:") for role in forward)
    assert {p.count for p in found.problems} == {flax_nnx_gpt.TINY.layers}  # one call site, every layer
    assert {p.slot for p in found.problems} == {"forward", "grad_input", "grad_weight"}
    tuned = Tuned()
    tuned_step, tuned_args, _ = flax_nnx_gpt.tiny_gpt_step(tuned)
    tuned_step.lower(*tuned_args)
    assert {s.role: s.problems["forward"].key for s in tuned.report()} == forward


@pytest.mark.parametrize("name", ["mlp_step", "explicit_mlp_step", "abstract_mlp_step"])
def test_plain_jax_under_named_scopes_on_either_axis_type_and_from_abstract_arguments(name):
    from tests.steps import gspmd_mlp

    step, args, mesh = getattr(gspmd_mlp, name)(None)
    found = discover(step, args, mesh)
    assert {(p.role, p.slot, p.problem.key) for p in found.problems} == {
        ("mlp_up", "forward", "allgather_matmul:128x64x128:float32:4"),
        ("mlp_up", "grad_weight", "allgather_grad_weight:128x64x128:float32:4"),  # x is not differentiated
        ("mlp_down", "forward", "matmul_reduce_scatter:128x128x64:float32:4"),
        ("mlp_down", "grad_input", "allgather_matmul:128x64x128:float32:4"),
        ("mlp_down", "grad_weight", "allgather_grad_weight:128x64x128:float32:4"),
    }


def test_a_small_weight_gathered_by_xla_is_a_weight_ring_problem():
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    x = jax.ShapeDtypeStruct((2, 64, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "model", None)))
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))

    def step(x, w):  # the output wanted on the rows: XLA gathers the small weight, not the activation
        with jax.named_scope("proj"):
            return jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P(None, "model", None)))

    found = discover(step, (x, w), mesh)
    (problem,) = found.problems  # each device keeps its rows; the weight's shards travel (no backward here)
    assert (problem.role, problem.slot, problem.problem.key) == (
        "proj", "forward", "weight_allgather_matmul_n:128x32x16:float32:8") and not found.skipped


def test_an_fsdp_out_projection_over_heads_and_head_dim_is_a_weight_ring_problem():
    """An attention output projection under FSDP (MaxText's ``out``: kernel [heads, head_dim, embed], embed over
    fsdp): the product contracts the activation's last two dimensions, folded to one K."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    o = jax.ShapeDtypeStruct((16, 32, 4, 16), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None, None, None)))
    w = jax.ShapeDtypeStruct((4, 16, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, None, "fsdp")))

    def step(o, w):
        with jax.named_scope("out"):
            y = jnp.einsum("bshd,hde->bse", o, w)
            return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("fsdp", None, None)))

    found = discover(step, (o, w), mesh)
    assert [(p.role, p.slot, p.problem.key) for p in found.problems] == [
        ("out", "forward", "weight_allgather_matmul_n:512x64x64:float32:8")] and not found.skipped


@pytest.mark.parametrize("features", ["model", None])
def test_a_weight_gathered_beside_an_activation_gathered_on_its_features_is_the_weights_ring(features):
    """FSDP x tensor parallelism's column layer as MaxText shards it: the weight [K, N] on K over fsdp and on N over
    model, the activation's rows over fsdp and (``features``) its K over model.  XLA gathers the activation's K over
    model as well as the weight: the weight's ring over fsdp of one model shard's product is the problem, the
    activation's gather XLA's; without it the same problem."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", features)))
    w = jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", "model")))

    def step(x, w):
        with jax.named_scope("up"):
            return jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("fsdp", "model")))

    found = discover(step, (x, w), mesh)
    assert [(p.role, p.slot, p.problem.key, p.axis) for p in found.problems] == [
        ("up", "forward", "weight_allgather_matmul_k:64x128x128:float32:4", "fsdp")], found.skipped
    assert not found.skipped


def test_the_labelling_rule():
    assert scopes("jit(step)/transpose(jvp(Model))/jvp(Model)/checkpoint/rematted_computation/layers/up") == [
        "Model", "layers", "up"]
    assert scopes("jit(step)/jvp(mlp_up)/bsd,df->bsf") == ["mlp_up"]
    assert scopes("jit(step)/jvp()/while/body/closed_call/jit(helper)/attn/qkv") == ["attn", "qkv"]
    assert label("", [("/site-packages/flax/nnx/nn/linear.py", 287), ("/work/model.py", 42)]) == "model.py:42"
    assert label("", []) == "unlabelled"
    assert len(label("a" * 500)) == 200
    assert agree("layers/up", "Model/layers/up") and not agree("ayers/up", "Model/layers/up")
    assert not agree("model.py:42", "other.py:42")



def test_a_product_is_in_the_backward_when_its_name_stack_runs_under_transpose():
    """The name stack's transforms say it, not a name that merely holds the word; unbalanced text falls back."""
    assert transforms("jit(step)/transpose(jvp(Model))/jvp(Model)/layers/up") == ["jit", "transpose", "jvp", "jvp"]
    assert transforms("jit(transpose)/layers/up") == ["jit"] and transforms("a(b/c") is None

    def dot(op_name: str):
        text = ("HloModule m\n\nENTRY %main (a: f32[2,2], b: f32[2,2]) -> f32[2,2] {\n"
                "  %a = f32[2,2]{1,0} parameter(0)\n  %b = f32[2,2]{1,0} parameter(1)\n"
                "  ROOT %d = f32[2,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, "
                f'metadata={{op_name="{op_name}"}}\n}}\n')
        return parse_module(text).entry.instructions["d"]

    assert in_backward(dot("jit(step)/transpose(jvp(Model))/layers/up/dot_general"))
    assert not in_backward(dot("jit(step)/jvp(Model)/layers/up/dot_general"))
    assert not in_backward(dot("jit(transpose)/layers/up/dot_general"))
    assert in_backward(dot("jit(step)/transpose(jvp(Model)/layers/up/dot_general"))  # unbalanced: the text test

PAST_THE_CACHE = """
import os, tempfile
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from collective_matmul.programs.discovery import partitioned_module

cache = tempfile.mkdtemp()
for name, value in (("jax_compilation_cache_dir", cache), ("jax_persistent_cache_min_compile_time_secs", 0),
                    ("jax_persistent_cache_min_entry_size_bytes", 0)):
    jax.config.update(name, value)
mesh = Mesh(np.array(jax.devices()), ("x",))
args = (jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x", None))),
        jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "x"))))

def dumped(fn):
    directory = tempfile.mkdtemp()
    jax.jit(fn).lower(*args).compile(compiler_options={"xla_dump_to": directory,
                                                       "xla_dump_hlo_pass_re": "spmd-partitioning"})
    return any("spmd-partitioning" in f for f in os.listdir(directory))

step = lambda a, b: jnp.tanh(a @ b).sum()
other = lambda a, b: jnp.sin(a @ b).sum()
print(dumped(step), len(os.listdir(cache)), dumped(step))  # the second compile is served from the cache
text, note = partitioned_module(step, args)
print("all-gather" in text, note, len(os.listdir(cache)))
text, note = partitioned_module(other, args)
print("all-gather" in text, note, len(os.listdir(cache)))  # compiled, not written
print(jax.config.jax_enable_compilation_cache, dumped(step))  # the user's cache is back
"""


def test_discovery_compiles_past_the_persistent_cache():
    """A compile served from JAX's persistent cache writes no partitioned module: discovery compiles past the cache
    (neither read nor written) after the process's first compile turned it on, and leaves it on.  Through JAX's
    public API: this fails where JAX moves it."""
    import os
    import subprocess

    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", PAST_THE_CACHE], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["True 1 False", "True None 1", "True None 1", "True False"]
