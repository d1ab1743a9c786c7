"""GPU without a GPU: programs compiled for NVIDIA nodes by XLA's real GPU compiler (JAX's CUDA plugin), nothing run.

The cards' target configs come from the installed plugin (the XLA revision of the jaxlib in use) or from a card
file written from devices; every candidate family compiles for H100 and B200 nodes with its memory and its
schedule's verdict, read both ways (the rolled ring XLA keeps overlapped, the unrolled one it makes synchronous);
discovery on a GPU compile lists what it lists on CPU devices.  Marked ``gpu_aot``: skipped, saying what to
install, where the plugin is not installed (CI installs it).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cmtune.workers.aot import CompileSession, compile_all
from cmtune.workers.cluster import DeviceSpec
from cmtune.workers.measure import ring_mesh_of
from collective_matmul import Decomposition, Problem, allgather_matmul
from collective_matmul.planning.space import candidates
from collective_matmul.programs import gpus
from collective_matmul.programs.schedule import overlap
from collective_matmul.programs.topology import compile_only
from tests.cli import cmtune

pytestmark = pytest.mark.gpu_aot
CARDS = ["h100", "b200"]
D = Decomposition.from_id
FAMILIES = ["ag:1024x512x1024:bfloat16:4", "rs:1024x512x1024:bfloat16:4", "gw:1024x512x1024:bfloat16:4",
            # FSDP's: the weight gathered (sharded on k, on n) and its gradient reduce-scattered
            "wk:1024x512x1024:bfloat16:4", "wn:1024x512x1024:bfloat16:4", "rsw:1024x512x1024:bfloat16:4"]


@pytest.fixture(scope="module", params=CARDS)
def devices(request):
    return gpus.gpu_devices(request.param, 1, 4)


def test_a_card_gives_devices_that_only_compile_numbered_host_by_host():
    devices = gpus.gpu_devices("h100", 2, 4)
    assert len(devices) == 8 and compile_only(devices) and {d.platform for d in devices} == {"gpu"}
    assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"}
    assert [d.process_index for d in devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert gpus.is_deviceless_gpu(devices) and not gpus.is_deviceless_gpu(jax.devices())
    assert DeviceSpec.parse("gpu:h100:2x4").compiled_devices()[7].device_kind == "NVIDIA H100 80GB HBM3"


def test_the_plugin_has_a_config_for_every_card_cmtune_names():
    kinds = gpus.embedded_kinds()
    assert {card.device_kind for card in gpus.CARDS.values()} <= set(kinds)
    assert 'device_description_str: "NVIDIA B200"' in gpus.target_config("b200")
    with pytest.raises(gpus.GpuError, match="no GPU card 'h900'.*cmtune gpu-card save"):
        gpus.gpu_devices("h900")


def test_a_card_file_written_from_devices_compiles_for_any_node_shape(tmp_path, monkeypatch):
    """`save_card` writes the topology XLA serializes for the devices (here a deviceless node's, on a GPU host
    this host's GPUs); read back for another node shape, it gives that many devices of the same card."""
    monkeypatch.setenv(gpus.ENV_CARD_DIR, str(tmp_path))
    path = gpus.save_card("my-h200", gpus.gpu_devices("h200", 1, 8))
    assert path == tmp_path / "my-h200.topology" and path.stat().st_size > 100
    devices = gpus.gpu_devices("my-h200", 2, 2)
    assert len(devices) == 4 and {d.device_kind for d in devices} == {"NVIDIA H200 141GB HBM3e"}
    assert [d.process_index for d in devices] == [0, 0, 1, 1]
    mesh = ring_mesh_of(devices, 4)
    assert CompileSession(Problem.parse("ag:512x256x512:bfloat16:4"), mesh).compile(D("ring-uni-c1-u1-dus")).status \
        == "compiled"
    with pytest.raises(gpus.GpuError, match="lower-case letters"):
        gpus.save_card("../evil", devices)
    with pytest.raises(gpus.GpuError, match="written from GPU devices; these are cpu"):
        gpus.save_card("cpu-card", jax.devices())


def test_a_deviceless_compile_uses_cublas_unless_autotuning_results_are_given(monkeypatch):
    devices = gpus.gpu_devices("h100", 1, 2)
    monkeypatch.setenv("XLA_FLAGS", "")
    options = gpus.deviceless_options(devices)
    assert options["xla_gpu_enable_triton_gemm"] is False and options["xla_gpu_multi_streamed_windowed_einsum"] is False
    assert options["xla_gpu_enable_latency_hiding_scheduler"] is True  # as a GPU worker runs
    assert "cuBLAS" in gpus.deviceless_note(options)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_load_autotune_results_from=/results.textproto "
                                    "--xla_gpu_enable_latency_hiding_scheduler=false")
    options = gpus.deviceless_options(devices)
    assert "xla_gpu_enable_triton_gemm" not in options and "xla_gpu_enable_latency_hiding_scheduler" not in options
    assert gpus.deviceless_options(jax.devices()) == {}


