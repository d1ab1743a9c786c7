"""The bounds measurement on real (virtual) devices: the programs it times, and the confirmation that carries it."""

from __future__ import annotations

import jax
import pytest

from cmtune.tuner.search import SearchSettings
from cmtune.workers import measure
from cmtune.workers.local import LocalTuner
from cmtune.workers.measure import OpSession, bound_programs, ring_mesh
from cmtune.workers.runner import LocalRunner, Watchdog, failed
from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.programs.hlo import parse_module
from collective_matmul.wire import (
    BoundsMeasurement,
    ConfirmResult,
    MeasurementProtocol,
    SearchResult,
    Status,
    TrialKind,
    TrialTask,
)

COLLECTIVES = {"allgather_matmul": "all-gather", "matmul_reduce_scatter": "reduce-scatter",
               "allgather_grad_weight": "all-gather"}
COMMUNICATION = {"all-gather", "all-gather-start", "reduce-scatter", "collective-permute", "collective-permute-start",
                 "all-reduce", "all-reduce-start", "all-to-all"}
PROTOCOL = MeasurementProtocol(warmup=1, repeats=3)


def problem(collective: str, dtype: str = "float32") -> Problem:
    return Problem(collective=collective, m=256, k=64, n=128, dtype=dtype, axis_size=8)


def opcodes(bound, p: Problem) -> set[str]:
    """Every instruction of the compiled program, in every computation."""
    inputs = bound.inputs(jax.random.key(0), p.dtype)
    module = parse_module(jax.jit(bound.program).lower(*inputs).compile().as_text())
    return {inst.opcode for c in module.computations.values() for inst in c.instructions.values()}


@pytest.mark.parametrize("collective", sorted(COLLECTIVES))
def test_the_compute_program_has_no_collective_and_the_communication_program_no_dot(collective):
    p = problem(collective)
    mesh = ring_mesh()
    programs = bound_programs(p, mesh, mesh.axis_names[0])
    compute, communication = opcodes(programs["compute"], p), opcodes(programs["communication"], p)
    assert "dot" in compute or "custom-call" in compute, compute
    assert not compute & COMMUNICATION, compute & COMMUNICATION
    assert "dot" not in communication and "convolution" not in communication, communication
    assert COLLECTIVES[collective] in communication or f"{COLLECTIVES[collective]}-start" in communication \
        or (collective == "matmul_reduce_scatter" and "all-reduce" in communication), communication


