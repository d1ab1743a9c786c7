"""Nothing unmeasured in a training step by default: where nothing was measured on the hardware, `Tuned` answers
the baseline and says why; the cost model's choice only where the client asks for it."""

from __future__ import annotations

import jax
import pytest

from collective_matmul import Bundle, Decomposition, Hardware, Problem, Tuned
from collective_matmul.planning.costmodel import model_choice
from collective_matmul.wire.bundle import TunedConfig
from collective_matmul.wire.lookup import NOT_MEASURED

BIG = Problem.parse("ag:32768x4096x11008:bfloat16:8")  # the cost model predicts a ring ~2x faster on TPU and GPU
PLATFORMS = [Hardware(platform=platform, device_kind=kind, device_count=8) for platform, kind in (
    ("cpu", "cpu"), ("tpu", "TPU v4"), ("tpu", "TPU v5 lite"), ("gpu", "NVIDIA H100 80GB HBM3"))]
MEASURED_ON = Hardware(platform="tpu", device_kind="TPU v5p", device_count=8)  # the bundle's only hardware
RING = Decomposition.from_id("ring-uni-c2-full-dus")


@pytest.fixture
def bundle(tmp_path):
    path = tmp_path / "bundle.json"
    Bundle(configs=[TunedConfig(problem=BIG, hardware=MEASURED_ON, decomposition=RING, time_s=1e-3, baseline_s=2e-3,
                                speedup=2.0)]).save(path)
    return path


@pytest.mark.parametrize("hardware", PLATFORMS, ids=lambda h: h.device_kind)
def test_nothing_measured_on_the_hardware_answers_the_baseline_and_says_why(bundle, hardware):
    tuned = Tuned(bundle=bundle)
    found = tuned.lookup(BIG, hardware)
    # where XLA decomposes collective matmuls itself (TPU, GPU) the unmeasured baseline is the product as written:
    # cmtune's own baseline runs in a shard_map that XLA's windowed einsum does not touch
    as_written = Decomposition.baseline() if hardware.platform == "cpu" else Decomposition.xla()
    assert (found.decomposition, found.match, found.origin) == (as_written, "baseline", "baseline")
    assert found.note.startswith(NOT_MEASURED) and "unmeasured=costmodel" in found.note
    assert tuned.lookup(BIG, MEASURED_ON).decomposition == RING  # what was measured still answers


@pytest.mark.parametrize("hardware", PLATFORMS, ids=lambda h: h.device_kind)
def test_the_cost_model_answers_only_where_asked_for(bundle, hardware):
    found = Tuned(bundle=bundle, unmeasured="costmodel").lookup(BIG, hardware)
    assert (found.decomposition, found.match, found.origin) == (model_choice(BIG, hardware), "model", "costmodel")
    assert found.note.startswith(NOT_MEASURED)
    # the ring the default keeps out of a training step (the cpu profile never overlaps: its choice is the baseline)
    assert found.decomposition.method == ("baseline" if hardware.platform == "cpu" else "ring")


def test_asking_for_the_model_on_a_device_kind_without_figures_answers_the_baseline(bundle):
    unknown = Hardware(platform="tpu", device_kind="TPU v6 lite", device_count=8)
    found = Tuned(bundle=bundle, unmeasured="costmodel").lookup(BIG, unknown)
    assert (found.decomposition, found.match) == (Decomposition.baseline(), "baseline")
    assert found.note == f"{NOT_MEASURED}, and no cost-model figures for device kind 'TPU v6 lite': the baseline"


def test_unmeasured_is_baseline_or_costmodel():
    with pytest.raises(ValueError, match=r"unmeasured must be one of \['baseline', 'costmodel'\], got 'model'"):
        Tuned(unmeasured="model")


