"""The API contract suite runs against every backend: SQLite, and PostgreSQL (the session's `pg_url`:
CMTUNE_TEST_DATABASE_URL's server where set, as in CI, else an embedded one, tests/pg.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from cmtune.service import migrate
from cmtune.service.db import Database
from cmtune.service.main import create_app
from cmtune.service.models import TokenRole
from cmtune.service.settings import Settings
from cmtune.service.store import SqlStore
from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.wire import BoundsMeasurement, Measurement, Timing

HARDWARE = {"platform": "cpu", "device_kind": "cpu", "device_count": 8, "process_count": 1}
PROBLEM = {"collective": "allgather_matmul", "m": 256, "k": 64, "n": 128, "dtype": "float32", "axis_size": 8}


def reset_postgres(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'cmtune.sqlite'}"
    url = request.getfixturevalue("pg_url")  # only the PostgreSQL runs start a server
    reset_postgres(url)
    migrate.upgrade(create_engine(url))
    return url


@dataclass
class Api:
    """Clients of one app, one per role, plus the app's database."""

    admin: TestClient
    worker: TestClient
    reader: TestClient
    anonymous: TestClient
    store: SqlStore
    settings: Settings

    @property
    def db(self) -> Database:
        return self.store.db


def create_tokens(url: str, roles=("admin", "worker", "reader")) -> dict[str, str]:
    """Tokens for ``roles`` in the database at ``url`` (an SQLite file gets its schema first)."""
    db = Database(url)
    if db.engine.dialect.name == "sqlite":
        migrate.upgrade(db.engine)
    with SqlStore(db).write() as tx:
        found = {role: tx.tokens.add(name=f"test-{role}", role=TokenRole(role))[1] for role in roles}
    db.dispose()
    return found


def make_api(url: str, **overrides) -> Api:
    settings = Settings(database_url=url, auth="token", config_cache_seconds=0, **overrides)
    app = create_app(settings)
    store = app.state.cmtune.store
    clients = {}
    for role in ("admin", "worker", "reader"):
        with store.write() as tx:
            _, token = tx.tokens.add(name=f"test-{role}", role=TokenRole(role))
        clients[role] = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    return Api(**clients, anonymous=TestClient(app), store=store, settings=settings)


@pytest.fixture
def api(database_url):
    api = make_api(database_url)
    yield api
    api.db.dispose()


def measurement(problem: dict, config: Decomposition, ratio: float | None, status: str = "ok",
                hardware: dict = HARDWARE) -> dict:
    """A worker's record for ``config`` (synthetic timings: the API layer is under test here)."""
    hw = Hardware(**hardware, jax_version="0.10.2", jaxlib_version="0.10.2")
    if status != "ok":
        m = Measurement(problem=Problem(**problem), decomposition=config, hardware=hw, status=status,
                        message="synthetic failure")
    else:
        m = Measurement(problem=Problem(**problem), decomposition=config, hardware=hw, status="ok",
                        candidate=Timing.of([1e-3 * ratio] * 3), baseline=Timing.of([1e-3] * 3),
                        ratio=ratio, ratio_iqr=0.0, memory_bytes=(48 << 20) + (config.chunks << 20),
                        overlap="synchronous" if config.method == "ring" else "no permutes")
    return m.model_dump(mode="json")


def cost(config: Decomposition) -> float:
    """A deterministic landscape: bidirectional, 2 chunks, full unroll is best (0.7)."""
    if config.method == "baseline":
        return 1.0
    return (0.7 + (0.1 if config.direction == "unidirectional" else 0) + 0.02 * abs(config.chunks - 2)
            + (0.03 if config.unroll != "full" else 0) + (0.01 if config.accumulate == "concat" else 0))


@dataclass(frozen=True)
class Worker:
    """A registered worker: its id, its credential, and a client that sends both tokens.

    Formats as its id, so ``f"/v1/workers/{worker}/lease"`` names it.
    """

    id: int
    credential: str
    client: object  # a TestClient or an httpx.Client with the worker token

    def __format__(self, spec: str) -> str:
        return format(self.id, spec)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Cmtune-Worker": self.credential}

    def post(self, path: str, **kwargs):
        return self.client.post(path, headers=self.headers, **kwargs)

    def delete(self, path: str, **kwargs):
        return self.client.delete(path, headers=self.headers, **kwargs)