@pytest.mark.parametrize("collective", sorted(COLLECTIVES))
def test_the_bound_programs_move_and_multiply_what_the_baseline_does(collective):
    """The local shapes of each program are the baseline's: the product of each device's blocks, and the
    collective of the same bytes."""
    p = problem(collective)
    mesh = ring_mesh()
    programs = bound_programs(p, mesh, mesh.axis_names[0])
    inputs = {name: b.inputs(jax.random.key(1), p.dtype) for name, b in programs.items()}
    outputs = {name: jax.jit(programs[name].program)(*inputs[name]) for name in programs}
    local = {name: out.addressable_shards[0].data.shape for name, out in outputs.items()}
    size = p.axis_size
    expected = {"allgather_matmul": {"compute": (p.m, p.n // size), "communication": (p.m, p.k)},
                "matmul_reduce_scatter": {"compute": (p.m, p.n), "communication": (p.m // size, p.n)},
                "allgather_grad_weight": {"compute": (p.k, p.n // size), "communication": (p.m, p.k)}}[collective]
    assert local == expected
    for arrays in inputs.values():  # seeded normal inputs, never zeros
        assert all(float(jax.numpy.abs(a).mean()) > 0.5 for a in arrays)


@pytest.mark.parametrize("collective,dtype", [("allgather_matmul", "float32"), ("matmul_reduce_scatter", "float32"),
                                              ("allgather_grad_weight", "float32"), ("allgather_matmul", "bfloat16")])
def test_a_real_bounds_measurement_on_eight_devices(collective, dtype):
    p = problem(collective, dtype)
    b = OpSession(p, protocol=PROTOCOL).bounds()
    assert b.status == Status.OK, b.message
    assert b.problem == p and b.hardware.device_count == 8
    for timing in (b.compute, b.communication, b.baseline):
        assert len(timing.samples_s) == 3 and all(s > 0 for s in timing.samples_s)
    assert set(b.medians) == {"compute_s", "communication_s", "bounds_baseline_s"}
    assert BoundsMeasurement.model_validate_json(b.model_dump_json()) == b


def test_a_bound_program_that_fails_is_a_status(monkeypatch):
    session = OpSession(problem("allgather_matmul"), protocol=PROTOCOL)

    def broken(*args):
        raise RuntimeError("injected failure of a bound program")

    monkeypatch.setattr(measure, "bound_programs", broken)
    b = session.bounds()
    assert b.status == Status.COMPILE_ERROR and "injected failure" in b.message and b.compute is None


def test_bounds_over_their_timeout_keep_the_rounds_so_far():
    b = OpSession(problem("allgather_matmul"), protocol=PROTOCOL).bounds(MeasurementProtocol(warmup=0, repeats=50,
                                                                                timeout_s=1e-6))
    assert b.status == Status.TIMEOUT and "stopped after 1 of 50" in b.message
    assert len(b.compute.samples_s) == len(b.communication.samples_s) == len(b.baseline.samples_s) == 1


def task(kind: TrialKind, p: Problem, configs) -> TrialTask:
    return TrialTask(id=1, study_id=1, kind=kind, problem=p, decomposition=configs[0] if kind == "search" else None,
                     decompositions=list(configs), protocol=PROTOCOL)


def test_the_runner_times_a_confirmations_bounds_after_its_candidates():
    p = problem("matmul_reduce_scatter")
    ring = Decomposition(method="ring", direction="bidirectional", chunks=2)
    runner = LocalRunner()
    result = runner.run(task(TrialKind.CONFIRM, p, [Decomposition.baseline(), ring]))
    assert isinstance(result, ConfirmResult)
    assert [m.decomposition for m in result.measurements] == [Decomposition.baseline(), ring]
    assert result.bounds.ok and result.bounds.problem == p
    search = runner.run(task(TrialKind.SEARCH, p, [ring]))
    assert isinstance(search, SearchResult) and search.measurement.decomposition == ring  # and no bounds


def test_a_trial_that_cannot_be_set_up_fails_its_bounds_too():
    p = problem("allgather_matmul")
    result = failed(task(TrialKind.CONFIRM, p, [Decomposition.baseline()]), Status.OOM, "no\x00room")
    assert result.bounds.status == Status.OOM and result.bounds.message == "no?room"
    assert failed(task(TrialKind.SEARCH, p, [Decomposition.baseline()]), Status.OOM, "x").measurement.status == "oom"


def test_a_confirmations_deadline_counts_its_bounds_rounds():
    p = problem("allgather_matmul")
    configs = [Decomposition.baseline(), Decomposition()]
    assert Watchdog.deadline(task(TrialKind.CONFIRM, p, configs), 10) == 3 * 2 * PROTOCOL.timeout_s + 10
    assert Watchdog.deadline(task(TrialKind.SEARCH, p, configs[1:]), 10) == 2 * PROTOCOL.timeout_s + 10


def test_a_local_study_stores_its_bounds_on_the_confirmation_and_the_tuned_config():
    p = problem("allgather_matmul")
    settings = SearchSettings(sampler="enumerate", max_trials=3, confirm_top=1, confirm_repeats=3, profile="cpu")
    outcome = LocalTuner(LocalRunner()).tune(p, Hardware.detect(), settings, PROTOCOL)
    (confirm,) = [t for t in outcome.trials if t.kind == TrialKind.CONFIRM]
    assert confirm.bounds is not None and confirm.bounds.ok
    tuned = outcome.tuned
    assert tuned.compute_s == confirm.bounds.compute.median_s
    assert tuned.communication_s == confirm.bounds.communication.median_s
    assert tuned.bounds_baseline_s == confirm.bounds.baseline.median_s
    assert tuned.bound_s == max(tuned.compute_s, tuned.communication_s) and tuned.reason
    if not tuned.ring:  # the baseline won: the study says why, from the bounds
        assert outcome.study.message.startswith("no ring won: ")
