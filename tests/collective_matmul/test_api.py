"""The one API client against the service's own contract: every route it calls is in the OpenAPI schema with
the wire types it sends and parses, its errors are this module's exceptions, and a whole study runs through it
in process (the daemon's and the CLI's real-server round trips are tests/workers/test_daemon.py and
tests/service/test_server.py)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from cmtune.service.main import create_app
from cmtune.service.models import TokenRole
from cmtune.service.settings import Settings
from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.client.rest import ENDPOINTS, ApiClient, ApiError, Conflict, Invalid, NotRegistered, Unreachable
from collective_matmul.planning.problem import Software
from collective_matmul.wire import (
    WORKER_HEADER,
    Budget,
    HardwareIn,
    Measurement,
    ResultIn,
    StudyCreate,
    WorkerCreate,
    result_of,
)
from tests.service.conftest import HARDWARE, PROBLEM, cost, measurement

HW = Hardware(**HARDWARE)
SOFTWARE = Software(jax="0.10.2")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path_factory.mktemp('api') / 'api.sqlite'}",
                              auth="token", config_cache_seconds=0))
    yield app
    app.state.cmtune.store.db.dispose()


@pytest.fixture(scope="module")
def schema(app) -> dict:
    return app.openapi()


def refs(node) -> set[str]:
    """The component names a schema refers to, anywhere in it (anyOf, items, ...), without pydantic's
    -Input/-Output suffixes."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[1].removesuffix("-Input").removesuffix("-Output")} \
            if "$ref" in node else set()
        return found.union(*(refs(v) for k, v in node.items() if k != "$ref"))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


@pytest.mark.parametrize("name", sorted(ENDPOINTS))
def test_every_route_the_client_calls_is_in_the_schema_with_its_wire_types(schema, name):
    endpoint = ENDPOINTS[name]
    operations = schema["paths"].get(endpoint.path)
    assert operations is not None, f"{name}: {endpoint.path} is not a route of the service"
    operation = operations.get(endpoint.method.lower())
    assert operation is not None, f"{name}: {endpoint.path} has no {endpoint.method} (it has {sorted(operations)})"
    templated = {p["name"] for p in operation.get("parameters", ()) if p["in"] == "path"}
    assert {part[1:-1] for part in endpoint.path.split("/") if part.startswith("{")} == templated
    if endpoint.body is not None:
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert endpoint.body.__name__ in refs(body), f"{name}: the route reads {refs(body)}, not {endpoint.body}"
        assert endpoint.body.__name__ in {n.removesuffix("-Input") for n in schema["components"]["schemas"]}
    else:
        assert not operation.get("requestBody", {}).get("required"), f"{name}: the route needs a body"
    if endpoint.answer is not None:
        answers = {code: r["content"]["application/json"]["schema"] for code, r in operation["responses"].items()
                   if code.startswith("2") and "content" in r}
        assert answers, f"{name}: the route declares no answer"
        (answer,) = answers.values()
        if endpoint.many:
            assert answer.get("type") == "array", f"{name}: the route answers one {refs(answer)}, not a list"
            answer = answer["items"]
        assert refs(answer) == {endpoint.answer.__name__}, f"{name}: the route answers {refs(answer)}"


