"""Hostile or unlucky input: bad results, oversized bodies, other workers' leases, server paths, huge ids.

Each test here failed before its fix (issue 10).  The API runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import math
import re
import time

import pytest
from fastapi.testclient import TestClient

from cmtune.service.main import create_app
from cmtune.service.settings import Settings
from collective_matmul import Decomposition
from tests.service.conftest import HARDWARE, PROBLEM, make_api, measurement, register, run_trial


def create(client, **body):
    payload = {"problem": PROBLEM, "hardware": HARDWARE, "budget": {"trials": 4}} | body
    response = client.post("/v1/studies", json=payload)
    assert response.status_code == 201, response.text
    return response.json()["studies"][0]["id"]


def broken(result: dict, **changes) -> dict:
    """A copy of a measurement record with ``changes`` applied at dotted paths."""
    out = json.loads(json.dumps(result))
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        target = out
        for name in parents:
            target = target[name]
        target[leaf] = value
    return out


BAD_RESULTS = {
    "ratio 0": {"ratio": 0.0},
    "negative ratio": {"ratio": -1.0},
    "NaN ratio": {"ratio": math.nan},
    "infinite ratio": {"ratio": math.inf},
    "negative time": {"candidate.samples_s": [-1e-3, -1e-3, -1e-3], "candidate.median_s": -1e-3,
                      "candidate.min_s": -1e-3, "candidate.max_s": -1e-3},
    "zero time": {"baseline.samples_s": [0.0, 0.0, 0.0], "baseline.median_s": 0.0, "baseline.min_s": 0.0,
                  "baseline.max_s": 0.0},
    "ok without timings": {"candidate": None},
    "ok without a ratio": {"ratio": None},
    "median not the samples'": {"candidate.median_s": 5e-3},
    "ratio not the samples'": {"ratio": 0.5},
}


def _json_with_nan(body: dict) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@pytest.mark.parametrize("name", sorted(BAD_RESULTS))
def test_bad_results_are_refused_and_nothing_breaks(api, name):
    create(api.admin)
    worker = register(api.worker)
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    good = measurement(PROBLEM, Decomposition.baseline(), 1.0)
    body = {"lease_id": grant["lease"]["id"], "measurement": broken(good, **BAD_RESULTS[name])}
    url = f"/v1/trials/{grant['trial']['id']}/result"
    response = worker.client.post(url, content=_json_with_nan(body),
                                  headers=worker.headers | {"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert isinstance(response.json()["detail"], list)  # every 422 has FastAPI's schema
    # nothing was stored: the listing works, and the trial still takes a good result
    assert api.reader.get("/v1/studies").status_code == 200
    assert api.reader.get("/v1/studies/1").json()["trials_done"] == 0
    assert worker.post(url, json=body | {"measurement": good}).status_code == 200


MALFORMED = {  # the result route parses its body itself (one pass of pydantic): FastAPI's 422s all the same
    "not JSON": (b'{"lease_id": ', "application/json", ("body",)),
    "empty": (b"", "application/json", ("body",)),
    "not a JSON content type": (b'{"lease_id": "x"}', "text/plain", ("body",)),
    "a good result without a content type": (None, None, ("body",)),
    "a field of the wrong type": (b'{"lease_id": 5, "measurement": null}', "application/json", ("body", "lease_id")),
    "an unknown field": (b'{"lease_id": "x", "measurement": null, "lease_nxt": true}', "application/json",
                         ("body", "lease_nxt")),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_result_bodies_get_422_and_nothing_breaks(api, name):
    create(api.admin)
    worker = register(api.worker)
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    content, kind, where = MALFORMED[name]
    url = f"/v1/trials/{grant['trial']['id']}/result"
    good = {"lease_id": grant["lease"]["id"],
            "measurement": measurement(PROBLEM, Decomposition.model_validate(grant["trial"]["decomposition"]), 1.0)}
    headers = worker.headers | ({"content-type": kind} if kind else {})
    response = worker.client.post(url, content=json.dumps(good).encode() if content is None else content,
                                  headers=headers)
    assert response.status_code == 422, response.text
    assert any(tuple(e["loc"][:len(where)]) == where and e["msg"] for e in response.json()["detail"]), response.text
    assert worker.post(url, json=good).status_code == 200
    assert api.reader.get("/v1/studies/1").json()["trials_done"] == 1


def test_bad_confirmation_results_are_refused_and_the_trial_stays_leased(api):
    study_id = create(api.admin, budget={"trials": 2}, confirm_top=1)
    worker = register(api.worker)
    while (grant := worker.post(f"/v1/workers/{worker}/lease").json())["trial"]["kind"] == "search":
        configs = [Decomposition.model_validate(d) for d in grant["trial"]["decompositions"]]
        body = {"lease_id": grant["lease"]["id"], "measurement": measurement(PROBLEM, configs[0], 0.9)}
        assert worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=body).status_code == 200
    configs = [Decomposition.model_validate(d) for d in grant["trial"]["decompositions"]]
    good = [measurement(PROBLEM, c, 1.0 if c.method == "baseline" else 0.9) for c in configs]
    url = f"/v1/trials/{grant['trial']['id']}/result"
    for bad in (broken(good[1], ratio=0.0), broken(good[1], ratio=None),
                broken(good[1], **{"candidate.samples_s": [0.0, 0.0, 0.0]})):
        response = worker.post(url, json={"lease_id": grant["lease"]["id"], "measurements": [good[0], bad]})
        assert response.status_code == 422, response.text
    trials = api.reader.get(f"/v1/studies/{study_id}/trials").json()
    assert trials[-1]["state"] == "leased"
    assert worker.post(url, json={"lease_id": grant["lease"]["id"], "measurements": good}).status_code == 200
    assert api.reader.get(f"/v1/studies/{study_id}").json()["state"] == "completed"


def test_a_confirmation_whose_leases_keep_expiring_completes_from_the_search(database_url):
    # leases long enough that a search trial is reported in time on a loaded machine
    api = make_api(database_url, lease_seconds=1.5, max_attempts=2)
    try:
        study_id = create(api.admin, budget={"trials": 3}, confirm_top=2)
        worker = register(api.worker)
        for _ in range(3):
            run_trial(worker)
        for _ in range(2):  # leased and never reported, twice
            grant = worker.post(f"/v1/workers/{worker}/lease").json()
            assert grant["trial"]["kind"] == "confirm"
            time.sleep(1.7)
        assert worker.post(f"/v1/workers/{worker}/lease").status_code == 204  # expiry runs here
        study = api.reader.get(f"/v1/studies/{study_id}").json()
        assert study["state"] == "completed", study
        assert "search trials' own measurements" in study["message"]
        assert study["tuned"]["trials"] == 3
        # and the problem can be tuned again
        assert api.admin.post("/v1/studies", json={"problem": PROBLEM, "hardware": HARDWARE,
                                                   "force": True}).status_code == 201
    finally:
        api.db.dispose()


def test_a_late_result_is_refused_even_with_no_lease_request_in_between(database_url):
    api = make_api(database_url, lease_seconds=0.3)
    try:
        create(api.admin)
        worker = register(api.worker)
        grant = worker.post(f"/v1/workers/{worker}/lease").json()
        time.sleep(0.5)
        body = {"lease_id": grant["lease"]["id"], "measurement": measurement(PROBLEM, Decomposition.baseline(), 1.0)}
        late = worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=body)
        assert late.status_code == 409 and "expired" in late.json()["detail"]
        again = worker.post(f"/v1/workers/{worker}/lease").json()
        assert again["trial"]["id"] == grant["trial"]["id"]  # back in the queue, the attempt counted
        trials = api.reader.get("/v1/studies/1/trials").json()
        assert trials[0]["attempts"] == 2
    finally:
        api.db.dispose()


def test_a_worker_acts_only_as_itself(api):
    create(api.admin)
    mine, other = register(api.worker, "mine"), register(api.worker, "other")
    grant = mine.post(f"/v1/workers/{mine}/lease").json()
    # the shared worker token alone names no worker
    assert api.worker.post(f"/v1/workers/{mine}/lease").status_code == 401
    assert api.worker.post(f"/v1/workers/{mine}/heartbeat", json={}).status_code == 401
    # another worker's credential cannot lease, heartbeat or leave as this one
    for call in (lambda: other.post(f"/v1/workers/{mine}/lease"),
                 lambda: other.post(f"/v1/workers/{mine}/heartbeat", json={"lease_id": grant["lease"]["id"]}),
                 lambda: other.delete(f"/v1/workers/{mine}")):
        response = call()
        assert response.status_code == 403 and "acts only as itself" in response.text
    # nor report a result under this worker's lease
    body = {"lease_id": grant["lease"]["id"], "measurement": measurement(PROBLEM, Decomposition.baseline(), 1.0)}
    stolen = other.post(f"/v1/trials/{grant['trial']['id']}/result", json=body)
    assert stolen.status_code == 409 and "another worker" in stolen.text
    forged = api.worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=body,
                             headers={"X-Cmtune-Worker": f"cmw_{mine.id}_guess"})
    assert forged.status_code == 401
    assert mine.post(f"/v1/trials/{grant['trial']['id']}/result", json=body).status_code == 200


def test_revoked_tokens_stop_working(database_url):
    api = make_api(database_url, token_cache_seconds=0.5)
    try:
        assert api.reader.get("/v1/studies").status_code == 200  # checked and cached
        with api.store.write() as tx:
            reader = next(t for t in tx.tokens.all() if t.role == "reader")
            tx.tokens.revoke(reader.id)
        time.sleep(0.6)
        response = api.reader.get("/v1/studies")
        assert response.status_code == 401 and "revoked" in response.json()["detail"]
    finally:
        api.db.dispose()


def test_oversized_bodies_are_refused_before_they_are_read(api):
    limit = api.settings.max_body_bytes
    huge = b"x" * (limit + 1)
    # by Content-Length, with or without a token
    for client in (api.anonymous, api.admin):
        response = client.post("/v1/studies", content=huge, headers={"content-type": "application/json"})
        assert response.status_code == 413 and "CMTUNE_MAX_BODY_BYTES" in response.text
    # streamed, without a Content-Length
    def chunks():
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536

    assert api.admin.post("/v1/studies", content=chunks()).status_code == 413
    # an anonymous body is never parsed: malformed JSON gets 401, not 422
    assert api.anonymous.post("/v1/studies", content=b'{"problem": ',
                              headers={"content-type": "application/json"}).status_code == 401


def test_free_text_fields_are_bounded(api):
    big = {"name": "w", "hardware": HARDWARE, "software": {"jax": "x" * 100_000}}
    assert api.worker.post("/v1/workers", json=big).status_code == 422
    many = {"name": "w", "hardware": HARDWARE, "software": {f"p{i}": "1" for i in range(100)}}
    assert api.worker.post("/v1/workers", json=many).status_code == 422
    assert api.worker.post("/v1/workers", json={"name": "w" * 201, "hardware": HARDWARE}).status_code == 422
    assert api.reader.get("/v1/workers").json() == []


@pytest.mark.parametrize("model", ["", "/etc", "/etc/passwd", "pyproject.toml", "../../etc/hostname"])
def test_a_model_is_never_a_path_on_the_server(api, model):
    response = api.admin.post("/v1/studies", json={"model": model, "mesh": {"axes": {"model": 8}},
                                                   "hardware": HARDWARE})
    assert response.status_code == 422, response.text
    assert "unknown model" in response.text
    assert "root:" not in response.text and "[project]" not in response.text


@pytest.mark.parametrize("path", [
    "/v1/studies/99999999999999999999999999", "/v1/studies/18446744073709551616/trials",
    "/v1/submissions/99999999999999999999", "/v1/studies/-1", "/v1/studies/0",
])
def test_ids_beyond_64_bits_get_422(api, path):
    assert api.reader.get(path).status_code == 422


def test_huge_integers_in_queries_and_bodies_get_422(api):
    assert api.reader.get("/v1/studies", params={"offset": 2**70}).status_code == 422
    params = {**PROBLEM, "m": 2**70, "platform": "cpu", "device_kind": "cpu"}
    assert api.reader.get("/v1/configs", params=params).status_code == 422
    worker = register(api.worker)
    assert worker.post(f"/v1/trials/{2**70}/result", json={"lease_id": "x", "measurement": measurement(
        PROBLEM, Decomposition.baseline(), 1.0)}).status_code == 422


def test_healthz_tells_anonymous_callers_nothing_about_the_database(tmp_path):
    # a PostgreSQL URL on a port nothing listens on: the database is down
    settings = Settings(database_url="postgresql+psycopg://cmtune:secret@127.0.0.1:9/cmtune", auth="token")
    client = TestClient(create_app(settings, prepare=False))
    response = client.get("/healthz")
    assert response.status_code == 503
    assert "127.0.0.1" not in response.text and ":9" not in response.text and "secret" not in response.text


def test_the_look_up_cache_is_bounded(api, monkeypatch):
    from cmtune.service import lookup

    monkeypatch.setattr(lookup, "MAX_ANSWERS", 50)
    cache = api.store and lookup.ConfigCache(api.store, ttl_s=60)
    from collective_matmul import Hardware, Problem

    hardware = Hardware(**HARDWARE)
    for m in range(8, 8 * 200, 8):
        cache.tuned_for(hardware)
        cache.lookup_json(Problem(**PROBLEM | {"m": m}), hardware)
    assert len(cache._answers) <= 50


def test_the_openapi_document_declares_auth_and_errors(api):
    spec = api.anonymous.get("/openapi.json").json()
    schemes = spec["components"]["securitySchemes"]
    assert schemes["HTTPBearer"]["scheme"] == "bearer" and schemes["APIKeyHeader"]["name"] == "X-Cmtune-Worker"
    for path, operations in spec["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in operations.items():
            assert operation.get("security"), f"{method.upper()} {path} declares no security"
            assert {"401", "403", "413"} <= set(operation["responses"]), f"{method.upper()} {path}"
            if "{" in path:
                assert "422" in operation["responses"], f"{method.upper()} {path}"
    # the result route reads its body itself: its document still names the body, and the schema exists
    body = spec["paths"]["/v1/trials/{trial_id}/result"]["post"]["requestBody"]
    assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith("/ResultIn")
    result_in = spec["components"]["schemas"]["ResultIn"]
    assert {"lease_id", "measurement", "measurements", "step", "lease_next"} <= set(result_in["properties"])
    refs = {m.group(1) for m in re.finditer(r'"#/components/schemas/([^"]+)"', json.dumps(spec))}
    assert refs <= set(spec["components"]["schemas"]), refs - set(spec["components"]["schemas"])


# PostgreSQL only: SQLite has no server connection to lose
def test_connections_the_database_dropped_are_replaced_before_use(monkeypatch, pg_url):
    """A busy pool skips the per-transaction ping; a connection that idled is checked first, so a
    database restart (here: every session of ours killed) costs no request once it has idled."""
    from sqlalchemy import text

    from cmtune.service import db as db_module
    from cmtune.service.db import Database

    database = Database(pg_url)
    with database.transaction() as connection:
        ours = connection.scalar(text("SELECT pg_backend_pid()"))
    killer = Database(pg_url)
    with killer.transaction() as connection:
        assert connection.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": ours})
    killer.dispose()
    monkeypatch.setattr(db_module, "PING_AFTER_IDLE_S", 0.0)  # the pooled connection has idled long enough
    with database.transaction() as connection:
        assert connection.scalar(text("SELECT 1")) == 1
        assert connection.scalar(text("SELECT pg_backend_pid()")) != ours
    database.dispose()


# --- free text: one line or a message, bounded like its column (issue 18) ------------------------------------------

CONTROL = ["\x00", "\n", "\x1b", "\x7f"]  # NUL (PostgreSQL refuses it), a line break, an escape, DEL
VALID_QUERY = {**PROBLEM, "platform": "cpu", "device_kind": "cpu", "device_count": 8, "model": "tiny",
               "hardware": "cpu:cpu:8:1"}
TEXT_PARAMETERS = {  # every text parameter of the API, by path (test_every_text_parameter_is_listed keeps it so)
    "/v1/studies": ["hardware"],
    "/v1/configs": ["collective", "dtype", "platform", "device_kind", "jax", "jaxlib", "platform_version", "flags"],
    "/v1/tuned": ["platform", "device_kind"],
    "/v1/overrides": ["model", "platform", "device_kind"],
    "/v1/bundles": ["platform", "device_kind"],
}


def text_parameters(spec: dict) -> dict[str, list[str]]:
    """The text (string, not enum) query and path parameters of every operation of an OpenAPI document."""
    found: dict[str, list[str]] = {}
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                schemas = parameter["schema"].get("anyOf", [parameter["schema"]])
                if parameter["in"] in ("query", "path") and any(s.get("type") == "string" and "enum" not in s
                                                                for s in schemas):
                    found.setdefault(path, []).append(parameter["name"])
    return found


def test_every_text_parameter_is_listed(api):
    assert text_parameters(api.anonymous.get("/openapi.json").json()) == TEXT_PARAMETERS


def refused(response, *loc) -> bool:
    """A 422 of FastAPI's shape with an error at ``loc``."""
    return response.status_code == 422 and any(tuple(e["loc"]) == loc and e["msg"] for e in response.json()["detail"])