def test_the_report_says_why_a_call_runs_the_baseline():
    mesh = jax.make_mesh((8,), ("model",))
    x, w = jax.ShapeDtypeStruct((64, 32), "float32"), jax.ShapeDtypeStruct((32, 64), "float32")
    tuned = Tuned()
    configs = tuned.configs("mlp_up", "allgather_matmul", x, w, mesh=mesh, axis="model")
    assert configs.forward == Decomposition.baseline()
    (site,) = tuned.report().applied
    assert site.unmeasured == [f"{NOT_MEASURED}: the baseline (unmeasured=costmodel asks for the cost model's "
                               "choice instead)"]
    assert site.unmeasured[0] in str(tuned.report())


def test_xla_is_a_choice_for_the_whole_op():
    """A forward left to XLA takes its backward with it; a backward slot left to XLA under a forward of cmtune's
    runs cmtune's default for the slot: the op always runs (`collective_matmul.wire.lookup.whole_op`)."""
    from collective_matmul.planning.decomposition import DEFAULT_GRAD_WEIGHT
    from collective_matmul.wire.lookup import whole_op

    xla, ring = Decomposition.xla(), RING
    assert {s: d for s, (d, _) in whole_op({"forward": xla, "grad_input": ring, "grad_weight": xla}).items()} == {
        "grad_input": xla}
    changed = whole_op({"forward": ring, "grad_input": xla, "grad_weight": xla})
    assert {s: d for s, (d, _) in changed.items()} == {"grad_input": Decomposition.baseline(),
                                                       "grad_weight": DEFAULT_GRAD_WEIGHT}
    assert not whole_op({"forward": ring, "grad_input": ring, "grad_weight": DEFAULT_GRAD_WEIGHT})


def test_the_report_says_what_the_training_compile_needs():
    """A role left to XLA was timed with its windowed einsum on at any size: the report gives the compile options
    (none on CPU, which has no windowed einsum); on GPU it names the overlap flags XLA_FLAGS lacks."""
    from collective_matmul.client.report import CallSite, Report
    from collective_matmul.client.sources import Lookup
    from collective_matmul.planning.xla_options import windowed_einsum, with_overlap_flags

    def site(platform, decomposition):
        hardware = Hardware(platform=platform, device_kind=platform, device_count=8)
        return CallSite(role=f"mlp_up@{platform}", site="", via="op", problems={"forward": BIG}, hardware=hardware,
                        found={"forward": Lookup(decomposition, "exact", "bundle")})

    tpu = Report([site("tpu", Decomposition.xla()), site("tpu", RING)])
    assert tpu.compiler_options() == windowed_einsum("tpu", "on") and tpu.left_to_xla == tpu[:1]
    (line,) = tpu.advice(xla_flags="")
    assert "1 call site(s) leave the product to XLA's windowed einsum (mlp_up@tpu)" in line
    assert repr(windowed_einsum("tpu", "on")) in line and line in str(tpu)
    assert Report([site("cpu", Decomposition.xla())]).compiler_options() == {}
    gpu = Report([site("gpu", RING)])
    (flags,) = gpu.advice(xla_flags="--xla_gpu_enable_latency_hiding_scheduler=false")
    assert flags.startswith("XLA_FLAGS lacks --xla_gpu_experimental_parallel_collective_overlap_limit=2:")
    assert gpu.advice(xla_flags=with_overlap_flags("", "gpu")) == []
    assert Report([site("cpu", RING)]).advice(xla_flags="") == []


def test_the_old_names_of_an_answers_origin_and_a_calls_site_resolve_with_a_warning():
    """`Lookup.source` is `Lookup.origin` (where the answer came from), `CallSite.source` is `CallSite.site` (the
    call's file:line): the old names read the same for one more release, with a `DeprecationWarning`."""
    from collective_matmul.client.report import CallSite
    from collective_matmul.client.sources import Lookup

    found = Lookup(RING, "exact", "bundle")
    with pytest.warns(DeprecationWarning, match=r"Lookup\.source is Lookup\.origin"):
        assert found.source == found.origin == "bundle"
    called = CallSite(role="mlp_up", site="model.py:12", via="op")
    with pytest.warns(DeprecationWarning, match=r"CallSite\.source is CallSite\.site"):
        assert called.source == called.site == "model.py:12"