def recorder(status: int = 503, body: dict | None = None, seen: list | None = None) -> httpx.Client:
    """An HTTP client whose every request gets ``status`` (and ``body``), the requests kept in ``seen``."""
    def answer(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(status, json=body if body is not None else {"detail": "synthetic"})

    return httpx.Client(base_url="http://cmtune.test", transport=httpx.MockTransport(answer))


def test_the_query_parameters_the_client_sends_are_the_routes_own(schema):
    seen: list[httpx.Request] = []
    api = ApiClient("http://cmtune.test", "tok", http=recorder(seen=seen))
    calls = {"config": lambda: api.config(Problem(**PROBLEM), HW, SOFTWARE),
             "overrides": lambda: api.overrides("tiny", HW), "studies": lambda: api.studies(state="running", limit=5)}
    for name, call in calls.items():
        with pytest.raises(Unreachable):
            call()
        declared = {p["name"] for p in schema["paths"][ENDPOINTS[name].path]["get"]["parameters"] if p["in"] == "query"}
        sent = set(seen[-1].url.params)
        assert sent and sent <= declared, f"{name}: sends {sorted(sent - declared)}, which the route does not take"


def test_errors_are_exceptions_and_the_worker_credential_goes_only_where_it_belongs():
    seen: list[httpx.Request] = []

    def client(status, body=None):
        return ApiClient("http://cmtune.test", "tok", worker_credential="cred", http=recorder(status, body, seen))

    with pytest.raises(NotRegistered) as lost:
        client(404, {"detail": "worker 3 does not exist"}).lease(3)
    assert (lost.value.status, lost.value.detail) == (404, "worker 3 does not exist")
    with pytest.raises(NotRegistered):
        client(401).heartbeat(3)
    body = ResultIn(lease_id="0" * 32, measurement=Measurement.model_validate(
        measurement(PROBLEM, Decomposition.baseline(), 1.0)))
    with pytest.raises(Conflict):
        client(409).result(7, body)
    with pytest.raises(ApiError) as missing:  # no such trial: not the worker's own route
        client(404).result(7, body)
    assert type(missing.value) is ApiError and str(missing.value) == "404: synthetic"
    with pytest.raises(Invalid) as invalid:
        client(422, {"detail": [{"loc": ["body", "lease_id"], "msg": "too short"}]}).result(7, body)
    assert invalid.value.detail == "body.lease_id: too short"
    assert client(204).lease(3) is None
    assert seen[0].headers["Authorization"] == "Bearer tok" and seen[0].headers[WORKER_HEADER] == "cred"
    with pytest.raises(ApiError):
        client(403).workers()
    assert WORKER_HEADER not in seen[-1].headers  # a reader's call carries no worker credential


def test_a_service_away_is_retried_for_the_clients_patience():
    seen: list[httpx.Request] = []
    api = ApiClient("http://cmtune.test", None, patience_s=0.6, http=recorder(503, seen=seen))
    with pytest.raises(Unreachable) as away:
        api.lease(1)
    assert away.value.status == 503 and len(seen) >= 2
    seen.clear()
    with pytest.raises(Unreachable):
        api.heartbeat(1)  # best effort: tried once
    assert len(seen) == 1

    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    down = ApiClient("http://cmtune.test", http=httpx.Client(base_url="http://cmtune.test",
                                                             transport=httpx.MockTransport(refuse)))
    with pytest.raises(Unreachable) as unreachable:
        down.submissions()
    assert unreachable.value.status is None and "ConnectError" in str(unreachable.value)


def test_a_study_runs_through_the_client_in_process(app):
    store = app.state.cmtune.store
    with store.write() as tx:
        tokens = {role: tx.tokens.add(name=f"api-{role}", role=TokenRole(role))[1] for role in ("admin", "worker")}
    admin = ApiClient("http://testserver", tokens["admin"], http=TestClient(app))
    worker = ApiClient("http://testserver", tokens["worker"], http=TestClient(app))
    problem = Problem(**PROBLEM)
    created = admin.submit(StudyCreate(problem=problem, hardware=HardwareIn(**HARDWARE), budget=Budget(trials=2),
                                       repeats=3, confirm_top=1))
    (study,) = created.studies
    registered = worker.register(WorkerCreate(name="api-w0", hardware=HardwareIn(**HARDWARE), software=SOFTWARE))
    assert worker.worker_credential == registered.credential
    grant = worker.lease(registered.id)
    assert worker.heartbeat(registered.id, grant.lease.id).lease.id == grant.lease.id
    with pytest.raises(Conflict):  # a lease that is not this trial's
        worker.result(grant.trial.id, ResultIn(lease_id="0" * 32, measurement=Measurement.model_validate(
            measurement(PROBLEM, grant.trial.decomposition, 1.0))))
    while grant is not None:
        task = grant.trial
        results = [Measurement.model_validate(measurement(PROBLEM, d, cost(d))) for d in task.decompositions]
        body = ResultIn.of(grant.lease.id, result_of(task.kind, results), lease_next=True)
        grant = worker.result(task.id, body).next
    assert admin.config(problem, HW).match == "exact"
    assert worker.overrides("tiny", HW) == []
    assert [s.id for s in admin.studies(state="completed").items] == [study.id]
    assert len(admin.trials(study.id)) >= 3 and [w.id for w in admin.workers()] == [registered.id]
    assert admin.submissions() == []  # a problem, not a model: no submission
    worker.unregister(registered.id)
    with pytest.raises(NotRegistered):
        worker.lease(registered.id)
    with pytest.raises(Invalid):
        admin.submit(StudyCreate.model_construct(hardware=HardwareIn(**HARDWARE)))


def test_the_client_loads_without_jax_or_the_web_stack():
    """Every caller may import it: the service's image, a worker before JAX starts, the command lines."""
    code = ("import sys, collective_matmul.client.rest, collective_matmul.client.sources; "
            "print(sorted(m for m in ('jax', 'fastapi', 'sqlalchemy') if m in sys.modules))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "[]"
