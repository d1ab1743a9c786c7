"""Trial results from workers."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from cmtune.service import leasing
from cmtune.service.deps import WORKER_SECURITY, AppState, Id, worker_of
from cmtune.service.errors import ConflictError, responses
from cmtune.service.models import utcnow
from cmtune.service.views import body_schema, json_body, json_response
from collective_matmul.wire import ResultIn, ResultOut

router = APIRouter(prefix="/v1/trials", tags=["trials"], responses=responses(401, 403, 404, 409, 413, 503))


@router.post("/{trial_id}/result", response_model=ResultOut,
             openapi_extra={**body_schema(ResultIn), "security": WORKER_SECURITY})
async def post_result(trial_id: Id, request: Request) -> Response:
    """Store a result under its lease, from the lease's own worker; the same report twice is harmless, a stale
    or late lease, or another worker's, gets 409.  With ``lease_next``, the answer's ``next`` is the worker's next
    trial (as from ``POST /v1/workers/{id}/lease``), leased in the same transaction: both or neither."""
    # every worker sends this for every trial: the caller and the body are checked here, not as FastAPI
    # dependencies (solving those cost more than the checks), then the store's work runs in a thread
    worker_id = await worker_of(request)
    body = await json_body(request, ResultIn)
    return await run_in_threadpool(_store_result, request.app.state.cmtune, trial_id, body, worker_id)


def _store_result(state: AppState, trial_id: int, body: ResultIn, worker_id: int) -> Response:
    now = utcnow()  # when the result arrived, not when the write lock was granted (SQLite)
    with state.store.write() as tx:
        outcome = leasing.report(tx, state.engine, state.settings, trial_id=trial_id, lease_id=body.lease_id,
                                 result=body.result, now=now, worker_id=worker_id, lease_next=body.lease_next)
    if outcome.expired:  # the expiry is committed; the result is not
        raise ConflictError(f"lease {body.lease_id} expired before its result arrived; trial {trial_id} went back "
                            "to the queue: drop this result and lease again")
    if not outcome.duplicate:
        state.cache.clear()
    return json_response(ResultOut(trial_id=outcome.trial.id, state=outcome.trial.state, duplicate=outcome.duplicate,
                                   next=outcome.next))
