"""Domain records → public API bodies (shared by the routers), with the derived values filled in."""

from __future__ import annotations

import datetime as dt
from typing import TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from cmtune.service.store import SqlTx, WorkerInfo
from cmtune.tuner.store import StudyRecord, TrialRecord
from collective_matmul.wire import (
    BestSoFar,
    SeedPublic,
    StudyKind,
    StudyPublic,
    StudyState,
    TrialKind,
    TrialPublic,
    WorkerPublic,
    reconfirm_outcome,
)


def json_response(body: BaseModel, status_code: int = 200) -> Response:
    """``body`` serialised where the route runs: a hot route's answer (lease, result) is not handed to
    another thread to be serialised, as FastAPI does with what a blocking route returns."""
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json")


Body = TypeVar("Body", bound=BaseModel)


async def json_body(request: Request, model: type[Body]) -> Body:
    """``model`` from the request's JSON body, parsed and validated by pydantic in one pass (FastAPI parses the
    JSON to Python objects, then validates those); a bad body is a 422 of FastAPI's shape (``loc`` from
    ``body``).  The route documents the body with `body_schema`."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",), "input": None,
                                       "msg": f"send JSON (Content-Type: application/json), not {kind or 'no type'}"}])
    raw = await request.body()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])}
                                      for error in exc.errors(include_url=False)]) from None


SELF_PARSED: dict[str, type[BaseModel]] = {}  # bodies routes read with `json_body`, by schema name


def body_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that reads ``model`` with `json_body` (``openapi_extra``); the
    app adds the schemas of every such model to the components (`cmtune.service.main`)."""
    SELF_PARSED[model.__name__] = model
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def studies_public(tx: SqlTx, records: list[StudyRecord]) -> list[StudyPublic]:
    """Public bodies for a page of studies: three queries whatever the page size (none for studies still
    pending: nothing of theirs was leased yet, and only a finished study writes a tuned config)."""
    ids = [s.id for s in records if s.state != StudyState.PENDING]
    leased = tx.catalog.leased_counts(ids)
    best = tx.catalog.trial_decompositions([s.best_trial_id for s in records
                                            if s.best_trial_id is not None and s.kind == StudyKind.SEARCH])
    tuned = tx.catalog.tuned_of_studies(ids)
    out = []
    for s in records:
        config = tuned.get(s.id)
        winner = best.get(s.best_trial_id) if s.best_trial_id is not None else None
        out.append(StudyPublic(
            id=s.id, kind=s.kind, state=s.state, problem=s.problem,
            problem_key=s.problem.key if s.problem is not None else f"step:{s.step.block.name}", hardware=s.hardware,
            hardware_key=s.hardware.key, settings=s.settings.model_dump(mode="json"), space_size=s.space_size,
            trials_done=s.trials_done,
            trials_budget=_step_budget(s) if s.kind == StudyKind.STEP else 1 if s.reconfirm is not None
            else min(s.settings.max_trials or s.space_size, s.space_size),
            trials_running=leased.get(s.id, 0),
            best=BestSoFar(decomposition=winner, decomposition_id=winner.id, ratio=s.best_ratio,
                           speedup=1 / s.best_ratio, trial_id=s.best_trial_id)
            if winner and s.best_ratio and s.kind == StudyKind.SEARCH else None,
            tuned=config, tuned_decomposition_id=config.decomposition.id if config else None,
            stop_reason=s.stop_reason, message=s.message, created_at=s.created_at, started_at=s.started_at,
            finished_at=s.finished_at, decision=s.decision, software=s.software, reconfirm=s.reconfirm,
            outcome=reconfirm_outcome(s.state, s.stop_reason) if s.reconfirm is not None else None,
            seeds=[SeedPublic(**seed.model_dump(), decomposition_id=seed.decomposition.id)
                   for seed in s.settings.seeds],
        ))
    return out


def _step_budget(study: StudyRecord) -> int:
    """A step study's trials at most: its search rounds and the grading, or one round of the menu."""
    return study.step.search_rounds + 1 if study.step.searches else 1


def study_public(tx: SqlTx, record: StudyRecord) -> StudyPublic:
    return studies_public(tx, [record])[0]


def trial_public(trial: TrialRecord) -> TrialPublic:
    first = (trial.measurements or (None,))[0] if trial.kind == TrialKind.SEARCH else None
    return TrialPublic(
        id=trial.id, study_id=trial.study_id, number=trial.number, kind=trial.kind,
        decompositions=list(trial.decompositions), decomposition_id=trial.decomposition_id, state=trial.state,
        attempts=trial.attempts, status=trial.status, ratio=trial.ratio,
        speedup=1 / trial.ratio if trial.ratio else None,
        median_s=first.candidate.median_s if first and first.candidate else None,
        iqr_s=first.candidate.iqr_s if first and first.candidate else None,
        baseline_s=first.baseline.median_s if first and first.baseline else None,
        message=trial.message, worker_id=trial.worker_id, created_at=trial.created_at, finished_at=trial.finished_at,
        step=trial.step, variants=list(trial.variants or ()), bounds=trial.bounds,
    )


def worker_public(worker: WorkerInfo, *, current_trial_id: int | None, online_after: dt.datetime) -> WorkerPublic:
    return WorkerPublic(
        id=worker.id, name=worker.name, hardware=worker.hardware, hardware_key=worker.hardware.key,
        ring_keys=[ring.key for ring in worker.hardware.rings()],
        software=worker.software, software_key=worker.software.key, registered_at=worker.registered_at,
        last_heartbeat=worker.last_heartbeat,
        online=worker.active and worker.last_heartbeat >= online_after, active=worker.active,
        current_trial_id=current_trial_id, trials_done=worker.trials_done, memory_bytes=worker.memory_bytes,
    )
