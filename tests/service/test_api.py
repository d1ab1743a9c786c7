"""API contract: every test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import func, select

from cmtune.service.models import Study, Submission, Trial
from collective_matmul import Decomposition
from collective_matmul.wire.bundle import Bundle
from collective_matmul.wire.lookup import NOT_MEASURED
from tests.service.conftest import HARDWARE, PROBLEM, Worker, make_api, measurement, register, report, run_trial


def create(client, **body):
    payload = {"problem": PROBLEM, "hardware": HARDWARE, "budget": {"trials": 6}} | body
    return client.post("/v1/studies", json=payload)


def test_study_from_a_problem_and_dedup(api):
    first = create(api.admin)
    assert first.status_code == 201, first.text
    (study,) = first.json()["studies"]
    assert study["state"] == "pending" and study["space_size"] == 49 and study["trials_budget"] == 6
    again = create(api.admin)
    assert again.json()["studies"] == []
    assert again.json()["skipped"] == [{"problem": "allgather_matmul:256x64x128:float32:8",
                                        "study_id": study["id"], "reason": "under study"}]
    forced = create(api.admin, force=True)
    assert len(forced.json()["studies"]) == 1
    listed = api.reader.get("/v1/studies", params={"state": "pending"}).json()
    assert listed["total"] == 2


def test_studies_from_a_model_and_mesh_with_submission(api):
    body = {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}}, "hardware": HARDWARE,
            "budget": {"trials": 4}}
    response = api.admin.post("/v1/studies", json=body)
    assert response.status_code == 201, response.text
    created = response.json()
    # tiny preset: 12 roles (4 forward, 4 grad_input, 4 grad_weight), 9 problems; and the step study
    assert [s["kind"] for s in created["studies"]] == ["search"] * 9 + ["step"]
    assert created["studies"][-1]["problem_key"] == "step:tiny"
    sub = api.reader.get(f"/v1/submissions/{created['submission_id']}").json()
    roles = {e["role"] for e in sub["entries"]}
    assert {"qkv", "attn_out", "mlp_up", "mlp_up.grad_input"} <= roles
    assert sum(e["count"] for e in sub["entries"]) == 12
    assert sub["saved_s_per_step"] is None  # nothing tuned yet
    listed = api.reader.get("/v1/submissions").json()
    assert [(s["id"], s["name"], s["problems"]) for s in listed] == [(created["submission_id"], "tiny", 9)]
    # the same model again joins the submission being measured; without a step measurement it links the
    # existing studies instead of creating new ones
    again = api.admin.post("/v1/studies", json=body).json()
    assert again["joined"] and again["studies"] == [] and again["submission_id"] == created["submission_id"]
    unmeasured = api.admin.post("/v1/studies", json=body | {"step": {"measure": False}}).json()
    assert unmeasured["studies"] == [] and len(unmeasured["skipped"]) == 9 and not unmeasured["joined"]


def test_lease_result_tell_cycle(api):
    create(api.admin)
    worker = register(api.worker)
    seen = []
    for _ in range(3):
        grant = run_trial(worker)
        seen.append(grant["trial"]["decomposition"]["method"] + str(grant["trial"]["decomposition"]))
    assert len(set(seen)) == 3  # each lease asked Optuna for a new candidate
    assert seen[0].startswith("baseline")
    study = api.reader.get("/v1/studies/1").json()
    assert study["state"] == "running" and study["trials_done"] == 3
    trials = api.reader.get("/v1/studies/1/trials").json()
    # three results, and the engine keeps two proposals ready so that the next lease is a claim
    assert [t["state"] for t in trials] == ["completed"] * 3 + ["pending"] * api.settings.ready_proposals
    assert trials[1]["speedup"] == pytest.approx(1 / trials[1]["ratio"])
    workers = api.reader.get("/v1/workers").json()
    assert workers[0]["trials_done"] == 3 and workers[0]["online"]


def test_a_result_can_lease_the_workers_next_trial(api):
    create(api.admin)
    worker, other = register(api.worker, "w"), register(api.worker, "other")
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    trial = grant["trial"]
    body = {"lease_id": grant["lease"]["id"], "lease_next": True,
            "measurement": measurement(PROBLEM, Decomposition.model_validate(trial["decomposition"]), 1.0)}
    reply = worker.post(f"/v1/trials/{trial['id']}/result", json=body).json()
    assert reply["state"] == "completed" and reply["next"]["trial"]["id"] != trial["id"]
    following = reply["next"]
    # the next trial is this worker's lease: another worker cannot report it, this one can
    foreign = {"lease_id": following["lease"]["id"], "measurement": measurement(
        PROBLEM, Decomposition.model_validate(following["trial"]["decomposition"]), 0.9)}
    assert other.post(f"/v1/trials/{following['trial']['id']}/result", json=foreign).status_code == 409
    done = worker.post(f"/v1/trials/{following['trial']['id']}/result", json=foreign).json()
    assert done["state"] == "completed" and done["next"] is None  # not asked for
    # the same result twice (its answer was lost) answers the lease the worker already holds
    third = worker.post(f"/v1/workers/{worker}/lease").json()
    again = worker.post(f"/v1/trials/{trial['id']}/result", json=body).json()
    assert again["duplicate"] is True and again["next"]["lease"]["id"] == third["lease"]["id"]
    trials = api.reader.get("/v1/studies/1/trials").json()
    assert sum(t["state"] == "leased" for t in trials) == 1


def test_results_that_lease_the_next_trial_end_their_leases_and_count_them(api):
    """With ``lease_next`` a result's lease ends as the next claim runs (on PostgreSQL in the claim's own
    statement): every lease ends and counts once for its worker, the last one too, which claims nothing."""
    create(api.admin, budget={"trials": 4}, confirm_top=1)
    worker = register(api.worker)
    grant, ended = worker.post(f"/v1/workers/{worker}/lease").json(), []
    while grant is not None:
        ended.append(grant["lease"]["id"])
        grant = report(worker, grant, lease_next=True)["next"]
    assert len(ended) == 5  # four searched and the confirmation
    assert api.reader.get("/v1/studies/1").json()["state"] == "completed"
    assert api.reader.get("/v1/workers").json()[0]["trials_done"] == 5
    for lease_id in ended:  # a heartbeat extends a live lease only
        assert worker.post(f"/v1/workers/{worker}/heartbeat", json={"lease_id": lease_id}).json()["lease"] is None


def test_completion_with_confirmation_writes_the_tuned_config(api):
    study_id = create(api.admin, budget={"trials": 8}, confirm_top=2).json()["studies"][0]["id"]
    worker = register(api.worker)
    kinds = []
    while (grant := run_trial(worker)) is not None:
        kinds.append(grant["trial"]["kind"])
    assert kinds == ["search"] * 8 + ["confirm"]
    study = api.reader.get(f"/v1/studies/{study_id}").json()
    assert study["state"] == "completed" and study["stop_reason"] == "trial budget"
    tuned = study["tuned"]
    assert tuned["trials"] == 8 and tuned["space_size"] == 49
    assert tuned["decomposition"] == study["best"]["decomposition"]
    confirm = api.reader.get(f"/v1/studies/{study_id}/trials").json()[-1]
    assert confirm["kind"] == "confirm" and len(confirm["decompositions"]) == 3  # baseline + top 2
    answer = api.reader.get("/v1/configs", params={**PROBLEM, "platform": "cpu", "device_kind": "cpu"}).json()
    assert answer["match"] == "exact" and answer["decomposition"] == tuned["decomposition"]
    assert answer["speedup"] == pytest.approx(tuned["speedup"])


def test_lease_expiry_and_re_lease(database_url):
    api = make_api(database_url, lease_seconds=0.3, max_attempts=2)
    try:
        create(api.admin)
        a, b = register(api.worker, "a"), register(api.worker, "b")
        first = a.post(f"/v1/workers/{a}/lease").json()
        time.sleep(0.5)
        second = b.post(f"/v1/workers/{b}/lease").json()
        assert second["trial"]["id"] == first["trial"]["id"]  # returned to the queue, leased again
        # the first worker's late report is refused; the second's is stored
        late = {"lease_id": first["lease"]["id"], "measurement": measurement(
            PROBLEM, Decomposition.baseline(), 1.0)}
        assert a.post(f"/v1/trials/{first['trial']['id']}/result", json=late).status_code == 409
        time.sleep(0.5)  # expires again: the attempt limit (2) is reached, the trial fails
        third = a.post(f"/v1/workers/{a}/lease").json()
        assert third["trial"]["id"] != first["trial"]["id"]
        trials = api.reader.get("/v1/studies/1/trials").json()
        assert trials[0]["state"] == "failed" and trials[0]["attempts"] == 2
        assert "lease expired 2 times" in trials[0]["message"]
    finally:
        api.db.dispose()


def test_heartbeat_extends_a_lease(database_url):
    api = make_api(database_url, lease_seconds=1.0)
    try:
        create(api.admin)
        a, b = register(api.worker, "a"), register(api.worker, "b")
        grant = a.post(f"/v1/workers/{a}/lease").json()
        for _ in range(4):  # 1.6 s in all: the lease lives on heartbeats only
            time.sleep(0.4)
            beat = a.post(f"/v1/workers/{a}/heartbeat", json={"lease_id": grant["lease"]["id"]})
            assert beat.json()["lease"]["id"] == grant["lease"]["id"]
        other = b.post(f"/v1/workers/{b}/lease").json()
        assert other["trial"]["id"] != grant["trial"]["id"]
    finally:
        api.db.dispose()


def test_idempotent_and_stale_reports(api):
    create(api.admin)
    worker = register(api.worker)
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    body = {"lease_id": grant["lease"]["id"], "measurement": measurement(PROBLEM, Decomposition.baseline(), 1.0)}
    url = f"/v1/trials/{grant['trial']['id']}/result"
    first, second = worker.post(url, json=body), worker.post(url, json=body)
    assert first.json() == {"trial_id": grant["trial"]["id"], "state": "completed", "duplicate": False,
                            "next": None}
    assert second.status_code == 200 and second.json()["duplicate"] is True
    with api.db.transaction() as connection:  # counted once
        assert connection.scalar(select(func.count()).select_from(Trial).where(Trial.state == "completed")) == 1
    foreign = {"lease_id": "00000000-0000-0000-0000-000000000000", "measurement": body["measurement"]}
    assert worker.post(url, json=foreign).status_code == 409
    wrong = {"lease_id": grant["lease"]["id"],
             "measurement": measurement(PROBLEM, Decomposition(chunks=2, accumulate="concat"), 0.9)}
    next_grant = worker.post(f"/v1/workers/{worker}/lease").json()
    mismatch = worker.post(f"/v1/trials/{next_grant['trial']['id']}/result",
                               json=wrong | {"lease_id": next_grant["lease"]["id"]})
    assert mismatch.status_code in (409, 422)


def test_config_fallbacks(api):
    from collective_matmul import Hardware, Problem
    from collective_matmul.wire.bundle import TunedConfig

    tuned_problem = Problem(**PROBLEM)
    config = Decomposition(direction="bidirectional", chunks=2, unroll="full", accumulate="update_slice")
    with api.store.write() as tx:
        tx.save_tuned(TunedConfig(problem=tuned_problem, hardware=Hardware(**HARDWARE), decomposition=config,
                                  time_s=1e-3, baseline_s=2e-3, speedup=2.0), study_id=None)
    params = {**PROBLEM, "platform": "cpu", "device_kind": "cpu"}
    exact = api.reader.get("/v1/configs", params=params).json()
    assert (exact["match"], exact["speedup"]) == ("exact", 2.0)
    nearest = api.reader.get("/v1/configs", params=params | {"m": 512}).json()
    assert nearest["match"] == "nearest" and nearest["decomposition"]["direction"] == "bidirectional"
    assert nearest["source_problem"]["m"] == 256
    other = api.reader.get("/v1/configs", params=params | {"device_kind": "other-cpu"}).json()  # nothing measured
    assert (other["match"], other["decomposition"]["method"]) == ("baseline", "baseline")
    assert other["reason"].startswith(NOT_MEASURED) and other["speedup"] is None
    model = api.reader.get("/v1/configs", params=params | {"collective": "matmul_reduce_scatter",
                                                            "unmeasured": "costmodel"}).json()
    assert model["match"] == "model" and model["reason"].startswith(NOT_MEASURED)
    no_figures = api.reader.get("/v1/configs", params=params | {"platform": "neuron", "device_kind": "trn1",
                                                                 "unmeasured": "costmodel"}).json()
    assert no_figures["match"] == "baseline" and no_figures["decomposition"]["method"] == "baseline"
    assert "no cost-model figures for device kind 'trn1'" in no_figures["reason"]
    assert api.reader.get("/v1/configs", params=params | {"unmeasured": "model"}).status_code == 422
    queries = {"queries": [{"problem": PROBLEM, "platform": "cpu", "device_kind": "cpu"},
                           {"problem": PROBLEM | {"m": 512}, "platform": "cpu", "device_kind": "cpu"},
                           {"problem": PROBLEM, "platform": "cpu", "device_kind": "other-cpu"}]}
    batch = api.reader.post("/v1/configs/query", json=queries).json()
    assert [a["match"] for a in batch] == ["exact", "nearest", "baseline"]
    asked = api.reader.post("/v1/configs/query", json=queries, params={"unmeasured": "costmodel"}).json()
    assert [a["match"] for a in asked] == ["exact", "nearest", "baseline"]  # other-cpu: no cost-model figures
    assert "no cost-model figures for device kind 'other-cpu'" in asked[2]["reason"]


def test_nothing_measured_answers_the_baseline_on_every_platform_unless_the_model_is_asked_for(api):
    from collective_matmul.wire.bundle import TunedConfig
    from tests.collective_matmul.test_lookup import BIG, MEASURED_ON, PLATFORMS

    with api.store.write() as tx:  # measured on another hardware only: it answers none of the look-ups below
        tx.save_tuned(TunedConfig(problem=BIG, hardware=MEASURED_ON, decomposition=Decomposition(chunks=2),
                                  time_s=1e-3, baseline_s=2e-3, speedup=2.0), study_id=None)
    singles = [BIG.model_dump() | {"platform": h.platform, "device_kind": h.device_kind} for h in PLATFORMS]
    queries = {"queries": [{"problem": BIG.model_dump(), "platform": h.platform, "device_kind": h.device_kind}
                           for h in PLATFORMS]}

    def answers(asked: dict) -> list[list[dict]]:
        return [[api.reader.get("/v1/configs", params=single | asked).json() for single in singles],
                api.reader.post("/v1/configs/query", json=queries, params=asked).json()]

    for asked in ({}, {"unmeasured": "baseline"}):
        for found in answers(asked):
            # on TPU and GPU, where XLA decomposes it itself, the unmeasured baseline is the product as written
            assert [(a["match"], a["decomposition_id"]) for a in found] == [
                ("baseline", "baseline"), *[("baseline", "xla")] * (len(PLATFORMS) - 1)], found
            assert all(a["reason"].startswith(NOT_MEASURED) and a["speedup"] is None for a in found)
    for found in answers({"unmeasured": "costmodel"}):
        assert [a["match"] for a in found] == ["model"] * len(PLATFORMS)
        # the cpu profile never overlaps; on TPU and GPU the model picks a ring no one has timed
        assert [a["decomposition"]["method"] for a in found] == ["baseline", "ring", "ring", "ring"]
    spec = api.anonymous.get("/openapi.json").json()["paths"]
    for path, method in (("/v1/configs", "get"), ("/v1/configs/query", "post")):
        (declared,) = [p for p in spec[path][method]["parameters"] if p["name"] == "unmeasured"]
        assert declared["in"] == "query" and not declared["required"] and declared["schema"]["default"] == "baseline"
        assert declared["schema"]["enum"] == ["baseline", "costmodel"] and "not measured" in declared["description"]


def test_bundle_round_trip(api, tmp_path):
    study_id = create(api.admin, budget={"trials": 4}).json()["studies"][0]["id"]
    worker = register(api.worker)
    while run_trial(worker):
        pass
    exported = api.reader.get("/v1/bundles", params={"platform": "cpu"})
    bundle = Bundle.model_validate(exported.json())
    assert len(bundle.configs) == 1 and bundle.configs[0].trials == 4
    other = make_api(f"sqlite:///{tmp_path / 'other.sqlite'}")
    try:
        assert other.admin.post("/v1/bundles", json=exported.json()).status_code == 201
        answer = other.reader.get("/v1/configs", params={**PROBLEM, "platform": "cpu", "device_kind": "cpu"}).json()
        assert answer["match"] == "exact"
        assert answer["decomposition"] == bundle.configs[0].decomposition.model_dump(mode="json")
        bad = exported.json() | {"configs": [exported.json()["configs"][0] | {"speedup": -1}]}
        assert other.admin.post("/v1/bundles", json=bad).status_code == 422
    finally:
        other.db.dispose()
    assert study_id


def test_restart_with_a_study_in_flight(database_url):
    first = make_api(database_url)
    create(first.admin, budget={"trials": 5})
    worker = register(first.worker)
    run_trial(worker)
    leased = worker.post(f"/v1/workers/{worker}/lease").json()  # in flight across the restart
    first.db.dispose()

    second = make_api(database_url)
    try:
        body = {"lease_id": leased["lease"]["id"], "measurement": measurement(
            PROBLEM, Decomposition.model_validate(leased["trial"]["decomposition"]), 0.9)}
        again = Worker(worker.id, worker.credential, second.worker)  # the same worker, after the restart
        assert again.post(f"/v1/trials/{leased['trial']['id']}/result", json=body).status_code == 200
        while run_trial(again):
            pass
        study = second.reader.get("/v1/studies/1").json()
        assert study["state"] == "completed" and study["trials_done"] == 5
    finally:
        second.db.dispose()


@pytest.mark.parametrize(
    "body, message",
    [
        ({"problem": PROBLEM | {"m": 1001}}, "m=1001 is not divisible by axis_size=8"),
        ({"problem": PROBLEM | {"k": -4}}, "greater than 0"),
        ({"problem": PROBLEM | {"n": 1 << 40}}, "less than or equal to 16777216"),
        ({"problem": PROBLEM | {"collective": "allreduce"}}, "allgather_matmul"),
        ({"problem": PROBLEM | {"dtype": "int4"}}, "bfloat16"),
        ({"problem": PROBLEM | {"m": 384, "n": 192, "axis_size": 3}},
         "ring of 3 devices, which does not divide the hardware's device_count=8: a worker tunes the rings its "
         "devices split into, so submit to hardware whose device_count is a multiple of 3"),
        ({"model": "tiny", "mesh": {"axes": {"data": 3, "model": 8}}}, "global_batch=4 is not divisible"),
        ({"model": "gpt-5"}, "'model' needs 'mesh'"),
        ({"model": "gpt-5", "mesh": {"axes": {"model": 8}}}, "unknown model 'gpt-5'"),
        ({"budget": {"trials": 0}}, "greater than or equal to 1"),
    ],
)
def test_bad_bodies_get_4xx_with_a_useful_message_and_store_nothing(api, body, message):
    payload = {"problem": PROBLEM, "hardware": HARDWARE} | body
    if "model" in body:
        payload.pop("problem")
    response = api.admin.post("/v1/studies", json=payload)
    assert response.status_code == 422, response.text
    assert message in response.text
    with api.db.transaction() as connection:
        assert connection.scalar(select(func.count()).select_from(Study)) == 0
        assert connection.scalar(select(func.count()).select_from(Submission)) == 0


def test_malformed_json_and_unknown_ids(api):
    response = api.admin.post("/v1/studies", content=b'{"problem": ', headers={"content-type": "application/json"})
    assert response.status_code == 422 and "JSON" in response.text
    assert api.reader.get("/v1/studies/999").json() == {"detail": "study 999 does not exist"}
    assert api.worker.post("/v1/workers/999/lease").status_code == 401  # no credential: no worker at all
    assert api.reader.get("/v1/configs", params={**PROBLEM, "m": 1001, "platform": "cpu",
                                                 "device_kind": "cpu"}).status_code == 422


def test_auth_per_role(api):
    assert api.anonymous.get("/v1/studies").status_code == 401
    assert "Bearer" in api.anonymous.get("/v1/studies").json()["detail"]
    assert create(api.reader).status_code == 403
    assert create(api.worker).status_code == 403
    assert create(api.admin).status_code == 201
    assert api.reader.post("/v1/workers", json={"name": "x", "hardware": HARDWARE}).status_code == 403
    worker = register(api.worker)
    assert api.reader.post(f"/v1/workers/{worker}/lease").status_code == 403
    assert api.reader.get("/v1/studies").status_code == 200
    assert api.reader.post("/v1/bundles", json={"configs": []}).status_code == 403
    assert api.reader.post("/v1/studies/1/cancel").status_code == 403
    assert api.admin.post("/v1/studies/1/cancel").json()["state"] == "cancelled"
    bogus = api.anonymous.get("/v1/studies", headers={"Authorization": "Bearer nope"})
    assert bogus.status_code == 401 and "unknown or revoked" in bogus.text


def test_unregister_gives_the_trial_back(api):
    create(api.admin)
    a, b = register(api.worker, "a"), register(api.worker, "b")
    grant = a.post(f"/v1/workers/{a}/lease").json()
    assert a.delete(f"/v1/workers/{a}").status_code == 204
    again = b.post(f"/v1/workers/{b}/lease").json()
    assert again["trial"]["id"] == grant["trial"]["id"]
    assert a.post(f"/v1/workers/{a}/lease").status_code in (401, 404)  # it left: register again


def test_healthz_metrics_and_openapi_examples(api):
    assert api.anonymous.get("/healthz").json()["status"] == "ok"
    create(api.admin)
    text = api.anonymous.get("/metrics").text
    assert 'cmtune_studies{state="pending"} 1.0' in text
    assert "cmtune_http_request_seconds_bucket" in text and "cmtune_workers_online" in text
    spec = api.anonymous.get("/openapi.json").json()
    for name in ("StudyCreate", "WorkerCreate"):
        assert spec["components"]["schemas"][name].get("examples"), name


def test_cancel_refuses_late_results_and_stops_leasing(api):
    study_id = create(api.admin).json()["studies"][0]["id"]
    worker = register(api.worker)
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    assert api.admin.post(f"/v1/studies/{study_id}/cancel").json()["state"] == "cancelled"
    late = worker.post(f"/v1/trials/{grant['trial']['id']}/result", json={
        "lease_id": grant["lease"]["id"], "measurement": measurement(PROBLEM, Decomposition.baseline(), 1.0)})
    assert late.status_code == 409 and "cancelled" in late.json()["detail"]
    assert worker.post(f"/v1/workers/{worker}/lease").status_code == 204
    assert api.admin.post(f"/v1/studies/{study_id}/cancel").status_code == 409


def test_listing_studies_costs_the_same_queries_for_one_study_or_many(api):
    """GET /v1/studies reads progress from the study rows: no query per study."""
    from sqlalchemy import event

    statements = []

    def count(conn, cursor, statement, *args):
        statements.append(statement)

    def queries_for_listing() -> int:
        statements.clear()
        event.listen(api.db.engine, "before_cursor_execute", count)
        try:
            assert api.reader.get("/v1/studies", params={"limit": 500}).status_code == 200
        finally:
            event.remove(api.db.engine, "before_cursor_execute", count)
        return len(statements)

    create(api.admin)
    worker = register(api.worker)
    run_trial(worker)
    api.reader.get("/v1/studies")  # the reader's token is checked once, then cached
    one = queries_for_listing()
    first = list(statements)
    for m in range(2, 22):
        create(api.admin, problem=PROBLEM | {"m": 256 * m})
    for _ in range(10):
        run_trial(worker)
    assert api.reader.get("/v1/studies").json()["total"] == 21
    many = queries_for_listing()
    assert many == one <= 6, (first, statements)


def test_the_step_study_measures_the_model_once_its_studies_are_done(api):
    body = {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}}, "hardware": HARDWARE,
            "budget": {"trials": 4}, "confirm_top": 1, "step": {"search_rounds": 1}}  # one round of the menu
    created = api.admin.post("/v1/studies", json=body).json()
    step_id = created["studies"][-1]["id"]
    worker = register(api.worker)
    grants = []
    while (grant := run_trial(worker)) is not None:
        grants.append(grant)
    kinds = [g["trial"]["kind"] for g in grants]
    assert kinds[-1] == "step" and kinds.count("step") == 1  # after every search study, never before
    task = grants[-1]["trial"]
    assert set(task["step"]["configs"]) == {"qkv", "attn_out", "mlp_up", "mlp_down"}
    assert task["step"]["block"]["name"] == "tiny" and task["step"]["mesh"] == {"data": 1, "model": 8}
    study = api.reader.get(f"/v1/studies/{step_id}").json()
    assert study["state"] == "completed" and study["stop_reason"] == "measured"
    decision = study["decision"]
    assert decision["variant"] == "tuned" and decision["vs_reference"]["median"] == pytest.approx(1.25)
    sub = api.reader.get(f"/v1/submissions/{created['submission_id']}").json()
    step = sub["step"]
    assert step["variant"] == "tuned" and step["vs_reference"]["median"] == pytest.approx(1.25)
    assert step["vs_baseline"]["median"] == pytest.approx(0.95 / 0.8)
    assert step["measured_saved_s_per_step"] == pytest.approx((0.95 - 0.8) * 2)  # two layers
    assert sub["overrides"] == []


def test_a_role_faster_at_the_baseline_is_set_back_for_this_model(api):
    from tests.service.conftest import step_result

    body = {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}}, "hardware": HARDWARE,
            "budget": {"trials": 2}, "confirm_top": 1, "step": {"search_rounds": 1}}  # one round of the menu
    created = api.admin.post("/v1/studies", json=body).json()
    worker = register(api.worker)
    while (grant := worker.post(f"/v1/workers/{worker}/lease").json())["trial"]["kind"] != "step":
        configs = [Decomposition.model_validate(d) for d in grant["trial"]["decompositions"]]
        payload = {"lease_id": grant["lease"]["id"]}
        results = [measurement(grant["trial"]["problem"], c, 0.8 if c.method == "ring" else 1.0) for c in configs]
        payload |= {"measurement": results[0]} if grant["trial"]["kind"] == "search" else {"measurements": results}
        assert worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=payload).status_code == 200
    seconds = {"as-written": 1.0, "baseline": 0.95, "tuned": 0.8, "tuned-minus-mlp_up": 0.7,
               "tuned-minus-qkv": 0.85}
    fresh = {"as-written": 1.0, "baseline": 0.95, "tuned-minus-mlp_up": 0.75}
    result = {"lease_id": grant["lease"]["id"], "step": step_result(grant["trial"], seconds, confirmation=fresh)}
    # a confirmation must re-time variants as they were measured
    forged = json.loads(json.dumps(result))
    forged["step"]["confirmation"][2]["configs"] = {}
    response = worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=forged)
    assert response.status_code == 422 and "measured other configs than the trial gave it" in response.text
    assert worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=result).status_code == 200
    sub = api.reader.get(f"/v1/submissions/{created['submission_id']}").json()
    assert sub["step"]["variant"] == "tuned-minus-mlp_up"
    # chosen from the deciding rounds, reported from the fresh ones
    assert sub["step"]["vs_reference"]["median"] == pytest.approx(1 / 0.75)
    assert sub["step"]["vs_baseline"]["median"] == pytest.approx(0.95 / 0.75)
    assert [v["name"] for v in sub["step"]["confirmation"]] == list(fresh)
    (override,) = sub["overrides"]
    assert override["role"] == "mlp_up" and override["model"] == "tiny"
    assert override["configs"]["forward"]["method"] == "baseline"
    assert "set back to the baseline" in override["reason"] and "1.14x" in override["reason"]
    # a training client of this model finds it; a bundle carries it
    params = {"model": "tiny", "platform": "cpu", "device_kind": "cpu", "device_count": 8}
    assert api.reader.get("/v1/overrides", params=params).json() == sub["overrides"]
    assert api.reader.get("/v1/bundles").json()["overrides"] == sub["overrides"]


@contextmanager
def statements_of(api) -> Iterator[list[str]]:
    """The statements the app sends meanwhile (one line each; transaction control left out)."""
    from sqlalchemy import event

    statements: list[str] = []

    def count(_conn, _cursor, statement, *_):
        if not statement.startswith(("BEGIN", "SAVEPOINT", "RELEASE")):
            statements.append(" ".join(statement.split()))

    event.listen(api.db.engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(api.db.engine, "before_cursor_execute", count)


def test_creating_a_study_of_a_new_problem_costs_a_fixed_handful_of_statements(api):
    """Keys are looked up once per transaction, a new problem has no study or tuned config to find, a new
    study no history to read and nothing leased or tuned to show: its memory check, two key look-ups,
    its tuned neighbours (warm start), the problem, the study and its first proposals."""
    assert create(api.admin, problem=PROBLEM | {"m": 512}).status_code == 201  # the hardware row exists
    with statements_of(api) as statements:
        reply = create(api.admin, problem=PROBLEM | {"m": 1024})
    assert reply.status_code == 201, reply.text
    assert len(statements) <= 7, "\n".join(statements)


def test_a_lease_and_report_cycle_costs_a_fixed_handful_of_statements(api):
    """The lease path is a claim (the proposals are queued in advance) and a result's first statement
    locks its trial, lease and study at once: a cycle reads no study row of its own, and its number of
    statements does not grow with the study's history."""
    create(api.admin, budget={"trials": 12})
    worker = register(api.worker)
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    per_cycle = []
    for _ in range(6):
        trial = grant["trial"]
        config = Decomposition.model_validate(trial["decomposition"])
        body = {"lease_id": grant["lease"]["id"], "lease_next": True,
                "measurement": measurement(PROBLEM, config, 1.0 if config.method == "baseline" else 0.9)}
        with statements_of(api) as statements:
            grant = worker.post(f"/v1/trials/{trial['id']}/result", json=body).json()["next"]
        per_cycle.append(statements)
    postgres = api.db.is_postgres
    for cycle in per_cycle:  # (one more where the once-a-second scan for expired leases falls)
        assert not any(s.startswith("SELECT studies.") for s in cycle) or not postgres, cycle
        assert len(cycle) <= (6 if postgres else 11), "\n".join(cycle)