@pytest.mark.parametrize("key", FAMILIES)
def test_every_family_compiles_with_its_memory_and_a_verdict(devices, key):
    """A sample of each family's space compiles for the node, each with its memory per device and a verdict; the
    unidirectional ring overlaps rolled and unrolled (every step's product beside the next step's permute)."""
    problem = Problem.parse(key)
    session = CompileSession(problem, ring_mesh_of(devices, 4))
    space = candidates(problem, platform="gpu")
    sample = [space[0], *space[1::9], space[-1]]
    records = [session.compile(config) for config in sample]
    assert all(r.status == "compiled" and r.memory_bytes and r.compile_s for r in records), [
        (r.decomposition.id, r.message) for r in records]
    assert records[0].overlap == "no permutes"  # cmtune's baseline: a plain collective, then the product
    accumulate = "dus" if problem.dual.collective == "allgather_matmul" else "f32"
    for unroll in ("u1", "full"):
        ring = session.compile(D(f"ring-uni-c2-{unroll}-{accumulate}"))
        assert ring.overlap == "overlaps", (unroll, ring.overlap_note)


def test_the_verdict_both_ways_and_the_fence_that_keeps_a_rings_products_apart(devices):
    """The same unrolled ring written plainly and with each step fenced (`collective_matmul.ops.ring._Ring.fence`):
    plain, XLA's GPU pipeline merges its products (one cuBLAS call of the concatenated blocks) and runs every
    permute synchronously; fenced, one GEMM per step and every permute beside a product.  A ring whose every
    permute needs the product before it (a data dependence) is serialised."""
    mesh = ring_mesh_of(devices, 4)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("ring", None)))
    w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "ring")))
    pairs = [(i, (i + 1) % 4) for i in range(4)]

    def ring(fenced: bool = False, serial: bool = False):
        def body(x, w):
            outs, block = [], x
            for step in range(4):
                if serial:  # each permute needs the product before it, each product the block it brings
                    block = jax.lax.ppermute(block + outs[-1][:, :1].astype(block.dtype) if outs else block, "ring",
                                             pairs)
                    outs.append(jnp.dot(block, w))
                    continue
                following = jax.lax.ppermute(block, "ring", pairs) if step < 3 else None
                product = jnp.dot(block, w)
                if fenced and following is not None:
                    following, product = jax.lax.optimization_barrier((following, product))
                outs.append(product)
                block = following
            return jnp.concatenate(outs, 0)

        step = jax.shard_map(body, mesh=mesh, in_specs=(P("ring", None), P(None, "ring")), out_specs=P(None, "ring"))
        return jax.jit(step).lower(x, w).compile(gpus.deviceless_options(devices)).as_text()

    plain, fenced = ring(), ring(fenced=True)
    assert overlap(plain).verdict == "synchronous" and plain.count('custom_call_target="__cublas') == 1
    assert overlap(fenced).verdict == "overlaps" and fenced.count('custom_call_target="__cublas') == 4
    assert overlap(fenced).summary() == "3 of 3 permutes have a product scheduled while in flight"
    assert overlap(ring(serial=True)).verdict in ("serialised", "synchronous")


@pytest.mark.slow
@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("key", FAMILIES)
def test_every_candidate_of_every_family_compiles_for_h100_and_b200(card, key):
    problem = Problem.parse(key)
    session = CompileSession(problem, ring_mesh_of(gpus.gpu_devices(card, 1, 4), 4))
    records = [session.compile(c) for c in candidates(problem, platform="gpu")]
    assert not [(r.decomposition.id, r.message) for r in records if r.status != "compiled"]
    assert any(r.overlap == "overlaps" for r in records)


