"""bench/device_check.py, the script for the day hardware is at hand, on this host's CPU devices (--quick)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from collective_matmul.wire import BoundsMeasurement, Measurement

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_device_check_times_each_family_with_its_verdict_and_writes_one_file(tmp_path):
    out = tmp_path / "check.jsonl"
    run = subprocess.run([sys.executable, "bench/device_check.py", "--quick", "--out", str(out), "--repeats", "3",
                          "--rings", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = out.read_text().splitlines()
    measured = [Measurement.model_validate_json(line) for line in lines if '"decomposition"' in line]
    bounds = [BoundsMeasurement.model_validate_json(line) for line in lines if '"decomposition"' not in line]
    assert {m.problem.collective for m in measured} == {"allgather_matmul", "matmul_reduce_scatter",
                                                        "allgather_grad_weight"} and len(bounds) == 3
    assert all(m.ok and m.overlap is not None for m in measured)  # every timed program has its verdict
    assert all(m.overlap == "synchronous" for m in measured if m.decomposition.method == "ring")  # CPU's permutes
