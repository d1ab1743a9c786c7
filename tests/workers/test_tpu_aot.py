"""TPU without a TPU: programs compiled for TPU slices by XLA's real TPU compiler (libtpu), nothing run.

Every candidate family (an all-gather matmul, a matmul reduce-scatter, the weight gradient's ring, a fused
backward, and FSDP's: the weight gathered on either dimension and its gradient reduce-scattered) compiles for
v4, v5e and v5p topologies; the overlap verdict is read from the schedule both ways (a ring whose permutes hide
behind its products, one built so they cannot); discovery on a TPU compile lists what it lists on CPU devices,
and names what XLA's windowed einsum decomposes itself.  Marked ``tpu_aot``: skipped, saying what to install,
where libtpu is not installed (CI installs it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cmtune.workers.aot import CompileSession, compile_all
from cmtune.workers.measure import ring_mesh_of
from collective_matmul import Decomposition, Problem, allgather_matmul
from collective_matmul.planning.space import candidates
from collective_matmul.programs.discovery import discover
from collective_matmul.programs.schedule import overlap
from collective_matmul.programs.topology import TopologyError, compile_only, mesh_of, tpu_devices
from tests.cli import cmtune

pytestmark = pytest.mark.tpu_aot
TOPOLOGIES = ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1"]  # 8 devices (two per chip), 4, 4
D = Decomposition.from_id


@pytest.fixture(scope="module", params=TOPOLOGIES)
def devices(request):
    return tpu_devices(request.param)


def test_a_topology_gives_devices_that_only_compile_and_a_mesh_of_them(devices):
    assert compile_only(devices) and all(d.platform == "tpu" for d in devices)
    mesh = mesh_of(devices, (len(devices) // 4, 4), ("data", "model"))  # v4's two devices per chip too
    assert mesh.shape == {"data": len(devices) // 4, "model": 4}
    with pytest.raises(TopologyError, match="libtpu refused the topology 'v9x:2x2'"):
        tpu_devices("v9x:2x2")


FAMILIES = ["ag:512x256x512:bfloat16:4", "rs:512x256x512:bfloat16:4", "gw:512x256x512:bfloat16:4",
            # FSDP's: the weight gathered (sharded on k, on n) and its gradient reduce-scattered
            "wk:512x256x512:bfloat16:4", "wn:512x256x512:bfloat16:4", "rsw:512x256x512:bfloat16:4"]


@pytest.mark.parametrize("key", FAMILIES)
def test_every_family_compiles_with_its_memory_and_a_verdict(devices, key):
    """A sample of each family's space (both directions, chunked, a loop, each accumulation) compiles for the
    slice; each record carries its memory per device and its schedule's verdict (the slow tier compiles all)."""
    problem = Problem.parse(key)
    session = CompileSession(problem, ring_mesh_of(devices, 4))
    space = candidates(problem)
    sample = [space[0], *space[1::7], space[-1]]
    records = [session.compile(config) for config in sample]
    assert all(r.status == "compiled" and r.memory_bytes and r.compile_s for r in records), [
        (r.decomposition.id, r.message) for r in records]
    assert records[0].overlap == "no permutes"  # cmtune's baseline: a plain collective, then the product
    assert all(r.overlap in ("overlaps", "partly", "serialised") for r in records[1:])
    assert any(r.overlap in ("overlaps", "partly") for r in records[1:])  # some ring hides some transfer


@pytest.mark.slow
@pytest.mark.parametrize("key", FAMILIES)
def test_every_candidate_compiles_for_a_v5p_slice(key):
    problem = Problem.parse(key)
    for topology in ("v5p:2x2x1",):  # (the quick tier compiles a sample of each family on every topology)
        session = CompileSession(problem, ring_mesh_of(tpu_devices(topology), 4))
        failed = [(c.id, r.message) for c in candidates(problem) if (r := session.compile(c)).status != "compiled"]
        assert not failed, (topology, failed)


