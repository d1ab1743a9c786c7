"""The measurement protocol on real (virtual) devices."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from cmtune.tuner.search import SearchSettings
from cmtune.workers.local import LocalTuner
from cmtune.workers.measure import OpSession, default_program, ring_mesh
from cmtune.workers.runner import LocalRunner
from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.planning.costmodel import PROFILES, rank
from collective_matmul.planning.space import candidates
from collective_matmul.wire import Measurement, MeasurementProtocol, TrialKind

PROBLEM = Problem.parse("ag:256x64x128:float32:8")
WRONG = Decomposition(direction="bidirectional", chunks=2, unroll="full", accumulate="concat")
BROKEN = Decomposition(direction="unidirectional", chunks=4, unroll=1, accumulate="update_slice")


def sabotaged(problem, config, mesh, axis):
    """The real ops, except WRONG is numerically off and BROKEN fails to compile."""
    program = default_program(problem, config, mesh, axis)
    if config == WRONG:
        return lambda x, w: program(x, w) * 1.01
    if config == BROKEN:
        def fails(x, w):
            raise RuntimeError("injected compile failure")
        return fails
    return program


@pytest.fixture(scope="module")
def session():
    return OpSession(PROBLEM, protocol=MeasurementProtocol(warmup=1, repeats=3), build=sabotaged)


def test_valid_candidate_is_timed_against_baseline(session):
    m = session.measure(Decomposition(chunks=2, accumulate="update_slice"))
    assert m.status == "ok", m.message
    assert m.rel_error < 1e-6
    assert m.compile_s > 0 and m.memory_bytes > 0
    assert len(m.candidate.samples_s) == len(m.baseline.samples_s) == 3
    assert m.candidate.min_s <= m.candidate.median_s <= m.candidate.max_s
    assert m.ratio > 0 and m.ratio_iqr >= 0
    assert m.hardware.device_count == 8 and m.hardware.jax_version
    assert Measurement.model_validate_json(m.model_dump_json()) == m


def test_wrong_candidate_is_invalid(session):
    m = session.measure(WRONG)
    assert m.status == "invalid"
    assert "relative error" in m.message and m.rel_error > 1e-3
    assert m.candidate is None


def test_compile_failure_is_recorded(session):
    m = session.measure(BROKEN)
    assert m.status == "compile_error"
    assert "injected compile failure" in m.message


def test_invalid_decomposition_is_never_compiled(session):
    m = session.measure(Decomposition(chunks=64))
    assert m.status == "compile_error" and "chunks=64" in m.message


def test_timeout_keeps_the_samples_so_far(session):
    m = session.measure(Decomposition(chunks=1, accumulate="concat"),
                        MeasurementProtocol(warmup=0, repeats=50, timeout_s=1e-6))
    assert m.status == "timeout"
    assert len(m.candidate.samples_s) == 1 and "stopped after 1 of 50" in m.message


def test_inputs_are_seeded_normal_not_zeros(session):
    x = jnp.asarray(session.x)
    assert float(jnp.std(x)) == pytest.approx(1.0, rel=0.1)
    assert float(jnp.abs(x).min()) > 0 or float(jnp.mean(jnp.abs(x))) > 0.5
    again = OpSession(PROBLEM, protocol=MeasurementProtocol(seed=0))
    assert bool(jnp.all(again.x == session.x))


def test_study_skips_wrong_and_broken_candidates_and_goes_on():
    profile = PROFILES["cpu"]
    # sabotage the cost model's two favourites, so an enumerating study meets them first
    favourites = [c for c in rank(PROBLEM, candidates(PROBLEM), profile) if c.method == "ring"]
    wrong, broken = favourites[:2]

    def build(problem, config, mesh, axis):
        return sabotaged(problem, {wrong: WRONG, broken: BROKEN}.get(config, config), mesh, axis)

    settings = SearchSettings(sampler="enumerate", max_trials=6, confirm_top=2, confirm_repeats=3, profile="cpu")
    result = LocalTuner(LocalRunner(build=build)).tune(PROBLEM, Hardware.detect(), settings,
                                                        MeasurementProtocol(warmup=1, repeats=3))
    statuses = {t.decomposition: t.status for t in result.search}
    assert statuses[wrong] == "invalid" and statuses[broken] == "compile_error"
    assert result.tuned.invalid == 1 and result.tuned.failed == 1 and len(result.search) == 6
    assert result.tuned.decomposition not in (wrong, broken)
    (confirm,) = [t for t in result.trials if t.kind == TrialKind.CONFIRM]
    assert wrong not in confirm.decompositions and all(m.ok for m in confirm.measurements)


def test_the_ring_size_must_divide_the_devices():
    with pytest.raises(ValueError, match="a ring of 3 does not divide the 8 devices"):
        OpSession(Problem.parse("ag:48x8x12:float32:3"))
    with pytest.raises(ValueError, match="needs a ring of 4 devices but the mesh has 8"):
        OpSession(Problem.parse("ag:64x8x8:float32:4"), mesh=ring_mesh())


@pytest.mark.parametrize("spec", ["ag:256x64x128:float32:4", "rs:256x64x128:float32:2", "gw:256x64x128:float32:4"])
def test_a_ring_of_part_of_the_devices_runs_on_every_ring_of_them_at_once(spec):
    """8 devices, rings of 4 (or 2): the inputs sharded over the ring axis only, replicated over the rings, every
    ring running the candidate in the same program; measured on the ring's hardware, part of a slice of 8."""
    problem = Problem.parse(spec)
    session = OpSession(problem, protocol=MeasurementProtocol(warmup=1, repeats=3))
    assert dict(session.mesh.shape) == {"rings": 8 // problem.axis_size, "ring": problem.axis_size}
    assert session.hardware.key == f"cpu:cpu:{problem.axis_size}:1/8"
    assert "rings" not in str(session.x.sharding.spec) and "rings" not in str(session.w.sharding.spec)
    candidate = next(c for c in candidates(problem) if c.method == "ring")
    program = jax.jit(session.build(problem, candidate, session.mesh, session.axis)).lower(session.x, session.w)
    hlo = program.compile().as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo
    pairs = [(int(a), int(b)) for block in re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", hlo)
             for a, b in re.findall(r"\{(\d+),(\d+)\}", block)]
    assert pairs and all(a // problem.axis_size == b // problem.axis_size for a, b in pairs)  # within each ring
    m = session.measure(candidate)
    assert m.ok and m.hardware.key == session.hardware.key and m.rel_error < 1e-5, m.message
    assert session.bounds().ok


def test_a_weight_gradient_problem_is_measured_like_the_others():
    problem = Problem.parse("gw:256x64x128:float32:8")
    session = OpSession(problem, protocol=MeasurementProtocol(warmup=1, repeats=3))
    assert session.x.shape == (256, 64) and session.w.shape == (256, 128)
    m = session.measure(Decomposition(direction="bidirectional", chunks=2, accumulate="input_dtype"))
    assert m.status == "ok", m.message
    assert m.rel_error < 1e-5 and m.ratio > 0


def test_calls_per_sample_keep_the_overhead_from_deciding_a_sample():
    from cmtune.workers.measure import calls_per_sample

    assert calls_per_sample(100e-6, 20e-6, "cpu") == 10  # 50 x 20 µs of overhead over 100 µs calls
    assert calls_per_sample(10e-6, 100e-6, "cpu") == 20  # XLA's CPU rendezvous: at most 20 queued on CPU
    assert calls_per_sample(10e-6, 100e-6, "gpu") == 500
    assert calls_per_sample(5e-3, 20e-6, "cpu") == 1  # a long program: one call is enough
    assert calls_per_sample(100e-6, 1e-6, "tpu") == 10  # an accelerator's sample lasts at least 1 ms
    assert calls_per_sample(2e-3, 1e-6, "gpu") == 1


def test_a_sample_of_k_calls_is_recorded_per_call_with_its_k():
    from collective_matmul import Decomposition, Problem
    from collective_matmul.wire import MeasurementProtocol

    session = OpSession(Problem.parse("ag:64x32x64:float32:8"))
    fixed = session.measure(Decomposition.from_id("ring-uni-c1-full-dus"), MeasurementProtocol(repeats=3, warmup=1,
                                                                                               calls=3))
    assert fixed.ok and fixed.candidate.calls == fixed.baseline.calls == 3 and len(fixed.candidate.samples_s) == 3
    chosen = session.measure(Decomposition.from_id("ring-uni-c1-full-dus"), MeasurementProtocol(repeats=3, warmup=1))
    assert chosen.ok and chosen.candidate.calls == chosen.baseline.calls >= 1  # one K for both: they pair