@pytest.mark.parametrize("path", sorted(TEXT_PARAMETERS))
def test_control_characters_in_text_queries_get_422(api, path):
    spec = api.anonymous.get("/openapi.json").json()
    required = {p["name"]: VALID_QUERY[p["name"]] for p in spec["paths"][path]["get"]["parameters"] if p["required"]}
    assert api.reader.get(path, params=required).status_code == 200
    for name in TEXT_PARAMETERS[path]:
        for char in CONTROL:
            response = api.reader.get(path, params=required | {name: f"cpu{char}"})
            assert refused(response, "query", name), (name, char, response.status_code, response.text)


def test_control_characters_in_a_worker_get_422(api):
    good = {"name": "w0", "hardware": HARDWARE, "software": {"jax": "0.10.2"}}
    for char in CONTROL:
        for where, body in [(("name",), good | {"name": f"w{char}"}),
                            (("hardware", "platform"), good | {"hardware": HARDWARE | {"platform": f"cpu{char}"}}),
                            (("hardware", "device_kind"), good | {"hardware": HARDWARE | {"device_kind": f"c{char}"}}),
                            (("software", "jax"), good | {"software": {"jax": f"0.10{char}"}})]:
            response = api.worker.post("/v1/workers", json=body)
            assert refused(response, "body", *where), (where, char, response.status_code, response.text)
    assert api.reader.get("/v1/workers").json() == []
    assert api.worker.post("/v1/workers", json=good).status_code == 201


