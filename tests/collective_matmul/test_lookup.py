"""Nothing unmeasured in a training step by default: where nothing was measured on the hardware, `Tuned` answers
the baseline and says why; the cost model's choice only where the client asks for it."""

from __future__ import annotations

import jax
import pytest

from collective_matmul import Bundle, Decomposition, Hardware, Problem, Tuned, TunedConfig
from collective_matmul.costmodel import model_choice
from collective_matmul.lookup import NOT_MEASURED

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
    assert (found.decomposition, found.match, found.source) == (Decomposition.baseline(), "baseline", "baseline")
    assert found.note.startswith(NOT_MEASURED) and "unmeasured=costmodel" in found.note
    assert tuned.lookup(BIG, MEASURED_ON).decomposition == RING  # what was measured still answers


@pytest.mark.parametrize("hardware", PLATFORMS, ids=lambda h: h.device_kind)
def test_the_cost_model_answers_only_where_asked_for(bundle, hardware):
    found = Tuned(bundle=bundle, unmeasured="costmodel").lookup(BIG, hardware)
    assert (found.decomposition, found.match, found.source) == (model_choice(BIG, hardware), "model", "costmodel")
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