DISCOVERED_ROLE = "Model/layers/attention/qkv_projection"  # longer than the block's roles: an open label


def discovered_body(**changes) -> dict:
    problems = [
        {"role": DISCOVERED_ROLE, "slot": "forward", "count": 24, "axis": "model", "source": "model.py:42",
         "problem": PROBLEM},
        {"role": DISCOVERED_ROLE, "slot": "grad_weight", "count": 24, "axis": "model",
         "problem": PROBLEM | {"collective": "allgather_grad_weight"}},
        {"role": "model.py:57", "slot": "grad_input", "count": 24, "axis": "model", "problem": PROBLEM},
    ]
    step = {"name": "my_gpt", "mesh": {"data": 2, "model": 8}, "problems": problems} | changes
    return {"discovered": step, "hardware": HARDWARE, "budget": {"trials": 4}}


def test_a_discovered_step_becomes_studies_and_a_submission_with_its_roles(api):
    created = api.admin.post("/v1/studies", json=discovered_body())
    assert created.status_code == 201, created.text
    body = created.json()
    assert {s["problem_key"] for s in body["studies"]} == {"allgather_matmul:256x64x128:float32:8",
                                                           "allgather_grad_weight:256x64x128:float32:8"}
    assert not any(s["kind"] == "step" for s in body["studies"])  # the service never runs a user's step
    sub = api.reader.get(f"/v1/submissions/{body['submission_id']}").json()
    assert sub["name"] == "my_gpt" and sub["mesh"]["axes"] == {"data": 2, "model": 8} and sub["step"] is None
    roles = {e["problem_key"]: (e["roles"], e["count"]) for e in sub["entries"]}
    assert roles["allgather_matmul:256x64x128:float32:8"] == ([DISCOVERED_ROLE, "model.py:57.grad_input"], 48)
    assert roles["allgather_grad_weight:256x64x128:float32:8"] == ([f"{DISCOVERED_ROLE}.grad_weight"], 24)


