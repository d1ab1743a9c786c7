"""Trial results from workers."""

from __future__ import annotations

from fastapi import APIRouter, Response

from cmtune.service import queue
from cmtune.service.deps import Id, StateDep, WorkerDep
from cmtune.service.errors import ConflictError, responses
from cmtune.service.models import utcnow
from cmtune.service.views import json_response
from collective_matmul.wire import ResultIn, ResultOut

router = APIRouter(prefix="/v1/trials", tags=["trials"], responses=responses(401, 403, 404, 409, 413, 503))


@router.post("/{trial_id}/result", response_model=ResultOut)
def post_result(trial_id: Id, body: ResultIn, state: StateDep, worker_id: WorkerDep) -> Response:
    """Store a result under its lease, from the lease's own worker; the same report twice is harmless, a stale
    or late lease, or another worker's, gets 409.  With ``lease_next``, the answer's ``next`` is the worker's next
    trial (as from ``POST /v1/workers/{id}/lease``), leased in the same transaction: both or neither."""
    with state.store.write() as tx:
        outcome = queue.report(tx, state.engine, state.settings, trial_id=trial_id, lease_id=body.lease_id,
                               results=body.results, kind=body.kind, now=utcnow(), worker_id=worker_id,
                               lease_next=body.lease_next)
    if outcome.expired:  # the expiry is committed; the result is not
        raise ConflictError(f"lease {body.lease_id} expired before its result arrived; trial {trial_id} went back "
                            "to the queue: drop this result and lease again")
    if not outcome.duplicate:
        state.cache.clear()
    return json_response(ResultOut(trial_id=outcome.trial.id, state=outcome.trial.state, duplicate=outcome.duplicate,
                                   next=outcome.next))