def test_a_fused_backward_compiles_for_a_gpu_node_and_overlaps(devices):
    """The backward of an all-gather matmul whose input-gradient and weight-gradient rings share one loop: rolled
    or unrolled, unidirectional, every permute of the program has a product beside it; bidirectional, partly."""
    mesh = ring_mesh_of(devices, 4)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("ring", None)))
    w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "ring")))

    def compiled(ring: str):
        def loss(x, w):
            y = allgather_matmul(x, w, mesh=mesh, axis="ring", config=D(f"{ring}-dus"), grad_input=D(f"{ring}-f32"),
                                 grad_weight=D(f"{ring}-f32-fuse"))
            return jnp.sum(y.astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile(gpus.deviceless_options(devices))

    for ring in ("ring-uni-c1-u1", "ring-uni-c1-full"):
        program = compiled(ring)
        assert overlap(program.as_text()).verdict == "overlaps", ring
        assert program.memory_analysis().temp_size_in_bytes > 0
    assert overlap(compiled("ring-bi-c1-full").as_text()).verdict == "partly"


def test_xlas_windowed_einsum_compiles_for_a_gpu_node_as_a_candidate():
    """On GPU the space holds ``method="xla"``; with the windowed einsum on (on one stream: see `gpus.DEVICELESS`)
    a large all-gather matmul becomes XLA's loop of permutes, and with it off it stays one all-gather."""
    problem = Problem.parse("ag:8192x4096x16384:bfloat16:8")
    assert Decomposition.xla() in candidates(problem, platform="gpu")
    default, off, xla = compile_all(problem, ring_mesh_of(gpus.gpu_devices("h100", 1, 8), 8), [Decomposition.xla()])
    assert xla.status == "compiled", xla.message
    assert xla.xla_options["xla_gpu_threshold_for_windowed_einsum_mib"] == 0
    assert xla.xla_options["xla_gpu_multi_streamed_windowed_einsum"] is False
    assert xla.overlap in ("overlaps", "partly", "synchronous", "serialised") and off.overlap == "no permutes"
    assert default.overlap == "no permutes"  # XLA's default threshold leaves the product alone


def test_bench_compile_only_on_a_gpu_node_says_what_it_set():
    run = cmtune("bench", "--compile-only", "--devices", "gpu:h100:4", "--problem", "ag:512x256x512:bfloat16:4",
                 timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    out = " ".join(run.stdout.split())
    assert "compiled for gpu:h100:1x4" in out and "compiled without a GPU: GEMMs as cuBLAS calls" in out
    assert "overlaps" in out and "no tuned config was written" in out
    # every program's predicted time, said to be one (the cost model named), the deviceless form single-streamed
    assert out.count("predicted (") >= 30 and "(cmtune-roofline/h100-nvlink), a prediction, not a measurement" in out
    assert "XLA's windowed einsum on one stream, multi-streamed on a real node" in out


@pytest.mark.parametrize("spec, listed_problems", [("examples/flax_nnx_gpt.py:tiny_gpt_step", 12),
                                                    ("examples/flax_linen_llama.py:tiny_bf16_llama_step", 26)])
def test_a_users_step_lists_the_same_problems_on_a_gpu_node_as_on_cpu_devices(spec, listed_problems):
    """`cmtune problems --step` for an H100 node compiled ahead of time (an NNX model; a linen Llama with nn.scan
    over remat layers, in bfloat16) lists the roles, slots, problems and counts of CPU devices of the same mesh."""
    listed = []
    for device_spec in ("gpu:h100:8", "virtual:8"):
        run = cmtune("problems", "--step", spec, "--devices", device_spec, "--json", timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        found = json.loads(run.stdout)
        listed.append(sorted((p["role"], p["slot"], p["problem"]["collective"], p["problem"]["m"], p["problem"]["k"],
                              p["problem"]["n"], p["problem"]["dtype"], p["count"]) for p in found["problems"]))
    assert listed[0] == listed[1] and len(listed[0]) == listed_problems


def test_a_compile_screen_on_a_gpu_node_orders_the_search_and_marks_what_does_not_overlap():
    """The screen a search on an H100 node starts with: every candidate (XLA's windowed einsum among them) compiled
    for the node, the forms XLA's passes leave overlapped proposed first, the others after them and named."""
    from cmtune.report import screen_summary
    from cmtune.tuner.search import Searcher, SearchSettings
    from cmtune.workers.aot import screen

    problem = Problem.parse(FAMILIES[0])
    screened = screen(problem, ring_mesh_of(gpus.gpu_devices("h100", 1, 4), 4))
    assert [s.decomposition for s in screened] == candidates(problem, include_baseline=False, platform="gpu")
    assert all(s.overlap is not None for s in screened), [s.note for s in screened if s.overlap is None]
    verdicts = {s.decomposition: s.overlap for s in screened}
    later = [c for c, v in verdicts.items() if v != "overlaps"]
    assert 0 < len(later) < len(screened) // 2, verdicts  # most of the fenced rings overlap on H100; not all
    searcher = Searcher(problem, "h100-nvlink", SearchSettings(sampler="enumerate", screen=screened), platform="gpu")
    order = [c for c in searcher.by_model if c.method != "baseline"]
    assert set(order[-len(later):]) == set(later)  # what does not overlap is timed last
    summary = screen_summary(screened)
    assert f"{len(screened) - len(later)} of {len(screened)} forms overlap, timed first" in summary
    assert all(c.id in summary for c in later)


def test_a_study_submitted_with_a_gpu_screen_times_what_overlaps_first(tmp_path):
    """`cmtune submit --screen --devices gpu:h100:4` on a host without a GPU: the study is on the H100 node, and
    the node's worker is given the baseline and XLA's windowed einsum (the contenders a ring must beat), then forms
    that overlap, before anything XLA serialises."""
    import os

    import httpx

    from cmtune.launcher import running_server
    from collective_matmul.planning.problem import Software
    from collective_matmul.wire import Screened
    from tests.service.conftest import create_tokens, measurement, register

    url = f"sqlite:///{tmp_path / 'gpu-screen.sqlite'}"
    tokens = create_tokens(url, ["admin", "worker"])
    with running_server(database_url=url) as server:
        run = cmtune("submit", "--server", server.url, "--problem", "ag:512x256x512:bfloat16:4", "--screen",
                     "--devices", "gpu:h100:4", "--trials", "40", env=os.environ | {"CMTUNE_TOKEN": tokens["admin"]})
        assert run.returncode == 0, run.stdout + run.stderr
        admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens['admin']}"}, timeout=30)
        (study,) = admin.get("/v1/studies").json()["items"]
        verdicts = {Decomposition.model_validate(s["decomposition"]): s["overlap"] for s in study["settings"]["screen"]}
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens['worker']}"},
                              timeout=30)
        node = {k: study["hardware"][k] for k in ("platform", "device_kind", "device_count", "process_count")}
        worker = register(client, hardware=node, software=Software(jax=jax.__version__).model_dump())
        leased = []
        while True:  # the proposals in order, each reported (each faster than the last) before the next lease
            grant = worker.post(f"/v1/workers/{worker}/lease")
            if grant.status_code == 204 or grant.json()["trial"]["kind"] != "search":
                break
            trial = grant.json()["trial"]
            leased.append(Decomposition.model_validate(trial["decompositions"][0]))
            result = measurement(trial["problem"], leased[-1], 1.0 - 0.01 * len(leased), hardware=node)
            reply = worker.post(f"/v1/trials/{trial['id']}/result",
                                json={"lease_id": grant.json()["lease"]["id"], "measurement": result})
            assert reply.status_code == 200, reply.text
    assert study["hardware"]["device_kind"] == "NVIDIA H100 80GB HBM3" and study["hardware"]["platform"] == "gpu"
    assert "overlaps" in verdicts.values() and set(verdicts.values()) != {"overlaps"}
    assert leased[:2] == [Decomposition.baseline(), Decomposition.xla()]
    rings = [Screened(decomposition=c, overlap=verdicts[c]).rank for c in leased[2:]]
    assert len(leased) == len(verdicts) + 1 and rings == sorted(rings)  # every form, those that overlap first
    assert "screened:" in run.stdout and "forms overlap, timed first" in run.stdout