@pytest.mark.parametrize("changes, message", [
    ({"mesh": {"data": 2}}, "not in the mesh"),
    ({"name": "bad\nname"}, "name"),
    ({"problems": [{"role": "x" * 201, "slot": "forward", "count": 1, "problem": PROBLEM}]}, "role"),
    ({"problems": [{"role": "r\x00", "slot": "forward", "count": 1, "problem": PROBLEM}]}, "role"),
    ({"problems": [{"role": "r", "slot": "sideways", "count": 1, "problem": PROBLEM}]}, "slot"),
    ({"problems": []}, "problems"),
])
def test_a_bad_discovered_step_is_refused_and_stores_nothing(api, changes, message):
    response = api.admin.post("/v1/studies", json=discovered_body(**changes))
    assert response.status_code == 422 and message in response.text
    with api.db.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Study)).scalar() == 0
        assert conn.execute(select(func.count()).select_from(Submission)).scalar() == 0


def test_an_imported_decision_of_a_users_step_is_checked_against_its_problems(api):
    from collective_matmul.planning.models import slot_problems

    problems = {slot: p.model_dump() for slot, p in slot_problems(
        "allgather_matmul", m=256, k=64, n=128, dtype="float32", axis_size=8).items()}
    ring = {"forward": {"method": "ring", "chunks": 2}, "grad_input": {"method": "baseline"},
            "grad_weight": {"method": "baseline", "fuse": True}}
    override = {"model": "my_gpt", "role": DISCOVERED_ROLE, "hardware": HARDWARE, "configs": ring,
                "reason": "verify --decide: the tuned step was faster", "step_speedup": 1.2, "problems": problems}
    bad = override | {"role": "model.py:57", "configs": ring | {"forward": {"method": "ring", "chunks": 64}}}
    refused = api.admin.post("/v1/bundles", json={"overrides": [override, bad]})
    assert refused.status_code == 422 and "chunks=64 does not divide a block of 32 rows" in refused.text
    assert api.reader.get("/v1/overrides", params={"model": "my_gpt", **HARDWARE}).json() == []  # all or nothing
    assert api.admin.post("/v1/bundles", json={"overrides": [override]}).status_code == 201
    (stored,) = api.reader.get("/v1/overrides", params={"model": "my_gpt", **HARDWARE}).json()
    assert stored["role"] == DISCOVERED_ROLE and stored["problems"]["forward"] == problems["forward"]
    assert api.reader.get("/v1/bundles").json()["overrides"] == [stored]  # exported as imported