def register(client, name: str = "w0", hardware: dict = HARDWARE, software: dict | None = None) -> Worker:
    """A worker of ``software`` (default: jax 0.10.2, what `measurement`'s records say)."""
    response = client.post("/v1/workers", json={"name": name, "hardware": hardware,
                                                "software": software or {"jax": "0.10.2"}})
    assert response.status_code == 201, response.text
    body = response.json()
    return Worker(body["id"], body["credential"], client)


def bounds(problem: dict, compute: float, communication: float, baseline: float, rounds: int = 3,
           hardware: dict = HARDWARE) -> dict:
    """A worker's synthetic bounds rounds (seconds of each program, the same every round)."""
    return BoundsMeasurement(problem=Problem(**problem), hardware=Hardware(**hardware), status="ok",
                             compute=Timing.of([compute] * rounds), communication=Timing.of([communication] * rounds),
                             baseline=Timing.of([baseline] * rounds)).model_dump(mode="json")


def report(worker: Worker, grant: dict, landscape=cost, *, lease_next: bool = False,
           bounds: dict | None = None) -> dict:
    """Report a synthetic result for a leased search or confirmation trial (a confirmation with ``bounds``
    where given); the answer."""
    trial = grant["trial"]
    configs = [Decomposition.model_validate(d) for d in trial["decompositions"]]
    results = [measurement(trial["problem"], c, landscape(c)) for c in configs]
    body = {"lease_id": grant["lease"]["id"], "lease_next": lease_next}
    body |= {"measurement": results[0]} if trial["kind"] == "search" else {"measurements": results}
    if bounds is not None and trial["kind"] == "confirm":
        body["bounds"] = bounds
    reply = worker.post(f"/v1/trials/{trial['id']}/result", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def run_trial(worker: Worker, landscape=cost, bounds_s: tuple[float, float, float] | None = None) -> dict | None:
    """Lease one trial and report a synthetic result; None when nothing was leased.

    The worker's client is a `TestClient` or an `httpx.Client` on a real server (same interface).
    ``bounds_s``: a confirmation's bounds (compute, communication, baseline seconds); None: none sent.
    """
    response = worker.post(f"/v1/workers/{worker}/lease")
    if response.status_code == 204:
        return None
    assert response.status_code == 200, response.text
    grant = response.json()
    trial = grant["trial"]
    if trial["kind"] == "step":
        body = {"lease_id": grant["lease"]["id"], "step": step_result(trial)}
        reply = worker.post(f"/v1/trials/{trial['id']}/result", json=body)
        assert reply.status_code == 200, reply.text
        return grant
    report(worker, grant, landscape, bounds=bounds(trial["problem"], *bounds_s) if bounds_s else None)
    return grant


STEP_SECONDS = {"as-written": 1.0, "baseline": 0.95, "tuned": 0.8}


def step_result(trial: dict, seconds=None, rounds: int = 4, confirmation: dict[str, float] | None = None) -> dict:
    """A worker's synthetic step measurement for a step trial (the service is under test, not the step).

    ``seconds``: per variant name, or a function of (name, per-role configs or None) for a round of the
    step search, which times exactly the variants it names (a name ``seconds`` lacks: as ``tuned``);
    ``confirmation``: the seconds of the variants timed again after the decision (the standard menu).
    """
    from cmtune.tuner.variants import variant_configs
    from collective_matmul.wire import StepMeasurement, StepVariant, TrialTask

    task = TrialTask.model_validate(trial)
    asked = task.step.variants
    measured = asked if asked is not None else variant_configs(task.step.configs)  # what a worker measures
    seconds = seconds or STEP_SECONDS
    if callable(seconds):
        seconds = {name: seconds(name, setting) for name, setting in measured.items()}
    elif asked is not None:
        seconds = {name: seconds.get(name, seconds["tuned"]) for name in asked}

    def timed(seconds: dict[str, float]) -> list[StepVariant]:
        return [StepVariant(name=name, status="ok", configs=measured[name] or {}, timing=Timing.of([s] * rounds),
                            ratio=s / seconds["as-written"], ratio_iqr=0.0, compile_s=1.0)
                for name, s in seconds.items()]

    return StepMeasurement(block=task.step.block, mesh=task.step.mesh, tensor_axis=task.step.tensor_axis,
                           hardware=Hardware(**HARDWARE), protocol=task.protocol,
                           variants=timed(seconds),
                           confirmation=timed(confirmation) if confirmation else []).model_dump(mode="json")
