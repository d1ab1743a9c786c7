"""The FastAPI app: wiring only."""

from __future__ import annotations

import gc
import sys
import time
from contextlib import asynccontextmanager
from importlib.metadata import version

from anyio import to_thread
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from cmtune.service import errors, migrate, views
from cmtune.service.db import Database
from cmtune.service.deps import AppState
from cmtune.service.guard import GuardMiddleware
from cmtune.service.lookup import ConfigCache
from cmtune.service.routers import configs, dashboard, health, studies, submissions, trials, workers
from cmtune.service.settings import Settings, get_settings
from cmtune.service.store import SqlStore
from cmtune.tuner.engine import Engine

# How long a thread that holds the GIL keeps it while another waits (Python's default: 5 ms).  A CPU-bound
# request (a batch of cost-model look-ups) would otherwise add up to 5 ms to every small request's each
# wait for the GIL; 0.5 ms keeps their latency within a small factor (bench/batch.py, docs/benchmarks.md).
SWITCH_INTERVAL_S = 0.0005

DESCRIPTION = """Tune collective-matmul decompositions on real devices and serve the best configs.

Admins submit problems or model + mesh (`POST /v1/studies`); workers lease trials
(`POST /v1/workers/{id}/lease`) and report results; training code looks configs up
(`GET /v1/configs`) or exports a bundle (`GET /v1/bundles`).  Send `Authorization: Bearer <token>`.
"""


class SchemaOutOfDate(RuntimeError):
    pass


def prepare_database(db: Database) -> None:
    """Upgrade an embedded SQLite file; refuse a PostgreSQL schema that is not current."""
    if db.engine.dialect.name == "sqlite":
        migrate.upgrade(db.engine)
        return
    current, head = migrate.current_revision(db.engine), migrate.head_revision(db.engine)
    if current != head:
        raise SchemaOutOfDate(
            f"database schema is at {current or 'nothing'}, this cmtune needs {head}: "
            "run 'cmtune db upgrade' (with the same CMTUNE_DATABASE_URL) first"
        )


def create_app(settings: Settings | None = None, *, prepare: bool = True) -> FastAPI:
    """The app; ``prepare=False`` skips the schema step (a parent process has done it)."""
    settings = settings or get_settings()
    db = Database(settings.database_url)
    if prepare:
        prepare_database(db)
    store = SqlStore(db)
    state = AppState(settings=settings, store=store, engine=Engine(ready=settings.ready_proposals),
                     cache=ConfigCache(store, settings.config_cache_seconds))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        to_thread.current_default_thread_limiter().total_tokens = settings.request_threads
        yield

    app = FastAPI(title="cmtune", version=version("cmtune"), description=DESCRIPTION, lifespan=lifespan)
    app.state.cmtune = state
    app.state.registry, latency = health.make_registry(state)
    errors.register(app)
    for module in (studies, workers, trials, configs, submissions, health, dashboard):
        app.include_router(module.router)
    app.mount("/ui/static", StaticFiles(directory=dashboard.STATIC), name="dashboard-static")

    app.add_middleware(GuardMiddleware, state=state)  # before any body is read or parsed
    app.add_middleware(LatencyMiddleware, histogram=latency)
    _document_bodies(app, *views.SELF_PARSED.values())
    return app


def _document_bodies(app: FastAPI, *models: type[BaseModel]) -> None:
    """Adds to the OpenAPI components the bodies that routes read themselves (`views.json_body`, declared by
    `views.body_schema`), and the models they refer to, where FastAPI has not named them already."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            components = generate().setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, definition in schema.pop("$defs", {}).items():
                    components.setdefault(name, definition)
                components.setdefault(model.__name__, schema)
        return app.openapi_schema

    app.openapi = openapi


def serve_app() -> FastAPI:
    """Factory for each process of ``cmtune serve --workers N`` (settings from the environment).

    The start-up heap (SQLAlchemy, pydantic, Optuna) never dies: it is frozen out of the garbage
    collector's full passes, which would otherwise stall requests for tens of milliseconds.
    """
    app = create_app(get_settings(), prepare=False)
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return app


class LatencyMiddleware:
    """Observes request latency by route template (plain ASGI: no per-request task overhead)."""

    def __init__(self, app, histogram):
        self.app, self.histogram = app, histogram

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            self.histogram.labels(scope["method"], getattr(route, "path", "unmatched"), str(status["code"])).observe(
                time.perf_counter() - start)