def test_a_discovered_step_with_a_mesh_beside_it_or_too_many_runs_is_refused(api):
    body = discovered_body() | {"mesh": {"axes": {"model": 8}}}
    assert api.admin.post("/v1/studies", json=body).status_code == 422
    problems = [{"role": f"r{i}", "slot": "forward", "count": 1 << 30, "problem": PROBLEM} for i in range(3)]
    response = api.admin.post("/v1/studies", json=discovered_body(problems=problems))
    assert response.status_code == 422 and "runs 2147483648 times per step in all: at most 2147483647" in response.text


def test_an_override_imported_twice_in_one_bundle_counts_once(api):
    from collective_matmul.planning.models import slot_problems

    problems = {slot: p.model_dump() for slot, p in slot_problems(**PROBLEM).items()}
    override = {"model": "m", "role": "r", "hardware": HARDWARE, "reason": "first", "problems": problems,
                "configs": {"forward": {"method": "baseline"}}}
    twice = {"overrides": [override, override | {"reason": "second"}]}
    assert api.admin.post("/v1/bundles", json=twice).status_code == 201
    (stored,) = api.reader.get("/v1/overrides", params={"model": "m", **HARDWARE}).json()
    assert stored["reason"] == "second"


def test_a_confirmations_bounds_reach_the_study_the_trials_the_answers_and_bundles(api, tmp_path):
    study_id = create(api.admin, budget={"trials": 4}, confirm_top=1).json()["studies"][0]["id"]
    worker = register(api.worker)
    while run_trial(worker, bounds_s=(0.5e-3, 0.3e-3, 1e-3)):
        pass
    study = api.reader.get(f"/v1/studies/{study_id}").json()
    tuned = study["tuned"]
    assert (tuned["compute_s"], tuned["communication_s"], tuned["bounds_baseline_s"]) == (0.5e-3, 0.3e-3, 1e-3)
    ratio = tuned["time_s"] / tuned["baseline_s"]
    assert tuned["bound_s"] == 0.5e-3 and tuned["hidden_fraction"] == pytest.approx((1 - ratio) / 0.5)
    assert tuned["reason"].startswith("hides ")
    confirm = api.reader.get(f"/v1/studies/{study_id}/trials").json()[-1]
    assert confirm["kind"] == "confirm" and confirm["bounds"]["compute"]["median_s"] == 0.5e-3
    params = {**PROBLEM, "platform": "cpu", "device_kind": "cpu"}
    answer = api.reader.get("/v1/configs", params=params).json()
    assert answer["match"] == "exact"
    for field in ("compute_s", "communication_s", "bounds_baseline_s", "bound_s", "hidden_fraction", "reason"):
        assert answer[field] == tuned[field], field
    nearest = api.reader.get("/v1/configs", params=params | {"m": 512}).json()
    assert nearest["match"] == "nearest" and nearest["bound_s"] is None  # another problem's bounds are not these
    (listed,) = api.reader.get("/v1/tuned").json()
    assert listed["hidden_fraction"] == tuned["hidden_fraction"] and listed["reason"] == tuned["reason"]
    exported = api.reader.get("/v1/bundles").json()
    assert exported["configs"][0]["bound_s"] == 0.5e-3
    other = make_api(f"sqlite:///{tmp_path / 'other.sqlite'}")
    try:
        assert other.admin.post("/v1/bundles", json=exported).status_code == 201
        again = other.reader.get("/v1/configs", params=params).json()
        assert (again["compute_s"], again["hidden_fraction"]) == (0.5e-3, answer["hidden_fraction"])
    finally:
        other.db.dispose()
    spec = api.reader.get("/openapi.json").json()["components"]["schemas"]
    for schema in ("ConfigAnswer", "SubmissionEntry"):
        assert {"compute_s", "communication_s", "bound_s", "hidden_fraction", "reason"} <= set(
            spec[schema]["properties"]), schema


