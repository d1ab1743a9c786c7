"""Tuned-config look-ups (one or many) and bundles (export, import)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import ValidationError

from collective_matmul import Hardware, Problem
from collective_matmul.bundle import Bundle
from service import repository as repo
from service.deps import AdminDep, ReaderDep, SessionDep, StateDep
from service.errors import InvalidError
from service.schemas import ConfigAnswer, ConfigQuery, ConfigQueryBatch

router = APIRouter(tags=["configs"])


def _hardware(platform: str, device_kind: str, device_count: int | None, process_count: int, axis_size: int):
    try:
        return Hardware(platform=platform, device_kind=device_kind, device_count=device_count or axis_size,
                        process_count=process_count)
    except ValidationError as exc:
        raise InvalidError(f"bad hardware: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from None


@router.get("/v1/configs", response_model=ConfigAnswer)
async def get_config(
    state: StateDep, _: ReaderDep,
    collective: Annotated[str, Query(examples=["allgather_matmul"])],
    m: Annotated[int, Query(gt=0)], k: Annotated[int, Query(gt=0)], n: Annotated[int, Query(gt=0)],
    dtype: Annotated[str, Query(examples=["bfloat16"])], axis_size: Annotated[int, Query(gt=0)],
    platform: Annotated[str, Query(examples=["tpu"])], device_kind: Annotated[str, Query(examples=["TPU v5p"])],
    device_count: Annotated[int | None, Query(gt=0, description="default: axis_size")] = None,
    process_count: Annotated[int, Query(gt=0)] = 1,
) -> ConfigAnswer:
    """The config for one problem: ``match`` says whether it is exact, nearest, model or baseline."""
    try:
        problem = Problem(collective=collective, m=m, k=k, n=n, dtype=dtype, axis_size=axis_size)
    except ValidationError as exc:
        raise InvalidError("; ".join(f"{'.'.join(map(str, e['loc'])) or 'problem'}: {e['msg']}"
                                     for e in exc.errors())) from None
    hardware = _hardware(platform, device_kind, device_count, process_count, axis_size)
    await state.cache.ensure(hardware)
    return Response(state.cache.lookup_json(problem, hardware), media_type="application/json")


@router.post("/v1/configs/query", response_model=list[ConfigAnswer])
def query_configs(body: ConfigQueryBatch, state: StateDep, _: ReaderDep) -> list[ConfigAnswer]:
    """Many look-ups at once, answered in order."""
    return [state.cache.lookup(q.problem, _query_hardware(q)) for q in body.queries]


def _query_hardware(q: ConfigQuery) -> Hardware:
    return _hardware(q.platform, q.device_kind, q.device_count, q.process_count, q.problem.axis_size)


@router.get("/v1/bundles", response_model=Bundle)
def export_bundle(session: SessionDep, _: ReaderDep, platform: str | None = None,
                  device_kind: str | None = None) -> Bundle:
    """Every tuned config (filtered by hardware) as a bundle file for offline use."""
    rows = repo.list_tuned(session=session, platform=platform, device_kind=device_kind)
    return Bundle(configs=[repo.to_tuned_config(r) for r in rows])


@router.post("/v1/bundles", status_code=201)
def import_bundle(bundle: Bundle, state: StateDep, _: AdminDep) -> dict:
    """Store every config of a bundle (replacing entries of the same problem and hardware), all or nothing."""
    with state.db.session(write=True) as session:
        for config in bundle.configs:
            repo.upsert_tuned(session=session, config=config, study_id=None)
    state.cache.clear()
    return {"imported": len(bundle.configs)}
