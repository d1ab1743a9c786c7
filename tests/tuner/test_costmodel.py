"""The analytic cost model: profiles, orderings that follow from the model, calibration."""

import pytest

from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.planning.costmodel import PROFILES, calibrate_cpu, estimate, no_figures, profile_for, rank
from collective_matmul.planning.space import candidates


def kind(platform: str, device_kind: str) -> Hardware:
    return Hardware(platform=platform, device_kind=device_kind, device_count=8)


@pytest.mark.parametrize("platform, device_kind, name", [
    ("cpu", "cpu", "cpu"),
    ("tpu", "TPU v4", "tpu-v4"),
    ("tpu", "TPU v5 lite", "tpu-v5e"),
    ("tpu", "TPU v5p", "tpu-v5p"),
    ("tpu", "TPU v5", "tpu-v5p"),  # libtpu's compile-only v5p devices
    ("gpu", "NVIDIA H100 80GB HBM3", "h100-nvlink"),
    ("gpu", "H100 SXM5", "h100-nvlink"),
    ("gpu", "NVIDIA H200", "h200-nvlink"),
    ("gpu", "NVIDIA H200 NVL", "h200-nvlink"),
])
def test_profiles_are_chosen_by_device_kind(platform, device_kind, name):
    assert profile_for(kind(platform, device_kind)).name == name


@pytest.mark.parametrize("platform, device_kind", [
    ("tpu", "TPU v6 lite"), ("tpu", "TPU v3"), ("tpu", "TPU v4 lite"), ("gpu", "NVIDIA H100 PCIe"),
    ("gpu", "NVIDIA A100-SXM4-80GB"), ("cpu", "cpu-b"), ("rocm", "MI300X")])
def test_an_unknown_device_kind_has_no_profile_and_is_tuned_with_the_generic_one(platform, device_kind):
    from cmtune.tuner.search_studies import profile_name_for, study_settings

    hardware = kind(platform, device_kind)
    assert profile_for(hardware) is None  # before: any TPU got v4's figures, any GPU H100's
    assert no_figures(hardware) == f"no cost-model figures for device kind {device_kind!r}"
    assert profile_name_for(hardware) == "generic"
    problem = Problem.parse("ag:4096x1024x4096:bfloat16:8")
    assert study_settings(problem, hardware).profile == "generic"


def test_overlap_makes_rings_win_on_large_shapes_with_fast_compute():
    big = Problem.parse("ag:65536x8192x8192:bfloat16:8")
    tpu = PROFILES["tpu-v4"]
    ring = estimate(big, Decomposition(direction="bidirectional"), tpu)
    assert ring < estimate(big, Decomposition.baseline(), tpu)
    # without overlap (virtual CPU devices) the ring only adds work
    cpu = PROFILES["cpu"]
    assert estimate(big, Decomposition(), cpu) >= estimate(big, Decomposition.baseline(), cpu) * 0.95


def test_small_shapes_prefer_the_baseline_and_few_chunks():
    tiny = Problem.parse("ag:64x64x64:bfloat16:8")
    tpu = PROFILES["tpu-v4"]
    order = rank(tiny, candidates(tiny), tpu)
    assert order[0] == Decomposition.baseline()
    assert estimate(tiny, Decomposition(chunks=8), tpu) > estimate(tiny, Decomposition(chunks=1), tpu)


def test_float32_accumulator_costs_bytes_for_bfloat16():
    rs = Problem.parse("rs:16384x8192x8192:bfloat16:8")
    slow_links = PROFILES["tpu-v5e"].model_copy(update={"overlap": False})
    assert estimate(rs, Decomposition(accumulate="float32"), slow_links) > estimate(
        rs, Decomposition(accumulate="input_dtype"), slow_links)


def test_rank_keeps_every_candidate():
    p = Problem.parse("rs:1024x1024x256:bfloat16:8")
    assert sorted(map(str, rank(p, candidates(p), PROFILES["h100-nvlink"]))) == sorted(map(str, candidates(p)))


def test_calibrate_cpu_measures_positive_rates():
    profile = calibrate_cpu()
    assert profile.flops_per_s["float32"] > 1e8
    assert profile.link_bytes_per_s > 1e6 and profile.latency_s > 0
    assert "calibrated on 8" in profile.source


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_estimates_every_candidate(name):
    p = Problem.parse("ag:4096x1024x4096:bfloat16:8")
    assert all(estimate(p, c, PROFILES[name]) > 0 for c in candidates(p))
