"""`cmtune tune` for real: a subprocess on 8 virtual devices, ending with a bundle the ops accept."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from collective_matmul import Hardware, Problem, allgather_matmul
from collective_matmul.ops.collective import input_shardings
from collective_matmul.wire.bundle import Bundle
from tests.cli import cmtune, says

ROOT = Path(__file__).resolve().parents[2]


def test_tune_writes_a_bundle_the_ops_accept(tmp_path):
    bundle_path = tmp_path / "tuned.json"
    spec = "ag:256x64x128:float32:8"
    run = cmtune("tune", "--problem", spec, "--trials", "6", "--repeats", "3", "--seed", "1",
                 "--out", str(bundle_path))
    assert run.returncode == 0, run.stderr
    assert "allgather_matmul:256x64x128:float32:8" in run.stdout
    assert "trial budget" in run.stdout and "6 of 49" in run.stdout

    problem = Problem.parse(spec)
    bundle = Bundle.load(bundle_path)
    entry = bundle.lookup(problem, Hardware.detect())
    assert entry is not None and entry.trials == 6 and entry.space_size == 49
    assert entry.speedup > 0 and entry.baseline_s > 0
    assert entry.compute_s > 0 and entry.communication_s > 0 and entry.bounds_baseline_s > 0  # the bounds came too
    # the winner's compiled program came with it: XLA's CPU backend runs a ring's permutes in place
    assert entry.overlap == ("synchronous" if entry.ring else "no permutes") and entry.memory_bytes > 0
    assert "hidden" in run.stdout and "communication" in run.stdout
    assert " ".join(entry.reason.split()[:3]) in " ".join(run.stdout.split())  # each problem's reason, printed

    mesh = jax.make_mesh((8,), ("model",))
    rng = np.random.default_rng(0)
    x_np, w_np = rng.standard_normal((256, 64), np.float32), rng.standard_normal((64, 128), np.float32)
    sx, sw = input_shardings("allgather_matmul", mesh, "model")
    out = allgather_matmul(jax.device_put(x_np, sx), jax.device_put(w_np, sw), mesh=mesh, axis="model",
                           config=entry.decomposition)
    np.testing.assert_allclose(np.asarray(out), x_np @ w_np, rtol=1e-4, atol=1e-4)


def test_tune_times_fsdps_collective_matmuls_and_their_bounds(tmp_path):
    """The weight gathered on k and on n, and its gradient reduce-scattered: each tuned for real (compiled,
    validated, timed against its baseline, its bounds beside it), stored under its own key."""
    bundle_path = tmp_path / "fsdp.json"
    specs = ["wk:256x128x64:float32:8", "wn:256x64x128:float32:8", "rsw:256x128x64:float32:8"]
    run = cmtune("tune", *(arg for spec in specs for arg in ("--problem", spec)), "--trials", "3", "--repeats", "3",
                 "--out", str(bundle_path))
    assert run.returncode == 0, run.stdout + run.stderr
    bundle = Bundle.load(bundle_path)
    for spec in specs:
        problem = Problem.parse(spec)
        entry = bundle.lookup(problem, Hardware.detect())
        assert entry is not None and entry.problem == problem and entry.trials == 3, spec
        assert entry.baseline_s > 0 and entry.compute_s > 0 and entry.communication_s > 0
        assert says(run, problem.key)


@pytest.mark.slow  # the two-process path of every command is the worker's too (tests/workers/test_daemon.py)
def test_tune_model_on_two_processes(tmp_path):
    bundle_path = tmp_path / "tuned.json"
    run = cmtune("tune", "--problem", "rs:64x128x32:float32:8", "--devices", "processes:2", "--trials", "4",
                 "--repeats", "3", "--out", str(bundle_path))
    assert run.returncode == 0, run.stderr
    (entry,) = Bundle.load(bundle_path).configs
    assert entry.hardware.process_count == 2 and entry.hardware.device_count == 8
    assert entry.bounds is not None  # both processes timed the bounds rounds together


@pytest.mark.slow  # two groups of two processes
def test_tune_rings_of_part_of_the_devices_on_two_processes(tmp_path):
    """Rings of 4 and of 2 on 2x4 devices: every ring at once, the configs keyed by the ring and the slice, found
    exact by training code on a ``data=2, model=4`` (``data=4, model=2``) mesh of 8 devices."""
    from collective_matmul import Tuned
    from collective_matmul.client.tuned import ring_hardware

    bundle_path = tmp_path / "tuned.json"
    problems = {4: "ag:64x16x32:float32:4", 2: "rs:64x32x16:float32:2"}
    for spec in problems.values():
        run = cmtune("tune", "--problem", spec, "--devices", "processes:2x4", "--trials", "2", "--repeats", "3",
                     "--out", str(bundle_path))
        assert run.returncode == 0, run.stderr
    keys = {c.problem.axis_size: c.hardware.key for c in Bundle.load(bundle_path).configs}
    assert keys == {4: "cpu:cpu:4:1/8", 2: "cpu:cpu:2:1/8"}
    tuned = Tuned(bundle=bundle_path)
    for size, spec in problems.items():
        mesh = jax.make_mesh((8 // size, size), ("data", "model"))
        found = tuned.lookup(Problem.parse(spec), ring_hardware(mesh, "model"))
        assert (found.match, found.origin) == ("exact", "bundle"), found


@pytest.mark.slow  # the whole space timed; the bounds rounds alone: tests/workers/test_bounds.py
def test_bench_times_the_bounds_after_the_candidates(tmp_path):
    out = tmp_path / "bench.jsonl"
    run = cmtune("bench", "--problem", "ag:64x8x16:float32:8", "--repeats", "1", "--warmup", "0", "--out", str(out))
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    assert "hidden" in text and "bounds: compute" in text and "communication" in text
    from collective_matmul.wire import BoundsMeasurement

    bounds = BoundsMeasurement.model_validate_json(out.read_text().splitlines()[-1])
    assert bounds.ok and bounds.problem == Problem.parse("ag:64x8x16:float32:8")


@pytest.mark.slow  # four tunes in a row (20 s); warm start's own tests are fast
def test_tune_seeds_each_problem_from_the_bundle_and_the_problems_before_it(tmp_path):
    bundle_path = tmp_path / "tuned.json"
    common = ("--trials", "3", "--repeats", "2", "--out", str(bundle_path))
    first = cmtune("tune", "--problem", "ag:256x64x128:float32:8", *common)
    assert first.returncode == 0, first.stderr
    second = cmtune("tune", "--problem", "ag:512x64x128:float32:8", "--problem", "ag:512x64x256:float32:8", *common)
    assert second.returncode == 0, second.stderr
    rows = {line.split("│")[1].strip(): line.split("│")[-2].strip() for line in second.stdout.splitlines()
            if line.startswith("│ allgather_matmul")}
    assert rows["allgather_matmul:512x64x128:float32:8"] == "256x64x128"  # the bundle's
    assert rows["allgather_matmul:512x64x256:float32:8"].startswith("512x64x128")  # this run's, nearest first
    plain = cmtune("tune", "--problem", "ag:1024x64x128:float32:8", "--no-warm-start", *common)
    assert plain.returncode == 0, plain.stderr
    (row,) = [line for line in plain.stdout.splitlines() if line.startswith("│ allgather_matmul")]
    assert row.split("│")[-2].strip() == "-"
    assert len(Bundle.load(bundle_path).configs) == 4
    foreign = tmp_path / "other.json"
    foreign.write_text('{"format": "something-else", "configs": []}')
    refused = cmtune("tune", "--problem", "ag:256x64x128:float32:8", "--out", str(foreign), timeout=120)
    assert refused.returncode != 0 and says(refused, f"{foreign}: not a cmtune bundle")
    assert not says(refused, "validation error") and not says(refused, "pydantic")  # one line, not the dump


def test_tune_with_a_compile_screen_compiles_every_candidate_first_and_marks_them():
    """``--screen`` (the default on GPU devices) on CPU devices: every candidate compiled for the rings before the
    search, and the verdicts in the output; XLA's CPU backend runs every permute in place, so none is first."""
    run = cmtune("tune", "--problem", "rs:256x128x64:float32:4", "--trials", "4", "--repeats", "2", "--screen")
    assert run.returncode == 0, run.stderr
    assert says(run, "compile screen: every candidate of 1 problems compiled for the rings first")
    assert says(run, "matmul_reduce_scatter:256x128x64:float32:4: compile screen: 0 of 16 forms overlap, timed "
                     "first; after them: 16 synchronous")
    plain = cmtune("tune", "--problem", "rs:256x128x64:float32:4", "--trials", "4", "--repeats", "2")
    assert plain.returncode == 0 and not says(plain, "compile screen")  # off on CPU devices unless asked
    assert "plugin configuration error" not in run.stderr + plain.stderr  # no accelerator here: its plugin stays off