def test_control_characters_in_a_config_query_get_422(api):
    query = {"problem": PROBLEM, "platform": "cpu", "device_kind": "cpu"}
    assert api.reader.post("/v1/configs/query", json={"queries": [query]}).status_code == 200
    for name in ("platform", "device_kind"):
        for char in CONTROL:
            response = api.reader.post("/v1/configs/query", json={"queries": [query, query | {name: f"cpu{char}"}]})
            assert refused(response, "body", "queries", 1, name), (name, char, response.status_code, response.text)


@pytest.mark.parametrize("name", ["m" * 201, "m" * (1 << 20), "tiny\x00", "tiny\n"],
                         ids=["201 characters", "1 MB", "NUL", "a line break"])
def test_an_inline_model_name_is_one_line_bounded_like_its_column(api, name):
    from collective_matmul.planning.models import PRESETS

    body = {"model": PRESETS["tiny"].model_dump() | {"name": name}, "mesh": {"axes": {"data": 1, "model": 8}},
            "hardware": HARDWARE}
    response = api.admin.post("/v1/studies", json=body)
    assert response.status_code == 422, response.text[:1000]
    assert any(e["loc"][:2] == ["body", "model"] and e["loc"][-1] == "name" for e in response.json()["detail"])
    assert api.reader.get("/v1/studies").json()["total"] == 0  # nothing stored
    assert api.reader.get("/v1/submissions").json() == []
    longest = api.admin.post("/v1/studies", json=body | {"model": body["model"] | {"name": "m" * 200}})
    assert longest.status_code == 201, longest.text