def test_a_fused_backward_compiles_and_its_rings_overlap(devices):
    """The backward of an all-gather matmul whose input-gradient and weight-gradient rings share one loop."""
    mesh = ring_mesh_of(devices, 4)
    x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("ring", None)))
    w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "ring")))
    def loss(x, w):
        y = allgather_matmul(x, w, mesh=mesh, axis="ring", config=D("ring-uni-c1-full-dus"),
                             grad_input=D("ring-uni-c1-full-f32"), grad_weight=D("ring-uni-c1-full-f32-fuse"))
        return jnp.sum(y.astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()
    verdict = overlap(compiled.as_text())
    assert verdict.windows and verdict.verdict in ("overlaps", "partly")
    assert compiled.memory_analysis().temp_size_in_bytes >= 0


def test_the_overlap_verdict_both_ways(devices):
    """cmtune's ring hides each permute behind a block's product; a ring whose every permute needs the product
    before it (a data dependence) is serialised, whatever the clock would say."""
    mesh = ring_mesh_of(devices, 4)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("ring", None)))
    w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "ring")))
    ring = jax.jit(lambda x, w: allgather_matmul(x, w, mesh=mesh, axis="ring", config=D("ring-bi-c2-full-dus")))
    assert overlap(ring.lower(x, w).compile().as_text()).verdict == "overlaps"

    def serial(x, w):
        pairs = [(i, (i + 1) % 4) for i in range(4)]

        def body(x, w):
            acc = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
            for _ in range(4):  # the next permute waits for this product: nothing can run while it is in flight
                x = jax.lax.ppermute(x + 0 * acc[:1, :1].astype(x.dtype), "ring", pairs)
                acc = acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
            return acc

        return jax.shard_map(body, mesh=mesh, in_specs=(P("ring", None), P(None, "ring")),
                             out_specs=P("ring", None))(x, w)

    verdict = overlap(jax.jit(serial).lower(x, w).compile().as_text())
    assert verdict.verdict == "serialised" and len(verdict.windows) == 4
    assert verdict.summary() == "0 of 4 permutes have a product scheduled while in flight"


def test_xlas_windowed_einsum_is_named_and_the_problem_still_listed():
    """On v4:2x2x1 XLA decomposes a large all-gather matmul itself: discovery compiles the step again with its
    windowed einsum off, lists the plain problem and says that XLA decomposes it; a small one XLA leaves alone."""
    mesh = mesh_of(tpu_devices("v4:2x2x1"), (8,), ("model",))
    found = {}
    for m, k, n in ((8192, 4096, 16384), (1024, 1024, 1024)):
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=NamedSharding(mesh, P("model", None)))
        w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model")))
        step = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P(None, "model")))
        found[m] = discover(step, (x, w), mesh)
    (big,) = found[8192].problems
    assert big.problem.key == "allgather_matmul:8192x4096x16384:bfloat16:8" and big.axis == "model"
    assert big.xla and "XLA's windowed einsum decomposes this" in big.xla
    (loop,) = found[8192].decomposed
    assert loop.problem == big.problem.key and "collective-permutes" in loop.what
    (small,) = found[1024].problems
    assert small.xla is None and not found[1024].decomposed


