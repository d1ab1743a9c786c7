"""Trial results from workers."""

from __future__ import annotations

from fastapi import APIRouter

from service.deps import StateDep, WorkerRoleDep
from service.queue import report
from service.schemas import ResultIn, ResultOut

router = APIRouter(prefix="/v1/trials", tags=["trials"])


@router.post("/{trial_id}/result", response_model=ResultOut)
def post_result(trial_id: int, body: ResultIn, state: StateDep, _: WorkerRoleDep) -> ResultOut:
    """Store a result under its lease; the same report twice is harmless, a stale lease gets 409."""
    kind = "search" if body.measurement is not None else "confirm"
    measurements = [body.measurement] if body.measurement is not None else body.measurements
    with state.db.session(write=True) as session:
        trial, duplicate = report(session=session, trial_id=trial_id, lease_id=body.lease_id,
                                  measurements=measurements, kind=kind)
        result = ResultOut(trial_id=trial.id, state=trial.state, duplicate=duplicate)
    if not duplicate:
        state.cache.clear()
    return result