def test_a_submissions_entries_carry_their_bounds(api):
    from collective_matmul import Hardware, Problem
    from collective_matmul.wire.bundle import TunedConfig

    body = {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}}, "hardware": HARDWARE,
            "step": {"measure": False}}
    created = api.admin.post("/v1/studies", json=body).json()
    sub = api.reader.get(f"/v1/submissions/{created['submission_id']}").json()
    with api.store.write() as tx:
        for e in sub["entries"]:
            tx.save_tuned(TunedConfig(problem=Problem(**e["problem"]), hardware=Hardware(**HARDWARE),
                                      decomposition=Decomposition.baseline(), time_s=2e-3, baseline_s=2e-3,
                                      speedup=1.0, compute_s=1e-3, communication_s=1.2e-3,
                                      bounds_baseline_s=2.1e-3), study_id=None)
    entries = api.reader.get(f"/v1/submissions/{created['submission_id']}").json()["entries"]
    assert {(e["bound_s"], e["hidden_fraction"]) for e in entries} == {(1.2e-3, 0.0)}
    assert all(e["reason"].startswith("communication-bound") for e in entries)


def test_a_model_on_part_of_the_slice_is_tuned_on_its_rings_by_the_slices_workers(api):
    """A ``data=2, model=4`` mesh on 8 devices: every study is on a ring of 4 of the 8 (``cpu:cpu:4:1/8``), which an
    8-device worker leases and a machine of 4 devices does not; look-ups that name the slice find the configs."""
    body = {"model": "tiny", "mesh": {"axes": {"data": 2, "model": 4}}, "hardware": HARDWARE,
            "budget": {"trials": 3}, "confirm_top": 1}
    created = api.admin.post("/v1/studies", json=body)
    assert created.status_code == 201, created.text
    studies = created.json()["studies"]
    assert {s["hardware_key"] for s in studies} == {"cpu:cpu:4:1/8"} and studies[-1]["kind"] == "step"
    assert {s["problem"]["axis_size"] for s in studies if s["problem"]} == {4}
    small = register(api.worker, "four", hardware=HARDWARE | {"device_count": 4})
    assert small.post(f"/v1/workers/{small}/lease").status_code == 204  # a machine of 4 is other hardware
    worker = register(api.worker, "eight")
    assert api.reader.get("/v1/workers").json()[-1]["ring_keys"] == ["cpu:cpu:8:1", "cpu:cpu:4:1/8",
                                                                       "cpu:cpu:2:1/8"]
    while run_trial(worker) is not None:
        pass
    assert all(api.reader.get(f"/v1/studies/{s['id']}").json()["state"] == "completed" for s in studies)
    submission = api.reader.get(f"/v1/submissions/{created.json()['submission_id']}").json()
    assert submission["hardware_key"] == "cpu:cpu:8:1" and submission["complete"]
    assert submission["step"]["state"] == "completed"
    problem = next(s["problem"] for s in studies if s["problem"])
    where = {"platform": "cpu", "device_kind": "cpu", "device_count": 4}
    found = api.reader.get("/v1/configs", params={**problem, **where, "slice_devices": 8}).json()
    assert found["match"] == "exact" and found["hardware"]["slice_devices"] == 8
    assert api.reader.get("/v1/configs", params={**problem, **where}).json()["match"] != "exact"  # a machine of 4
    overrides = api.reader.get("/v1/overrides", params={"model": "tiny", **where, "slice_devices": 8})
    assert overrides.status_code == 200, overrides.text


