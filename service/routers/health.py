"""Liveness and Prometheus metrics."""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import text

from cmtune.service.deps import StateDep
from cmtune.service.errors import responses
from cmtune.service.models import utcnow

router = APIRouter(tags=["health"])


@router.get("/healthz", responses=responses(503))
def healthz(state: StateDep) -> dict:
    """200 when the service can reach its database (anonymous: it says no more than that)."""
    with state.store.read() as tx:
        tx.connection.execute(text("SELECT 1"))
    return {"status": "ok", "database": state.store.db.engine.dialect.name}


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


class StoreCollector:
    """Gauges read from the database at scrape time."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        studies = GaugeMetricFamily("cmtune_studies", "Studies by state", labels=["state"])
        trials = GaugeMetricFamily("cmtune_trials", "Trials by state", labels=["state"])
        with self.state.store.read() as tx:
            for name, count in sorted(tx.catalog.count_studies_by_state().items()):
                studies.add_metric([name], count)
            for name, count in sorted(tx.catalog.count_trials_by_state().items()):
                trials.add_metric([name], count)
            leases = tx.leases.count_active()
            since = utcnow() - dt.timedelta(seconds=self.state.settings.worker_offline_seconds)
            online = tx.workers.count_online(since=since)
        yield studies
        yield trials
        yield GaugeMetricFamily("cmtune_leases_active", "Active leases", value=leases)
        yield GaugeMetricFamily("cmtune_workers_online", "Workers with a recent heartbeat", value=online)


def make_registry(state) -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    latency = Histogram("cmtune_http_request_seconds", "Request latency", ["method", "route", "status"],
                        registry=registry, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
    registry.register(StoreCollector(state))
    return registry, latency