@pytest.mark.parametrize("changes", [
    {"hardware.jax_version": "0" * (1 << 20)}, {"hardware.jaxlib_version": "0.10.2\x00"},
    {"hardware.device_kind": "cpu\x00"}, {"message": "fine\x00"}, {"message": "x" * 4001},
], ids=["1 MB jax_version", "NUL in jaxlib_version", "NUL in device_kind", "NUL in the message",
        "a message over 4000 characters"])
def test_a_result_with_bad_text_is_refused_and_the_trial_takes_a_good_one(api, changes):
    create(api.admin)
    worker = register(api.worker)
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    good = measurement(PROBLEM, Decomposition.model_validate(grant["trial"]["decomposition"]), 1.0)
    url = f"/v1/trials/{grant['trial']['id']}/result"
    response = worker.post(url, json={"lease_id": grant["lease"]["id"], "measurement": broken(good, **changes)})
    (path,) = changes
    assert refused(response, "body", "measurement", *path.split(".")), response.text[:1000]
    assert api.reader.get("/v1/studies/1").json()["trials_done"] == 0
    assert worker.post(url, json={"lease_id": grant["lease"]["id"], "measurement": good}).status_code == 200
    assert api.reader.get("/v1/studies/1").json()["trials_done"] == 1


def test_control_characters_in_a_lease_id_get_422(api):
    create(api.admin)
    worker = register(api.worker)
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    good = measurement(PROBLEM, Decomposition.model_validate(grant["trial"]["decomposition"]), 1.0)
    url = f"/v1/trials/{grant['trial']['id']}/result"
    for char in CONTROL:
        response = worker.post(url, json={"lease_id": f"{grant['lease']['id'][:30]}{char}", "measurement": good})
        assert refused(response, "body", "lease_id"), (char, response.status_code, response.text)
        response = worker.post(f"/v1/workers/{worker}/heartbeat", json={"lease_id": f"lease{char}"})
        assert refused(response, "body", "lease_id"), (char, response.status_code, response.text)
    assert worker.post(url, json={"lease_id": grant["lease"]["id"], "measurement": good}).status_code == 200


