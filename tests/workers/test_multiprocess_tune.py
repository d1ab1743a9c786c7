"""`cmtune tune --devices processes:2`: process 0 decides, the others follow, whatever their clocks say."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cmtune.workers.cluster import launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_processes_take_the_same_decisions_when_their_timings_disagree(tmp_path):
    """Process 1's clocks run 3-4x fast; both processes must still run the same trials.

    Before the engine made process 0 the only decider, each process calibrated its own cost-model
    profile by timing and ordered the candidates differently: the group hung or aborted.
    """
    out = tmp_path / "ran"
    bundle = tmp_path / "tuned.json"
    args = ["tune", "--problem", "rs:256x512x128:float32:8", "--problem", "ag:256x128x256:float32:8",
            "--trials", "11", "--repeats", "3", "--out", str(bundle)]
    os.environ["CMTUNE_TEST_OUT"] = str(out)
    try:
        results = launch(2, ["-m", "tests.workers.perturbed_job", *args], local_devices=4, cwd=ROOT, timeout_s=600)
    finally:
        del os.environ["CMTUNE_TEST_OUT"]
    assert [r.returncode for r in results] == [0, 0]
    first, second = (json.loads(Path(f"{out}.{pid}").read_text()) for pid in (0, 1))
    assert first == second
    # the default sampler went past the cost model's favourites into TPE, and confirmed each problem
    assert len(first) == 2 * (11 + 1)
    assert [ids for _key, ids in first].count(["baseline"]) == 2
    assert "tuned on cpu:cpu:8:2" in results[0].stdout
