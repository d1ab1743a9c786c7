"""Software stacks in the service (issue 21): look-ups answer exact, stale, nearest, then baseline (or model, where
asked for) for the caller's stack; a worker of a new stack queues the re-confirmation of configs held only for
others, which only workers of that stack run.  Every test touching the store runs on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from sqlalchemy import JSON, column, create_engine, select, table, text

from cmtune.service import migrate
from collective_matmul import Decomposition, Problem
from collective_matmul.planning.problem import Software
from collective_matmul.wire import MeasurementProtocol
from collective_matmul.wire.lookup import NO_STACK, NOT_MEASURED
from tests.service.conftest import HARDWARE, PROBLEM, cost, make_api, register, run_trial, step_result

OLD = {"jax": "0.10.2", "jaxlib": "0.10.2"}
NEW = {"jax": "0.11.0", "jaxlib": "0.11.0"}


def look(api, software: dict | None = None, problem: dict = PROBLEM, **hardware) -> dict:
    params = {**problem, "platform": "cpu", "device_kind": "cpu"} | hardware | (software or {})
    response = api.reader.get("/v1/configs", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def tune(api, worker, problem: dict = PROBLEM, landscape=cost) -> dict:
    """A study of ``problem`` run to its end by ``worker`` (synthetic results); the study."""
    body = {"problem": problem, "hardware": HARDWARE, "budget": {"trials": 6}, "confirm_top": 2}
    (study,) = api.admin.post("/v1/studies", json=body).json()["studies"]
    while run_trial(worker, landscape) is not None:
        pass
    return api.reader.get(f"/v1/studies/{study['id']}").json()


def reconfirmations(api) -> list[dict]:
    return [s for s in api.reader.get("/v1/studies").json()["items"] if s["reconfirm"] is not None]


def test_each_match_kind_in_the_look_up_order(api):
    old = register(api.worker, "old", software=OLD)
    study = tune(api, old)
    winner = study["tuned"]["decomposition"]
    exact = look(api, OLD)
    assert (exact["match"], exact["decomposition"], exact["note"]) == ("exact", winner, None)
    assert exact["software"] == OLD | {"platform_version": "", "flags": ""}
    assert exact["speedup"] == pytest.approx(study["tuned"]["speedup"])
    stale = look(api, NEW)  # no worker of this stack yet: the other stack's config, told so
    assert (stale["match"], stale["decomposition"], stale["software"]["jax"]) == ("stale", winner, "0.10.2")
    assert "measured on another software stack (jax 0.10.2, jaxlib 0.10.2)" in stale["note"]
    assert "jax 0.11.0" in stale["note"] and stale["speedup"] == exact["speedup"]
    nearest = look(api, OLD, PROBLEM | {"m": 512})
    assert nearest["match"] == "nearest" and nearest["source_problem"] == PROBLEM
    unmeasured = look(api, OLD, PROBLEM | {"collective": "matmul_reduce_scatter"})  # nothing measured: the baseline
    assert (unmeasured["match"], unmeasured["software"]) == ("baseline", None)
    assert unmeasured["reason"].startswith(NOT_MEASURED)
    model = look(api, OLD, PROBLEM | {"collective": "matmul_reduce_scatter"}, unmeasured="costmodel")
    assert model["match"] == "model" and model["software"] is None
    assert look(api, OLD, platform="npu", device_kind="npu-1")["match"] == "baseline"
    unnamed = look(api)  # a look-up that names no stack: answered as before, and told so
    assert (unnamed["match"], unnamed["decomposition"], unnamed["note"]) == ("exact", winner, NO_STACK)
    batch = api.reader.post("/v1/configs/query", json={"queries": [
        {"problem": PROBLEM, "platform": "cpu", "device_kind": "cpu", "software": NEW},
        {"problem": PROBLEM, "platform": "cpu", "device_kind": "cpu", "software": OLD},
        {"problem": PROBLEM, "platform": "cpu", "device_kind": "cpu"}]})
    assert [a["match"] for a in batch.json()] == ["stale", "exact", "exact"]
    assert api.reader.get("/v1/configs", params={**PROBLEM, "platform": "cpu", "device_kind": "cpu",
                                                 "flags": "xyz"}).status_code == 422


def test_a_jax_upgrade_turns_exact_into_stale_until_a_worker_of_it_reconfirms_the_config(api):
    old = register(api.worker, "old", software=OLD)
    study = tune(api, old)
    winner = study["tuned"]["decomposition"]
    trials = [t for t in api.reader.get(f"/v1/studies/{study['id']}/trials").json() if t["kind"] == "search"]
    rings = sorted((t for t in trials if t["decompositions"][0]["method"] == "ring"), key=lambda t: t["ratio"])
    assert look(api, NEW)["match"] == "stale" and reconfirmations(api) == []
    new = register(api.worker, "new", software=NEW)
    (queued,) = reconfirmations(api)
    assert queued["state"] == "confirming" and queued["outcome"] == "waiting" and queued["software"]["jax"] == "0.11.0"
    assert queued["reconfirm"]["config"]["decomposition"] == winner and queued["reconfirm"]["study_id"] == study["id"]
    assert queued["reconfirm"]["contenders"] == [Decomposition.baseline().model_dump(mode="json"), winner,
                                                 rings[1]["decompositions"][0]]
    register(api.worker, "new-2", software=NEW)  # a second worker of the same stack queues nothing again
    register(api.worker, "old-2", software=OLD)  # nor does a worker of the old one
    assert [s["id"] for s in reconfirmations(api)] == [queued["id"]]
    assert old.post(f"/v1/workers/{old}/lease").status_code == 204  # only workers of the new stack run it
    assert look(api, NEW)["match"] == "stale"
    grant = run_trial(new)
    assert grant["trial"]["kind"] == "confirm" and grant["trial"]["decompositions"] == queued["reconfirm"]["contenders"]
    done = api.reader.get(f"/v1/studies/{queued['id']}").json()
    assert (done["state"], done["stop_reason"], done["outcome"]) == ("completed", "re-confirmed", "re-confirmed")
    assert done["message"].startswith("re-confirmed on jax 0.11.0, jaxlib 0.11.0:")
    now = look(api, NEW)
    assert (now["match"], now["decomposition"], now["software"]["jax"], now["note"]) == ("exact", winner, "0.11.0",
                                                                                          None)
    before = look(api, OLD)  # the old stack's config stays, served to the old stack
    assert (before["match"], before["software"]["jax"]) == ("exact", "0.10.2")
    stored = api.reader.get("/v1/tuned").json()
    assert sorted(c["software"]["jax"] for c in stored) == ["0.10.2", "0.11.0"]
    assert len({c["software_key"] for c in stored}) == 2
    assert {c["problem_key"] for c in stored} == {study["problem_key"]}
    bundle = api.reader.get("/v1/bundles").json()
    assert bundle["version"] == 4 and sorted(c["software"]["jax"] for c in bundle["configs"]) == ["0.10.2", "0.11.0"]
    workers = {w["name"]: w for w in api.reader.get("/v1/workers").json()}
    assert workers["new"]["software"]["jax"] == "0.11.0" and workers["new"]["software_key"] == Software(**NEW).key


def test_a_new_winner_on_the_new_stack_replaces_the_config_for_that_stack_only(api):
    old = register(api.worker, "old", software=OLD)
    study = tune(api, old)
    winner = Decomposition.model_validate(study["tuned"]["decomposition"])
    new = register(api.worker, "new", software=NEW)
    (queued,) = reconfirmations(api)
    runner_up = queued["reconfirm"]["runner_up"]
    run_trial(new, lambda c: 1.2 if c == winner else cost(c))  # the upgrade slowed the stored winner down
    done = api.reader.get(f"/v1/studies/{queued['id']}").json()
    assert (done["stop_reason"], done["outcome"]) == ("replaced", "replaced")
    assert f"replaced on jax 0.11.0, jaxlib 0.11.0: {Decomposition.model_validate(runner_up).id}" in done["message"]
    assert look(api, NEW)["decomposition"] == runner_up and look(api, NEW)["match"] == "exact"
    assert look(api, OLD)["decomposition"] == winner.model_dump(mode="json")


def test_a_result_of_another_stack_than_its_workers_is_refused(api):
    from tests.service.conftest import measurement

    api.admin.post("/v1/studies", json={"problem": PROBLEM, "hardware": HARDWARE, "budget": {"trials": 3}})
    worker = register(api.worker, "new", software=NEW)
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    record = measurement(PROBLEM, Decomposition.baseline(), 1.0)
    record["hardware"]["software"] = OLD
    body = {"lease_id": grant["lease"]["id"], "measurement": record}
    response = worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=body)
    assert response.status_code == 422 and "registered with jax 0.11.0" in response.text
    record["hardware"]["software"] = NEW
    assert worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=body).status_code == 200


def test_a_model_with_overrides_has_its_step_measured_again_on_the_new_stack(api):
    body = {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}}, "hardware": HARDWARE,
            "budget": {"trials": 2}, "confirm_top": 1, "step": {"search_rounds": 1}}  # one round: the menu
    created = api.admin.post("/v1/studies", json=body).json()
    old = register(api.worker, "old", software=OLD)
    seconds = {"as-written": 1.0, "baseline": 0.95, "tuned": 0.8, "tuned-minus-mlp_up": 0.7}

    def run_all(worker, seconds) -> list[dict]:
        grants = []
        while (response := worker.post(f"/v1/workers/{worker}/lease")).status_code == 200:
            grant = response.json()
            grants.append(grant)
            if grant["trial"]["kind"] == "step":
                result = {"lease_id": grant["lease"]["id"], "step": step_result(grant["trial"], seconds)}
                assert worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=result).status_code == 200
            else:
                from tests.service.conftest import report

                report(worker, grant, lambda c: 0.8 if c.method == "ring" else 1.0)
        return grants

    run_all(old, seconds)
    (override,) = api.reader.get(f"/v1/submissions/{created['submission_id']}").json()["overrides"]
    assert override["role"] == "mlp_up" and override["software"]["jax"] == "0.10.2"
    register(api.worker, "old-2", software=OLD)  # the stack that decided them: nothing to measure again
    assert [s["kind"] for s in api.reader.get("/v1/studies").json()["items"]].count("step") == 1
    new = register(api.worker, "new", software=NEW)
    studies = api.reader.get("/v1/studies").json()["items"]
    queued = [s for s in studies if s["reconfirm"] is not None]
    (step,) = [s for s in studies if s["kind"] == "step" and s["software"] is not None]
    assert len(queued) == len(created["studies"]) - 1 and step["state"] == "pending"  # every problem; it waits
    register(api.worker, "new-2", software=NEW)
    assert len([s for s in api.reader.get("/v1/studies").json()["items"] if s["kind"] == "step"]) == 2
    assert old.post(f"/v1/workers/{old}/lease").status_code == 204
    grants = run_all(new, {"as-written": 1.0, "baseline": 0.95, "tuned": 0.8, "tuned-minus-qkv": 0.7})
    assert [g["trial"]["kind"] for g in grants] == ["confirm"] * len(queued) + ["step"]
    assert api.reader.get(f"/v1/studies/{step['id']}").json()["state"] == "completed"
    (override,) = api.reader.get(f"/v1/submissions/{created['submission_id']}").json()["overrides"]
    assert override["role"] == "qkv" and override["software"]["jax"] == "0.11.0"  # the new stack's decision


def test_migration_0008_keys_stored_configs_by_their_versions_and_downgrades_to_the_newest(database_url):
    engine = create_engine(database_url)
    migrate.upgrade(engine)
    migrate.downgrade(engine, "0007")
    when = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    with engine.begin() as c:
        c.execute(text("INSERT INTO hardware (key, platform, device_kind, device_count, process_count) "
                       "VALUES ('cpu:cpu:8:1', 'cpu', 'cpu', 8, 1)"))
        c.execute(text("INSERT INTO problems (key, collective, m, k, n, dtype, axis_size) VALUES "
                       "(:key, 'allgather_matmul', 256, 64, 128, 'float32', 8)"), {"key": Problem(**PROBLEM).key})
        c.execute(text("INSERT INTO tuned_configs (problem_id, hardware_id, decomposition, time_s, baseline_s, "
                       "speedup, speedup_iqr, trials, invalid, failed, space_size, software, updated_at) "
                       "VALUES (1, 1, :d, 1e-3, 1e-3, 1, 0, 4, 0, 0, 49, :s, :u)"),
                  {"d": json.dumps({"method": "baseline"}), "s": json.dumps(OLD), "u": when})
    migrate.upgrade(engine)
    with engine.connect() as c:
        assert c.execute(text("SELECT software_key FROM tuned_configs")).scalar_one() == Software(**OLD).key
    from cmtune.service.db import Database
    from cmtune.service.store import SqlStore

    db = Database(database_url)
    with SqlStore(db).write() as tx:  # a second stack's config of the same problem: a row of its own
        (config,) = tx.catalog.list_tuned()
        assert config.software == Software(**OLD)
        tx.save_tuned(config.measured_on(Software(**NEW)), study_id=None)
        assert len(tx.catalog.list_tuned()) == 2
    db.dispose()
    migrate.downgrade(engine, "0007")
    with engine.connect() as c:  # the newest stays
        assert c.execute(select(column("software", JSON)).select_from(table("tuned_configs"))).scalar_one() == \
            Software(**NEW).model_dump()
    migrate.upgrade(engine)
    engine.dispose()


def test_a_real_measurement_reconfirms_a_config_on_the_stack_that_runs_it(tmp_path):
    """8 virtual CPU devices: a config tuned on a (pretended) older jax is re-confirmed by a worker of this
    process's real stack, from real measurements, and becomes exact for it."""
    from cmtune.workers.measure import OpSession

    api = make_api(f"sqlite:///{tmp_path / 'real.sqlite'}")
    real = Software.detect()
    pretended = Software(jax="0.9.0", jaxlib="0.9.0")
    sessions: dict = {}

    def run(worker, stack: Software) -> int:
        count = 0
        while (response := worker.post(f"/v1/workers/{worker}/lease")).status_code == 200:
            grant = response.json()
            task = grant["trial"]
            protocol = MeasurementProtocol.model_validate(task["protocol"])
            session = sessions.setdefault(protocol.seed, OpSession(Problem.model_validate(task["problem"]),
                                                                 protocol=protocol))
            results = []
            for d in task["decompositions"]:
                m = session.measure(Decomposition.model_validate(d), protocol).model_dump(mode="json")
                m["hardware"]["software"] = stack.model_dump(mode="json")
                results.append(m)
            payload = {"lease_id": grant["lease"]["id"]}
            payload |= {"measurement": results[0]} if task["kind"] == "search" else {"measurements": results}
            assert worker.post(f"/v1/trials/{task['id']}/result", json=payload).status_code == 200, task
            count += 1
        return count

    body = {"problem": PROBLEM, "hardware": HARDWARE, "budget": {"trials": 3}, "repeats": 3, "confirm_top": 1}
    api.admin.post("/v1/studies", json=body)
    run(register(api.worker, "old", software=pretended.model_dump()), pretended)
    stack = real.model_dump()
    assert look(api, stack)["match"] == "stale"
    assert run(register(api.worker, "real", software=stack), real) == 1  # the re-confirmation round
    (queued,) = reconfirmations(api)
    assert queued["outcome"] in ("re-confirmed", "replaced"), queued
    answer = look(api, stack)
    assert answer["match"] == "exact" and answer["software"] == stack
    api.db.dispose()
