"""The step study's search through the API (SQLite and PostgreSQL): a step trial per round, each naming exactly
the variants it asks for; the grading in a trial of its own; what the search found, stored and served."""

from __future__ import annotations

import json

import pytest

from cmtune.tuner.variants import FIXED_RING
from collective_matmul import Decomposition
from collective_matmul.planning.models import ROLES
from tests.service.conftest import HARDWARE, register, report, run_trial, step_result

TINY = {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}}, "hardware": HARDWARE, "budget": {"trials": 3},
        "confirm_top": 1, "step": {"search_rounds": 3, "round_variants": 5}}
FUSED_RING = FIXED_RING.model_copy(update={"fuse": True})


def seconds(name: str, setting) -> float:
    """One fixed ring everywhere beats the op-level winners; with qkv's weight gradient fused it beats every
    fixed setting (the planted combination)."""
    if setting is None:
        return 1.0
    total = 0.5
    for role, configs in setting.items():
        for slot in ("forward", "grad_input", "grad_weight"):
            chosen = getattr(configs, slot)
            total += (0.005 if (role, slot, chosen) == ("qkv", "grad_weight", FUSED_RING) else
                      0.02 if chosen.model_copy(update={"fuse": False}) == FIXED_RING else
                      0.03 if chosen.method == "ring" else 0.05)
    return round(total, 6)


def lease_step(api, worker):
    """Run every search trial, then lease the next step trial: its grant."""
    while True:
        grant = worker.post(f"/v1/workers/{worker}/lease").json()
        if grant["trial"]["kind"] == "step":
            return grant
        report(worker, grant)


def post_step(worker, grant, **changes):
    body = {"lease_id": grant["lease"]["id"], "step": step_result(grant["trial"], seconds)} | changes
    return worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=body)


def test_the_step_search_runs_a_trial_per_round_and_serves_what_it_found(api):
    created = api.admin.post("/v1/studies", json=TINY).json()
    step_id = created["studies"][-1]["id"]
    assert created["studies"][-1]["trials_budget"] == 4  # three rounds and the grading
    worker = register(api.worker)
    asked, states = [], []
    while not states or states[-1] != "completed":
        grant = lease_step(api, worker)
        asked.append(list(grant["trial"]["step"]["variants"]))
        assert post_step(worker, grant).status_code == 200
        study = api.reader.get(f"/v1/studies/{step_id}").json()
        states.append(study["state"])
    assert states == ["running", "running", "confirming", "completed"]
    assert asked[0] == ["as-written", "baseline", "tuned", "always-ring"]  # the cost model picks the baseline here
    # a round tries the role as the other fixed settings run it (here: its op-level winners), then slot by slot
    assert asked[1] == ["as-written", "always-ring", "r2-qkv-tuned", "r2-qkv-fw1", "r2-qkv-gi1", "r2-qkv-gw1",
                        "r2-qkv-fuse"]
    # the next round re-checks the acceptance beside what it replaced, then improves the next role
    assert asked[2][:3] == ["as-written", "r2-qkv-fuse", "always-ring"]
    assert all(n.startswith("r3-attn_out-") for n in asked[2][3:])
    # the grading: every fixed setting of the seeds' round again beside the choice, in fresh rounds
    assert asked[3] == ["as-written", "baseline", "tuned", "always-ring", "r2-qkv-fuse"]
    decision = study["decision"]
    assert study["stop_reason"] == "step budget" and decision["variant"] == "r2-qkv-fuse"
    assert decision["seed"] == "always-ring" and decision["rounds"] == 3 and decision["fresh_rounds"]
    assert decision["vs_seed"]["median"] == pytest.approx(0.74 / 0.725)
    assert decision["vs_reference"]["median"] == pytest.approx(1 / 0.725) and decision["search_s"] >= 0
    assert "the search: 3 rounds" in decision["summary"]
    assert set(decision["vs_fixed"]) == {"baseline", "tuned", "always-ring"}
    assert all(v["low"] > 1 for v in decision["vs_fixed"].values())
    assert "ahead of every other fixed setting (baseline, tuned, always-ring) beyond the spread" in decision["summary"]
    # every round is a trial of the study, its variants by name
    trials = api.reader.get(f"/v1/studies/{step_id}/trials").json()
    assert [t["variants"] for t in trials] == asked and all(t["status"] == "ok" for t in trials)
    assert "r2-qkv-fuse ran the step" in trials[1]["message"]
    # the overrides: every role changed (always-ring), qkv's found in round 2
    params = {"model": "tiny", "platform": "cpu", "device_kind": "cpu", "device_count": 8}
    overrides = {o["role"]: o for o in api.reader.get("/v1/overrides", params=params).json()}
    assert set(overrides) == set(ROLES)
    assert Decomposition.model_validate(overrides["qkv"]["configs"]["grad_weight"]) == FUSED_RING
    assert "r2-qkv-fuse (round 2 of the step search)" in overrides["qkv"]["reason"]
    assert "always-ring (the seeds' round of the step search)" in overrides["mlp_down"]["reason"]
    # the submission: every variant tried once, and the grading as the fresh rounds
    step = api.reader.get(f"/v1/submissions/{created['submission_id']}").json()["step"]
    names = [v["name"] for v in step["variants"]]
    assert names[:4] == asked[0] and len(names) == len(set(names)) and "r2-qkv-fuse" in names
    assert [v["name"] for v in step["confirmation"]] == asked[3] and step["variant"] == "r2-qkv-fuse"


def test_a_search_round_takes_only_what_it_asked_for(api):
    api.admin.post("/v1/studies", json=TINY)
    worker = register(api.worker)
    grant = lease_step(api, worker)
    assert post_step(worker, grant).status_code == 200  # the seeds
    grant = lease_step(api, worker)  # round 2: it does not ask for the all-baseline step
    good = step_result(grant["trial"], seconds)
    sneaky = json.loads(json.dumps(good))
    sneaky["variants"].append(dict(good["variants"][1], name="baseline"))
    refused = worker.post(f"/v1/trials/{grant['trial']['id']}/result",
                          json={"lease_id": grant["lease"]["id"], "step": sneaky})
    assert refused.status_code == 422 and "'baseline' is not one of them" in refused.text
    graded = json.loads(json.dumps(good)) | {"confirmation": good["variants"][:2]}
    refused = worker.post(f"/v1/trials/{grant['trial']['id']}/result",
                          json={"lease_id": grant["lease"]["id"], "step": graded})
    assert refused.status_code == 422 and "asks for no confirmation" in refused.text
    assert post_step(worker, grant).status_code == 200  # the real result is still taken
    trials = api.reader.get(f"/v1/studies/{grant['trial']['study_id']}/trials").json()
    assert [t["state"] for t in trials] == ["completed", "completed", "pending"]


def test_a_worker_loop_runs_the_search_to_its_end(api):
    """What any worker does (conftest's `run_trial`: every variant at the tuned step's time): nothing beats the
    op-level winners, so the search keeps them and the grading reports them."""
    created = api.admin.post("/v1/studies", json=TINY | {"step": {"search_rounds": 2}}).json()
    worker = register(api.worker)
    while run_trial(worker) is not None:
        pass
    study = api.reader.get(f"/v1/studies/{created['studies'][-1]['id']}").json()
    assert study["state"] == "completed" and study["decision"]["variant"] == "tuned"
    assert study["trials_done"] == 3 and study["decision"]["rounds"] == 2