@pytest.mark.parametrize("hardware, why", [
    ({"device_count": 3, "slice_devices": 8}, "slice_devices must be a multiple of device_count"),
    ({"device_count": 2, "process_count": 4}, "every process holds at least one device"),
], ids=["ring-not-of-its-slice", "more-processes-than-devices"])
def test_hardware_that_cannot_be_is_refused_saying_why(api, hardware, why):
    """A ring of 3 devices cannot be part of a slice of 8, nor 4 processes hold 2 devices: a 422 that says what to
    fix, on registration and on submission, and nothing is stored."""
    hardware = {"platform": "cpu", "device_kind": "cpu", **hardware}
    registered = api.worker.post("/v1/workers", json={"hardware": hardware, "name": "w"})
    submitted = api.admin.post("/v1/studies", json={"problem": "ag:256x64x128:float32:8", "hardware": hardware})
    for answer in (registered, submitted):
        assert answer.status_code == 422 and why in answer.text
    assert api.reader.get("/v1/workers").json() == [] and api.reader.get("/v1/studies").json()["total"] == 0


def _screen(overlapping: Decomposition, device_kind: str = "cpu", problem: dict = PROBLEM) -> dict:
    """A compile screen of ``problem`` in which only ``overlapping`` overlaps (as a GPU node's compile reads)."""
    from collective_matmul import Problem
    from collective_matmul.planning.space import candidates

    forms = candidates(Problem(**problem), include_baseline=False)
    return {"problem": Problem(**problem).key, "device_kind": device_kind, "screen": [
        {"decomposition": c.model_dump(mode="json"), "overlap": "overlaps" if c == overlapping else "synchronous"}
        for c in forms]}