@pytest.mark.parametrize("spec, devices", [
    ("examples/flax_nnx_gpt.py:tiny_gpt_step", ("tpu:v5p:2x2x2", "virtual:8")),
    pytest.param("examples/flax_linen_llama.py:tiny_bf16_llama_step", ("tpu:v5p:2x2x2", "virtual:8"),
                 marks=pytest.mark.slow),  # a second model's two discoveries (12 s): in make test-slow
])
def test_a_users_step_lists_the_same_problems_on_a_tpu_topology_as_on_cpu_devices(spec, devices):
    """`cmtune problems --step` on a TPU slice compiled ahead of time (an NNX model; a linen model with nn.scan
    over remat layers, in bfloat16) lists the roles, slots, problems and counts of CPU devices of the same mesh."""
    import json

    listed = []
    for device_spec in devices:
        run = cmtune("problems", "--step", spec, "--devices", device_spec, "--json", timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        found = json.loads(run.stdout)
        listed.append(sorted((p["role"], p["slot"], p["problem"]["collective"], p["problem"]["m"], p["problem"]["k"],
                              p["problem"]["n"], p["problem"]["dtype"], p["count"]) for p in found["problems"]))
    assert listed[0] == listed[1] and listed[0]
    if "bf16" in spec:
        assert {entry[6] for entry in listed[0]} == {"bfloat16"}


def test_xlas_own_decomposition_is_a_candidate_compiled_with_its_windowed_einsum_on():
    """On TPU the space holds ``method="xla"`` (the product as written) after the baseline; compiled with the
    windowed einsum on, a large all-gather matmul becomes XLA's loop of permutes, and the same product with it off
    (the "as written, off" row) is one all-gather."""
    problem = Problem.parse("ag:8192x4096x16384:bfloat16:8")
    assert candidates(problem, platform="tpu")[:2] == [Decomposition.baseline(), Decomposition.xla()]
    assert Decomposition.xla() not in candidates(problem, platform="cpu")
    default, off, xla = compile_all(problem, ring_mesh_of(tpu_devices("v4:2x2x1"), 8), [Decomposition.xla()])
    assert xla.decomposition == Decomposition.xla() and xla.xla_options and xla.status == "compiled"
    assert xla.overlap in ("overlaps", "partly") and off.overlap == "no permutes"
    assert any(v is False for v in off.xla_options.values()) and not default.xla_options


def test_a_role_left_to_xla_says_which_compile_option_the_training_step_needs(tmp_path):
    """A config of ``xla`` runs the product as written; the report names the windowed-einsum option it was timed
    with, and the step compiled with those options is XLA's loop of permutes (without them, at this size on v5p,
    XLA's default threshold leaves it one all-gather)."""
    from collective_matmul import Bundle, Tuned
    from collective_matmul.client.tuned import ring_hardware
    from collective_matmul.planning.xla_options import windowed_einsum
    from collective_matmul.wire.bundle import TunedConfig

    mesh = mesh_of(tpu_devices("v5p:2x2x1"), (4,), ("model",))
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("model", None)))
    w = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model")))
    problem = Problem.parse("ag:2048x1024x2048:bfloat16:4")
    path = tmp_path / "bundle.json"
    Bundle(configs=[TunedConfig(problem=problem, hardware=ring_hardware(mesh, "model").identity(),
                                decomposition=Decomposition.xla(), time_s=1e-3, baseline_s=2e-3,
                                speedup=2.0)]).save(path)
    tuned = Tuned(bundle=path)
    step = jax.jit(lambda x, w: tuned.allgather_matmul(x, w, mesh=mesh, axis="model", role="mlp_up"))
    lowered = step.lower(x, w)
    report = tuned.report()
    assert report.compiler_options() == windowed_einsum("tpu", "on")
    assert "leave the product to XLA's windowed einsum (mlp_up)" in str(report)
    plain = lowered.compile().as_text()
    decomposed = lowered.compile(compiler_options=report.compiler_options()).as_text()
    assert "all-gather" in plain and "collective-permute" not in plain
    assert "collective-permute" in decomposed and " all-gather(" not in decomposed


def test_shared_gathers_compile_for_a_tpu_slice_in_the_memory_of_the_step_without_sharing():
    """The tiny Llama compiled for v5p:2x2x2 (data=2, model=4), every call on rings: sharing takes key's,
    value's and up's rings out of the backward (the groups' input gradients run in their first call's ring,
    piece by piece) and needs the bytes per device of the step without it."""
    import importlib

    from cmtune.workers.measure import compiled_memory
    from collective_matmul import OpConfigs, Tuned

    llama = importlib.import_module("examples.flax_linen_llama")
    slice_devices = tpu_devices("v5p:2x2x2")
    column = OpConfigs(forward=D("ring-bi-c1-full-dus"), grad_input=D("ring-uni-c1-full-in"))
    row = OpConfigs(forward=D("ring-uni-c1-full-in"), grad_input=D("ring-bi-c1-full-dus"))
    compiled = {}
    for share in (True, False):
        tuned = Tuned().variant("rings", lambda role, configs: row if role.endswith(("out", "down")) else column)
        tuned.share = share
        step, args, _ = llama.tiny_llama_step(tuned, devices=slice_devices)
        compiled[share] = step.lower(*args).compile()
        assert bool(tuned.report().groups) == share
    permutes = {share: c.as_text().count("collective-permute-start(") for share, c in compiled.items()}
    # sharing takes three rings of three permutes out of the backward; without it, XLA folds the identical first
    # permutes of query's, key's and up's rings into value's and gate's (the same block of the same x), but not
    # the steps after, each fenced in its own ring (`collective_matmul.ops.ring._Ring.fence`): two more each
    assert permutes[False] - permutes[True] == 3 * 3 + 3 * 2, permutes
    assert compiled_memory(compiled[True]) <= compiled_memory(compiled[False])