@pytest.mark.parametrize(
    "args, message",
    [
        (["--problem", "ag:100x64x128:float32:8"], "m=100 is not divisible by axis_size=8"),
        (["--model", "tiny"], "--model needs --mesh"),
        (["--problem", "ag:64x8x8:float32:8", "--model", "tiny"], "either --problem"),
        (["--problem", "ag:64x8x8:float32:8", "--sampler", "grid"], "expected auto, enumerate"),
        (["--problem", "ag:48x8x12:float32:3", "--devices", "virtual:8"],
         "rings of 3 devices do not divide the 8 devices of virtual:8: give a multiple of 3"),
    ],
)
def test_tune_rejects_bad_input_with_a_useful_message(args, message):
    run = cmtune("tune", *args, timeout=120)
    assert run.returncode != 0
    assert says(run, message)


def test_bundle_rejects_a_foreign_file(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"format": "something-else", "configs": []}')
    with pytest.raises(ValueError, match="not a cmtune bundle"):
        Bundle.load(path)


def test_a_table_in_a_log_cuts_no_key():
    """Piped (not a terminal), a table is as wide as its cells: no role, axis or problem key ends in '…'."""
    from tests.steps.long_names import AXIS, PROBLEM, ROLE

    run = cmtune("problems", "--step", "tests/steps/long_names.py:long_names_step", timeout=120)
    assert run.returncode == 0, run.stderr
    row = next(line for line in run.stdout.splitlines() if "forward" in line)
    assert [cell.strip() for cell in row.strip("│ ").split("│")][:5] == [ROLE, "forward", PROBLEM, "1", AXIS]
    assert "…" not in run.stdout