def test_a_submitted_compile_screen_orders_the_studys_trials(api):
    """The study times the form its screen says overlaps right after the baseline, though the cost model puts it
    last, and keeps the screen in its settings."""
    from collective_matmul import Problem
    from collective_matmul.planning.space import candidates

    last = candidates(Problem(**PROBLEM), include_baseline=False)[-1]
    body = {"problem": PROBLEM, "hardware": HARDWARE, "budget": {"trials": 3}, "warm_start": False,
            "screens": [_screen(last)]}
    created = api.admin.post("/v1/studies", json=body)
    assert created.status_code == 201, created.text
    (study,) = created.json()["studies"]
    assert len(study["settings"]["screen"]) == len(candidates(Problem(**PROBLEM), include_baseline=False))
    worker = register(api.worker)
    timed = [Decomposition.model_validate(run_trial(worker)["trial"]["decompositions"][0]) for _ in range(2)]
    assert timed == [Decomposition.baseline(), last]


@pytest.mark.parametrize("change, message", [
    (lambda s: s | {"problem": "allgather_matmul:512x64x128:float32:8"}, "is not a problem of this submission"),
    (lambda s: s | {"device_kind": "NVIDIA H100 80GB HBM3"}, "was compiled for 'NVIDIA H100 80GB HBM3'"),
    (lambda s: s | {"screen": s["screen"] + [{"decomposition": {"method": "ring", "chunks": 64},
                                              "overlap": "overlaps"}]}, "is not a candidate of the problem on cpu"),
    (lambda s: s | {"screen": []}, "screen"),
])
def test_a_screen_that_does_not_fit_its_submission_is_refused_and_stores_nothing(api, change, message):
    screen = change(_screen(Decomposition.baseline()))
    response = api.admin.post("/v1/studies", json={"problem": PROBLEM, "hardware": HARDWARE, "screens": [screen]})
    assert response.status_code == 422 and message in response.text, response.text
    twice = api.admin.post("/v1/studies", json={"problem": PROBLEM, "hardware": HARDWARE,
                                                "screens": [_screen(Decomposition.baseline())] * 2})
    assert twice.status_code == 422 and "is screened twice" in twice.text
    with api.db.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Study)).scalar() == 0


@pytest.mark.parametrize("collective", ["weight_allgather_matmul_k", "weight_allgather_matmul_n",
                                        "reduce_scatter_grad_weight"])
def test_fsdps_problems_are_studied_under_their_own_keys(api, collective):
    """A weight-gathered problem is submitted, leased, timed and tuned like the others, keyed as itself (the same
    shape of an activation's ring is another study)."""
    from collective_matmul import Problem
    from collective_matmul.planning.space import candidates

    problem = PROBLEM | {"collective": collective}
    created = api.admin.post("/v1/studies", json={"problem": problem, "hardware": HARDWARE, "budget": {"trials": 3},
                                                 "warm_start": False})
    assert created.status_code == 201, created.text
    (study,) = created.json()["studies"]
    assert study["problem_key"] == Problem(**problem).key and study["space_size"] == len(candidates(Problem(**problem)))
    worker = register(api.worker)
    leased = [run_trial(worker) for _ in range(3)]
    assert all(grant["trial"]["problem"]["collective"] == collective for grant in leased)
    activation = api.admin.post("/v1/studies", json={"problem": PROBLEM, "hardware": HARDWARE})
    assert activation.status_code == 201 and activation.json()["studies"][0]["id"] != study["id"]