def test_a_message_keeps_its_tabs_and_line_breaks_and_is_stored_cut_to_its_column(api):
    create(api.admin)
    worker = register(api.worker)
    grant = worker.post(f"/v1/workers/{worker}/lease").json()
    failed = measurement(PROBLEM, Decomposition.model_validate(grant["trial"]["decomposition"]), None, status="error")
    said = "Traceback:\r\n\tline one\n" + "x" * 3000
    body = {"lease_id": grant["lease"]["id"], "measurement": failed | {"message": said}}
    response = worker.post(f"/v1/trials/{grant['trial']['id']}/result", json=body)
    assert response.status_code == 200, response.text[:1000]
    (trial,) = [t for t in api.reader.get("/v1/studies/1/trials").json() if t["id"] == grant["trial"]["id"]]
    assert trial["message"] == said[:2000]  # trials.message holds 2000 characters


BAD_BUNDLES = {
    "NUL in a version": ("configs", 0, "jax_version", "0.10.2\x00"),
    "1 MB version": ("configs", 0, "jaxlib_version", "0" * (1 << 20)),
    "a count over an integer column": ("configs", 0, "trials", 1 << 40),
    "a line break in a time stamp": ("configs", 0, "tuned_at", "2025-01-01\n"),
    "NUL in an override's model": ("overrides", 0, "model", "tiny\x00"),
    "NUL in an override's reason": ("overrides", 0, "reason", "faster\x00"),
    "an override's reason over its column": ("overrides", 0, "reason", "x" * 2001),
}