def test_verify_compile_only_compiles_a_users_step_as_written_and_through_the_drop_in():
    """`cmtune verify --step --compile-only` on CPU devices: the call sites the tuned step traced, then a row for
    the step as written, at the baseline and tuned, each compiled (memory, collectives, overlap), nothing timed."""
    run = cmtune("verify", "--step", "tests/steps/gspmd_mlp.py:mlp_step", "--compile-only", "--devices", "virtual:8",
                 timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert says(run, "call sites of tests/steps/gspmd_mlp.py:mlp_step through the drop-in (2 applied, 0 fell back)")
    assert says(run, "tests/steps/gspmd_mlp.py:mlp_step compiled for cpu on data=2,model=4")
    rows = {cells[0]: cells[2:] for line in run.stdout.splitlines()
            if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 8}
    assert rows["as written"] == ["0.2 MiB", "2", "0", "3", "0", "no permutes"], rows
    assert rows["baseline"] == rows["tuned"] == ["0.2 MiB", "2", "1", "2", "0", "no permutes"], rows
    assert says(run, "compiled, not timed") and not says(run, "reference: the step as written")  # not timed


def test_problems_json_is_json_alone_when_the_step_has_nothing_to_tune():
    """`--json` prints the discovery's JSON object alone on standard output, whatever the step; the sentences
    (nothing to tune, what was seen) go to standard error."""
    import json

    run = cmtune("problems", "--step", "tests/steps/data_parallel.py:step", "--devices", "virtual:8", "--json")
    assert run.returncode == 1, run.stdout + run.stderr
    found = json.loads(run.stdout)
    assert found["problems"] == []
    assert says(run.stderr, "nothing to tune")
