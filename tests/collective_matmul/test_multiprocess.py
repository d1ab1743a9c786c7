"""A real two-process cluster (jax.distributed over gloo on loopback)."""

import json
from pathlib import Path

import pytest

from cmtune.workers.cluster import launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_process_ring_and_baseline_agree_with_numpy():
    results = launch(2, ["-m", "tests.collective_matmul.gloo_job"], local_devices=4, cwd=ROOT, timeout_s=300)
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    assert [r["process"] for r in reports] == [0, 1]
    for report in reports:
        assert (report["devices"], report["local"]) == (8, 4)
        for collective in ("allgather_matmul", "matmul_reduce_scatter"):
            for config_id in ("baseline", "ring-bi-c2-u1-auto"):
                assert report[f"{collective}/{config_id}"] < 1e-4, (collective, config_id)
            measured = report[f"{collective}/measure"]
            assert measured["status"] == "ok", measured["message"]
            assert measured["hardware"]["process_count"] == 2
            assert len(measured["candidate"]["samples_s"]) == 3
    # both processes report the same (slowest-process) samples
    for collective in ("allgather_matmul", "matmul_reduce_scatter"):
        a, b = (r[f"{collective}/measure"]["candidate"]["samples_s"] for r in reports)
        assert a == b
