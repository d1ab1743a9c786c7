"""Tuned-config look-ups (one or many) and bundles (export, import)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import ValidationError

from cmtune.service.deps import AdminDep, ReaderDep, StateDep, StoreDep
from cmtune.service.errors import InvalidError, responses
from collective_matmul.problem import Hardware, Problem
from collective_matmul.wire import Bundle, ConfigAnswer, ConfigQueryBatch, RoleOverride, TunedPublic

router = APIRouter(tags=["configs"], responses=responses(401, 403, 413, 503))


def _validated(model, **fields):
    try:
        return model(**fields)
    except ValidationError as exc:
        raise InvalidError("; ".join(f"{'.'.join(map(str, e['loc'])) or model.__name__.lower()}: {e['msg']}"
                                     for e in exc.errors())) from None


@router.get("/v1/configs", response_model=ConfigAnswer)
async def get_config(
    state: StateDep, _: ReaderDep,
    collective: Annotated[str, Query(max_length=64, examples=["allgather_matmul"])],
    m: Annotated[int, Query(gt=0)], k: Annotated[int, Query(gt=0)], n: Annotated[int, Query(gt=0)],
    dtype: Annotated[str, Query(max_length=16, examples=["bfloat16"])], axis_size: Annotated[int, Query(gt=0)],
    platform: Annotated[str, Query(max_length=64, examples=["tpu"])],
    device_kind: Annotated[str, Query(max_length=128, examples=["TPU v5p"])],
    device_count: Annotated[int | None, Query(gt=0, description="default: axis_size")] = None,
    process_count: Annotated[int, Query(gt=0)] = 1,
) -> ConfigAnswer:
    """The config for one problem: ``match`` says whether it is exact, nearest, model or baseline."""
    problem = _validated(Problem, collective=collective, m=m, k=k, n=n, dtype=dtype, axis_size=axis_size)
    hardware = _validated(Hardware, platform=platform, device_kind=device_kind, device_count=device_count or axis_size,
                          process_count=process_count)
    await state.cache.ensure(hardware)
    return Response(state.cache.lookup_json(problem, hardware), media_type="application/json")


@router.post("/v1/configs/query", response_model=list[ConfigAnswer])
def query_configs(body: ConfigQueryBatch, state: StateDep, _: ReaderDep) -> list[ConfigAnswer]:
    """Many look-ups at once, answered in order."""
    return [state.cache.lookup(q.problem, _validated(
        Hardware, platform=q.platform, device_kind=q.device_kind, device_count=q.device_count or q.problem.axis_size,
        process_count=q.process_count)) for q in body.queries]


@router.get("/v1/tuned", response_model=list[TunedPublic])
def list_tuned(store: StoreDep, _: ReaderDep, platform: Annotated[str | None, Query(max_length=64)] = None,
               device_kind: Annotated[str | None, Query(max_length=128)] = None) -> list[TunedPublic]:
    """Every tuned config (filtered by hardware), with keys, ids and the study that tuned it."""
    with store.read() as tx:
        return [TunedPublic.of(row.config, row.study_id)
                for row in tx.tuned_rows(platform=platform, device_kind=device_kind)]


@router.get("/v1/overrides", response_model=list[RoleOverride])
def list_overrides(
    store: StoreDep, _: ReaderDep,
    model: Annotated[str, Query(min_length=1, max_length=200, description="the model's name")],
    platform: Annotated[str, Query(max_length=64)], device_kind: Annotated[str, Query(max_length=128)],
    device_count: Annotated[int, Query(gt=0)], process_count: Annotated[int, Query(gt=0)] = 1,
) -> list[RoleOverride]:
    """The roles of ``model`` that run otherwise than their problems' tuned configs on this hardware, and why."""
    hardware = _validated(Hardware, platform=platform, device_kind=device_kind, device_count=device_count,
                          process_count=process_count)
    with store.read() as tx:
        return tx.overrides(model=model, hardware=hardware)


@router.get("/v1/bundles", response_model=Bundle)
def export_bundle(store: StoreDep, _: ReaderDep, platform: Annotated[str | None, Query(max_length=64)] = None,
                  device_kind: Annotated[str | None, Query(max_length=128)] = None) -> Bundle:
    """Every tuned config and role override (filtered by hardware) as a bundle file for offline use."""
    with store.read() as tx:
        return Bundle(configs=tx.list_tuned(platform=platform, device_kind=device_kind),
                      overrides=tx.overrides(platform=platform, device_kind=device_kind))


@router.post("/v1/bundles", status_code=201)
def import_bundle(bundle: Bundle, state: StateDep, _: AdminDep) -> dict:
    """Store every config and override of a bundle (replacing entries with the same keys), all or nothing."""
    with state.store.write() as tx:
        for config in bundle.configs:
            tx.save_tuned(config, study_id=None)
        groups: dict[tuple[str, str], dict] = {}
        for override in bundle.overrides:  # the same (model, role, hardware) twice: the last one counts
            groups.setdefault((override.model, override.hardware.key), {})[override.role] = override
        for group in groups.values():
            first = next(iter(group.values()))
            tx.save_overrides(first.model, first.hardware, list(group.values()))
    state.cache.clear()
    return {"imported": len(bundle.configs), "overrides": len(bundle.overrides)}