@pytest.mark.parametrize("name", sorted(BAD_BUNDLES))
def test_a_bundle_with_bad_text_is_refused_and_nothing_imported(api, name):
    from collective_matmul.planning.decomposition import OpConfigs
    from collective_matmul.planning.models import slot_problems
    from collective_matmul.planning.problem import Hardware, Problem
    from collective_matmul.wire.bundle import Bundle, RoleOverride, TunedConfig

    hardware = Hardware(**HARDWARE)
    config = TunedConfig(problem=Problem(**PROBLEM), hardware=hardware, decomposition=Decomposition.baseline(),
                         time_s=1e-3, baseline_s=1e-3, speedup=1.0, jax_version="0.10.2")
    problems = slot_problems("allgather_matmul", m=256, k=64, n=128, dtype="float32", axis_size=8)
    override = RoleOverride(model="tiny", role="qkv", hardware=hardware, configs=OpConfigs(), reason="faster",
                            problems=problems)
    good = Bundle(configs=[config], overrides=[override]).model_dump(mode="json")
    field, index, key, value = BAD_BUNDLES[name]
    bad = json.loads(json.dumps(good))
    bad[field][index][key] = value
    response = api.admin.post("/v1/bundles", json=bad)
    assert refused(response, "body", field, index, key), response.text[:1000]
    assert api.reader.get("/v1/tuned").json() == [] and api.reader.get("/v1/bundles").json()["overrides"] == []
    assert api.admin.post("/v1/bundles", json=good).status_code == 201


def test_a_value_the_database_refuses_is_a_422_not_a_500(api, monkeypatch):
    """The safety net under the API's bounds: a driver's DataError (PostgreSQL refuses a NUL, a string over its
    column, an integer out of range) is the request's 422, with the database's reason and nothing stored."""
    from sqlalchemy.exc import DataError

    from cmtune.service.store import Catalog

    def refuse(*_args, **_kwargs):
        raise DataError("SELECT ...", {"key_1": "secret"}, ValueError("integer out of range\nCONTEXT: unnamed portal"))

    monkeypatch.setattr(Catalog, "list_studies", refuse)
    response = api.reader.get("/v1/studies")
    assert response.status_code == 422, response.text
    assert isinstance(response.json()["detail"], list) and "integer out of range" in response.text
    assert "secret" not in response.text and "CONTEXT" not in response.text and "SELECT" not in response.text
