"""The predictor on programs XLA compiled for a GPU node and a TPU slice that are not here (nothing runs).

A ring that overlaps is predicted faster than the same schedule serialised, and the product as written scales
with its shape.  Marked ``gpu_aot`` / ``tpu_aot``: skipped, saying what to install, without the compilers.
"""

from __future__ import annotations

import jax
import pytest

from cmtune.workers.aot import CompileSession, compile_all_predicted, plain_program, predict_problem
from cmtune.workers.measure import compiler_options_of, default_program, ring_mesh_of
from collective_matmul import Decomposition, Problem
from collective_matmul.planning.costmodel import profile_of_kind
from collective_matmul.programs import gpus
from collective_matmul.programs.predict import predict
from collective_matmul.programs.topology import tpu_devices
from tests.cli import cmtune

RING = Decomposition.from_id("ring-uni-c1-full-dus")


def compiled_text(devices, key: str, config: Decomposition | None = None) -> str:
    problem = Problem.parse(key)
    mesh = ring_mesh_of(devices, problem.axis_size)
    session = CompileSession(problem, mesh)
    if config is None:
        program, options = plain_program(problem, mesh, session.axis), {}
    else:
        program = default_program(problem, config, mesh, session.axis)
        options = compiler_options_of(config, mesh) or {}
    options = gpus.compile_options(mesh.devices.flat, options)
    return jax.jit(program).lower(*session.args).compile(compiler_options=options or None).as_text()


def check(devices, dtype: str, model: str):
    profile = profile_of_kind(devices[0].device_kind)
    small = predict(compiled_text(devices, f"ag:4096x4096x4096:{dtype}:4"), profile)
    large = predict(compiled_text(devices, f"ag:8192x4096x4096:{dtype}:4"), profile)
    assert small.cost_model == f"cmtune-roofline/{model}" and not small.unpriced
    assert small.comm_s > 0 and small.overlapped_share == 0.0  # as written: the gather, then the product
    assert large.compute_s / small.compute_s == pytest.approx(2, rel=0.01)  # twice the rows: twice the product
    assert 1.6 < large.seconds / small.seconds < 2  # and twice the bytes gathered, the latencies unchanged
    text = compiled_text(devices, f"ag:4096x4096x4096:{dtype}:4", RING)
    ring, serial = predict(text, profile), predict(text, profile, serial=True)
    assert ring.overlapped_share > 0.2 and ring.seconds < serial.seconds
    assert serial.exposed_comm_s == pytest.approx(serial.comm_s, rel=1e-9)
    return small, ring


@pytest.mark.gpu_aot
def test_a_gpu_node_ring_that_overlaps_is_predicted_faster_than_serialised():
    written, ring = check(gpus.gpu_devices("h100", 1, 4), "float16", "h100-nvlink")
    assert ring.seconds < written.seconds  # the gather is as dear as the product: hiding it wins


@pytest.mark.tpu_aot
def test_a_tpu_slice_ring_that_overlaps_is_predicted_faster_than_serialised():
    check(tpu_devices("v5e:2x2"), "bfloat16", "tpu-v5e")


@pytest.mark.gpu_aot
def test_every_program_compiled_for_a_gpu_node_has_its_predicted_time():
    """The product as written (windowed einsum at its default and off), XLA's windowed einsum on and a ring: each
    compiled and predicted; nothing lands on the wire record."""
    problem = Problem.parse("ag:4096x4096x16384:float16:4")
    mesh = ring_mesh_of(gpus.gpu_devices("h100", 1, 4), 4)
    default, off, xla, ring = compile_all_predicted(problem, mesh, [Decomposition.xla(), RING])
    assert off.candidate.xla_options and xla.candidate.decomposition.method == "xla"
    assert all(p.prediction is not None and p.prediction.cost_model == "cmtune-roofline/h100-nvlink"
               for p in (default, off, xla, ring))
    assert ring.prediction.seconds < off.prediction.seconds and ring.prediction.overlapped_share > 0.5
    assert "predict" not in ring.candidate.model_dump_json()


@pytest.mark.slow  # six compiles of a whole step, about 50 s here
@pytest.mark.gpu_aot
def test_a_users_step_compiled_for_a_gpu_node_is_predicted_as_written_and_through_the_drop_in():
    run = cmtune("verify", "--step", "examples/flax_linen_llama.py:tiny_bf16_llama_step", "--compile-only",
                 "--devices", "gpu:h100:8", timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    out = " ".join(run.stdout.split())
    assert out.count(" predicted ") >= 6 and "(cmtune-roofline/h100-nvlink), a prediction, not a measurement" in out


@pytest.mark.slow  # 33 candidates compiled by XLA's TPU compiler: about 100 s here
@pytest.mark.tpu_aot
def test_a_problem_predicted_on_a_tpu_slice_names_its_predicted_best_ring():
    """Every candidate of a problem compiled for a v5p slice and predicted: the product as written, XLA's windowed
    einsum off and on, and the ring the prediction puts first, faster than the product as written."""
    problem = Problem.parse("ag:8192x4096x8192:bfloat16:4")
    got = predict_problem(problem, ring_mesh_of(tpu_devices("v5p:2x2x1"), 4))
    assert got.cost_model == "cmtune-roofline/tpu-v5p" and got.compiled == got.tried > 10
    assert got.windowed_off_s is not None and got.windowed_einsum_s is not None
    assert got.best.method == "ring" and got.best_s < got.as_written_s
    assert predict_problem(problem, ring_mesh_of(jax.devices()[:4], 4)) is None  # CPU devices: no figures


@pytest.mark.gpu_aot
def test_a_problem_predicted_on_a_gpu_node_names_its_predicted_best_ring():
    problem = Problem.parse("ag:4096x1024x4096:float16:4")
    got = predict_problem(problem, ring_mesh_of(gpus.gpu_devices("h100", 1, 4), 4))
    assert got.cost_model == "cmtune-roofline/h100-nvlink" and got.compiled == got.tried > 10
    assert got.windowed_off_s is not None and got.windowed_einsum_s is not None
    assert got.best.method == "ring" and got.best_s == min(got.best_s, got.as_written_s, got.windowed_einsum_s)


def test_a_prediction_is_refused_for_devices_that_are_here():
    run = cmtune("predict", "--step", "examples/flax_nnx_gpt.py:one_layer_gpt_step", "--devices", "virtual:8",
                 timeout=120)
    assert run.returncode != 0 and "a prediction compiles for devices that are not" in run.stdout + run.stderr


@pytest.mark.slow  # the step compiled six ways for an H100 node, about 30 s here (with its products, minutes)
@pytest.mark.gpu_aot
def test_cmtune_predict_gives_the_step_as_written_and_with_cmtunes_choices():
    run = cmtune("predict", "--step", "examples/flax_nnx_gpt.py:one_layer_gpt_step", "--devices", "gpu:h100:8",
                 "--json", "--no-products", timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    import json

    got = json.loads(run.stdout)
    assert got["devices"] == "gpu:h100:1x8" and got["cost_model"] == "cmtune-roofline/h100-nvlink" and got["predicted"]
    step = got["step"]
    assert step["as_written_s"] > 0 and step["cmtune_s"] > 0 and step["windowed_einsum_s"] > 0
    assert step["cmtune_configs"] == "costmodel" and got["products"] == []
