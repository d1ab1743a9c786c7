"""Warm start through the API, on SQLite and PostgreSQL: a new study is seeded from the configs tuned on its
hardware, shows where each seed came from (the API, `cmtune submit` and `cmtune status`), times them right after
the baseline, and can be switched off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from cmtune.launcher import running_server
from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.wire.bundle import TunedConfig
from tests.service.conftest import HARDWARE, PROBLEM, cost, create_tokens, register, run_trial

ROOT = Path(__file__).resolve().parents[2]

NEIGHBOUR = PROBLEM | {"m": 512}  # allgather_matmul:512x64x128:float32:8, log 2 away


def slow_rings(config: Decomposition) -> float:
    """No ring beats the baseline; they still rank as `cost` ranks them."""
    return 1.0 if config.method == "baseline" else cost(config) + 0.5


def submit(client, problem: dict, **body) -> dict:
    response = client.post("/v1/studies", json={"problem": problem, "hardware": HARDWARE,
                                                "budget": {"trials": 6}} | body)
    assert response.status_code == 201, response.text
    return response.json()


def test_a_new_study_is_seeded_from_a_finished_neighbour_and_shows_it(api):
    (neighbour,) = submit(api.admin, NEIGHBOUR)["studies"]
    assert neighbour["seeds"] == [] and neighbour["settings"]["seeds"] == []  # nothing tuned yet
    worker = register(api.worker)
    while run_trial(worker, slow_rings) is not None:
        pass
    done = api.reader.get(f"/v1/studies/{neighbour['id']}").json()
    assert done["tuned"]["decomposition"]["method"] == "baseline"  # as on many a machine: the best ring seeds
    trials = api.reader.get(f"/v1/studies/{neighbour['id']}/trials").json()
    rings = [t for t in trials if t["kind"] == "search" and t["decomposition_id"] != "baseline"]
    best = min(rings, key=lambda t: (t["ratio"], t["number"]))
    (study,) = submit(api.admin, PROBLEM)["studies"]
    winner = done["tuned"]["decomposition"]
    expected = [(winner, "winner"), (best["decompositions"][0], "best ring")]
    assert [(s["decomposition"], s["kind"]) for s in study["seeds"]] == expected
    for seed in study["seeds"]:
        assert (seed["neighbour"], seed["source"], seed["study_id"]) == (
            "allgather_matmul:512x64x128:float32:8", "study", neighbour["id"])
        assert seed["decomposition_id"] == Decomposition.model_validate(seed["decomposition"]).id
    assert study["seeds"][0]["ratio"] == 1 / done["tuned"]["speedup"]
    shown = api.reader.get(f"/v1/studies/{study['id']}").json()
    assert shown["seeds"] == study["seeds"] and [s["decomposition"] for s in shown["settings"]["seeds"]] == [
        d for d, _ in expected]
    # the baseline first, then the seeds
    ring_seeds = [d for d, _ in expected if d["method"] == "ring"]
    timed = [run_trial(worker)["trial"]["decomposition"] for _ in range(1 + len(ring_seeds))]
    assert timed == [Decomposition.baseline().model_dump(mode="json"), *ring_seeds]


def test_warm_start_switched_off_and_a_submission_does_not_seed_from_itself(api):
    model = api.admin.post("/v1/studies", json={
        "model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}}, "hardware": HARDWARE, "budget": {"trials": 4},
        "step": {"measure": False}}).json()
    assert all(s["seeds"] == [] for s in model["studies"])  # its own studies are not finished
    with api.store.write() as tx:  # an imported config: no study of its own
        tx.save_tuned(TunedConfig(problem=Problem(**NEIGHBOUR), hardware=Hardware(**HARDWARE),
                                  decomposition=Decomposition(direction="bidirectional", chunks=2), time_s=1e-3,
                                  baseline_s=2e-3, speedup=2.0), study_id=None)
    (seeded,) = submit(api.admin, PROBLEM)["studies"]
    assert [(s["decomposition_id"], s["kind"], s["source"], s["study_id"]) for s in seeded["seeds"]] == [
        ("ring-bi-c2-full-dus", "winner", "bundle", None)]
    (plain,) = submit(api.admin, PROBLEM, force=True, warm_start=False)["studies"]
    assert plain["seeds"] == [] and plain["settings"]["seeds"] == []
    other_dtype = submit(api.admin, PROBLEM | {"dtype": "bfloat16"})["studies"][0]
    assert other_dtype["seeds"] == []


def test_cmtune_submit_and_status_show_where_the_seeds_came_from(tmp_path):
    url = f"sqlite:///{tmp_path / 'warm.sqlite'}"
    tok = create_tokens(url, ["admin", "worker"])
    with running_server(database_url=url) as server:
        admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['admin']}"}, timeout=30)
        (neighbour,) = submit(admin, NEIGHBOUR)["studies"]
        worker = register(httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['worker']}"},
                                       timeout=30))
        while run_trial(worker, slow_rings) is not None:
            pass

        def cmtune(*args):
            env = os.environ | {"CMTUNE_TOKEN": tok["admin"]}
            run = subprocess.run([sys.executable, "-m", "cmtune", *args, "--server", server.url],
                                 cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
            assert run.returncode == 0, run.stdout + run.stderr
            return run.stdout

        seeded = cmtune("submit", "--problem", "ag:256x64x128:float32:8", "--trials", "4")
        plain = cmtune("submit", "--problem", "ag:256x64x128:float32:8", "--force", "--no-warm-start")
        status = cmtune("status")
    assert f"2 seeds from 512x64x128 (#{neighbour['id']})" in seeded
    assert "hardware: cpu:cpu:8:1, the registered workers' (1)" in seeded  # no hardware given: the pool's
    assert "seeds" not in plain
    rows = [line for line in status.splitlines() if "allgather_matmul:256x64x128" in line]
    assert len(rows) == 2 and sum(f"512x64x128 (#{neighbour['id']})" in row for row in rows) == 1
