"""The FastAPI app: wiring only."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request

from service import errors, migrate
from service.db import Database
from service.deps import AppState
from service.lookup import ConfigCache
from service.routers import configs, health, studies, submissions, trials, workers
from service.settings import Settings, get_settings

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


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    db = Database(settings.database_url)
    prepare_database(db)
    state = AppState(settings=settings, db=db, cache=ConfigCache(db, settings.config_cache_seconds))
    app = FastAPI(title="cmtune", version="0.1.0", description=DESCRIPTION)
    app.state.cmtune = state
    app.state.token_cache = {}
    app.state.registry, latency = health.make_registry(state)
    errors.register(app)
    for module in (studies, workers, trials, configs, submissions, health):
        app.include_router(module.router)

    @app.middleware("http")
    async def _observe(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        latency.labels(request.method, getattr(route, "path", "unmatched"), str(response.status_code)).observe(
            time.perf_counter() - start)
        return response

    return app
