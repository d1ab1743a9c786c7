"""Studies: create from a problem or a model + mesh, list, inspect, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from cmtune.service import leasing, submitting
from cmtune.service.deps import AdminDep, Id, ReaderDep, StateDep, StoreDep
from cmtune.service.errors import responses
from cmtune.service.models import utcnow
from cmtune.service.views import studies_public, study_public, trial_public
from collective_matmul.planning.problem import HardwareKey
from collective_matmul.wire import (
    StudyCreate,
    StudyCreated,
    StudyPage,
    StudyPublic,
    StudyState,
    TrialPublic,
)

router = APIRouter(prefix="/v1/studies", tags=["studies"], responses=responses(401, 403, 413, 503))


@router.post("", response_model=StudyCreated, status_code=201)
def create_studies(body: StudyCreate, state: StateDep, _: AdminDep) -> StudyCreated:
    """One study per unique problem; problems already tuned or under study are skipped unless ``force``
    (`cmtune.service.submitting`)."""
    request = submitting.Request.of(body)
    with state.store.write() as tx:
        return submitting.submit(tx, state.engine, request, now=utcnow())


@router.get("", response_model=StudyPage)
def list_studies(
    store: StoreDep, _: ReaderDep,
    state: Annotated[StudyState | None, Query(description="only studies in this state")] = None,
    hardware: Annotated[HardwareKey | None, Query(description="hardware key, e.g. cpu:cpu:8:1")] = None,
    offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> StudyPage:
    with store.read() as tx:
        records, total = tx.catalog.list_studies(state=state, hardware=hardware, offset=offset, limit=limit)
        return StudyPage(items=studies_public(tx, records), total=total, offset=offset, limit=limit)


@router.get("/{study_id}", response_model=StudyPublic, responses=responses(404))
def get_study(study_id: Id, store: StoreDep, _: ReaderDep) -> StudyPublic:
    with store.read() as tx:
        return study_public(tx, tx.study(study_id))


@router.get("/{study_id}/trials", response_model=list[TrialPublic], responses=responses(404))
def list_trials(study_id: Id, store: StoreDep, _: ReaderDep) -> list[TrialPublic]:
    with store.read() as tx:
        tx.study(study_id)
        return [trial_public(t) for t in tx.trials(study_id, measurements=True)]


@router.post("/{study_id}/cancel", response_model=StudyPublic, responses=responses(404, 409))
def cancel_study(study_id: Id, state: StateDep, _: AdminDep) -> StudyPublic:
    with state.store.write() as tx:
        leasing.cancel(tx, state.engine, study_id, utcnow())
        return study_public(tx, tx.study(study_id))
