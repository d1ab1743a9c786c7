"""Tuned-config look-ups (one or many) and bundles (export, import)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from cmtune.service.deps import AdminDep, ReaderDep, StateDep, StoreDep
from cmtune.service.errors import InvalidError, responses
from collective_matmul.planning.models import ModelName
from collective_matmul.planning.problem import (
    DeviceKind,
    FlagsDigest,
    Hardware,
    Platform,
    PlatformVersion,
    Problem,
    Software,
    Version,
)
from collective_matmul.planning.text import label
from collective_matmul.wire import Bundle, ConfigAnswer, ConfigQueryBatch, RoleOverride, ShortText, TunedPublic
from collective_matmul.wire.lookup import Unmeasured

SLICE_DEVICES = "the devices of the slice the ring is part of (default: the ring is the whole machine)"

router = APIRouter(tags=["configs"], responses=responses(401, 403, 413, 503))


UnmeasuredQuery = Annotated[Unmeasured, Query(description=(
    "what answers a problem nothing has measured on this hardware: baseline (the default: match 'baseline', "
    "reason 'not measured on this hardware') or costmodel (match 'model': the cost model's choice on the device "
    "kind's profile, a ring no one has timed; the baseline where the kind has no figures)"))]


def _validated(model, **fields):
    try:
        return model(**fields)
    except ValidationError as exc:
        raise InvalidError("; ".join(f"{'.'.join(map(str, e['loc'])) or model.__name__.lower()}: {e['msg']}"
                                     for e in exc.errors())) from None


@router.get("/v1/configs", response_model=ConfigAnswer)
async def get_config(
    state: StateDep, _: ReaderDep,
    collective: Annotated[ShortText, Query(examples=["allgather_matmul"])],
    m: Annotated[int, Query(gt=0)], k: Annotated[int, Query(gt=0)], n: Annotated[int, Query(gt=0)],
    dtype: Annotated[label(16), Query(examples=["bfloat16"])], axis_size: Annotated[int, Query(gt=0)],
    platform: Annotated[Platform, Query(examples=["tpu"])],
    device_kind: Annotated[DeviceKind, Query(examples=["TPU v5p"])],
    device_count: Annotated[int | None, Query(gt=0, description="default: axis_size")] = None,
    process_count: Annotated[int, Query(gt=0)] = 1,
    slice_devices: Annotated[int | None, Query(gt=0, description=SLICE_DEVICES)] = None,
    jax: Annotated[Version | None, Query(description="the caller's software stack (collective_matmul.planning.problem."
                                                      "Software): jax, jaxlib, platform_version, flags")] = None,
    jaxlib: Annotated[Version | None, Query()] = None,
    platform_version: Annotated[PlatformVersion | None, Query()] = None,
    flags: Annotated[FlagsDigest | None, Query(description="flags_digest of XLA_FLAGS and LIBTPU_INIT_ARGS")] = None,
    unmeasured: UnmeasuredQuery = "baseline",
) -> ConfigAnswer:
    """The config for one problem: ``match`` says whether it is exact, stale (measured on another software stack
    than the caller's), nearest, or, where nothing was measured on this hardware, baseline (or model, with
    ``unmeasured=costmodel``), its ``reason`` saying why; a look-up that names no stack is answered from the newest
    measurement of any stack, and its ``note`` says so."""
    problem = _validated(Problem, collective=collective, m=m, k=k, n=n, dtype=dtype, axis_size=axis_size)
    hardware = _validated(Hardware, platform=platform, device_kind=device_kind, device_count=device_count or axis_size,
                          process_count=process_count, slice_devices=slice_devices)
    stack = {name: value for name, value in (("jax", jax), ("jaxlib", jaxlib), ("platform_version", platform_version),
                                             ("flags", flags)) if value is not None}
    software = _validated(Software, **stack) if stack else None
    await state.cache.ensure(hardware)
    return Response(state.cache.lookup_json(problem, hardware, software, unmeasured), media_type="application/json")


@router.post("/v1/configs/query", response_model=list[ConfigAnswer])
async def query_configs(body: ConfigQueryBatch, state: StateDep, _: ReaderDep,
                        unmeasured: UnmeasuredQuery = "baseline") -> Response:
    """Many look-ups at once, answered in order (as ``GET /v1/configs`` answers each; ``unmeasured`` for them all).

    One batch at a time per server process: the others wait their turn on the event loop, holding
    no request thread, so that large batches cannot starve every other request.
    """
    queries = [(q.problem, _validated(Hardware, platform=q.platform, device_kind=q.device_kind,
                                      device_count=q.device_count or q.problem.axis_size,
                                      process_count=q.process_count, slice_devices=q.slice_devices), q.software)
               for q in body.queries]
    async with state.batch_turn:
        for hardware in {h.key: h for _, h, _ in queries}.values():
            await state.cache.ensure(hardware)
        answers = await run_in_threadpool(lambda: [state.cache.lookup_json(*query, unmeasured) for query in queries])
    return Response(b"[" + b",".join(answers) + b"]", media_type="application/json")


@router.get("/v1/tuned", response_model=list[TunedPublic])
def list_tuned(store: StoreDep, _: ReaderDep, platform: Annotated[Platform | None, Query()] = None,
               device_kind: Annotated[DeviceKind | None, Query()] = None) -> list[TunedPublic]:
    """Every tuned config (filtered by hardware), one per software stack, with keys, ids and the study that
    tuned it."""
    with store.read() as tx:
        return [TunedPublic.of(row.config, row.study_id)
                for row in tx.catalog.tuned_rows(platform=platform, device_kind=device_kind)]


@router.get("/v1/overrides", response_model=list[RoleOverride])
def list_overrides(
    store: StoreDep, _: ReaderDep,
    model: Annotated[ModelName, Query(description="the model's name")],
    platform: Annotated[Platform, Query()], device_kind: Annotated[DeviceKind, Query()],
    device_count: Annotated[int, Query(gt=0)], process_count: Annotated[int, Query(gt=0)] = 1,
    slice_devices: Annotated[int | None, Query(gt=0, description=SLICE_DEVICES)] = None,
) -> list[RoleOverride]:
    """The roles of ``model`` that run otherwise than their problems' tuned configs on this hardware, and why."""
    hardware = _validated(Hardware, platform=platform, device_kind=device_kind, device_count=device_count,
                          process_count=process_count, slice_devices=slice_devices)
    with store.read() as tx:
        return tx.catalog.overrides(model=model, hardware=hardware)


@router.get("/v1/bundles", response_model=Bundle)
def export_bundle(store: StoreDep, _: ReaderDep, platform: Annotated[Platform | None, Query()] = None,
                  device_kind: Annotated[DeviceKind | None, Query()] = None) -> Bundle:
    """Every tuned config and role override (filtered by hardware) as a bundle file for offline use."""
    with store.read() as tx:
        return Bundle(configs=tx.catalog.list_tuned(platform=platform, device_kind=device_kind),
                      overrides=tx.catalog.overrides(platform=platform, device_kind=device_kind))


@router.post("/v1/bundles", status_code=201)
def import_bundle(bundle: Bundle, state: StateDep, _: AdminDep) -> dict:
    """Store every config and override of a bundle (replacing entries with the same keys: a config's are its
    problem, hardware and software stack), all or nothing.

    Each override must carry its role's problems (bundles written by cmtune 0.3 and later do): its
    configs are checked against them here, as a worker's step result is, and again where they are applied.
    """
    unchecked = [f"{o.model} {o.role}" for o in bundle.overrides if o.problems is None]
    if unchecked:
        raise InvalidError(f"overrides without their problems cannot be checked, so none was imported: "
                           f"{', '.join(unchecked[:5])}{' ...' if len(unchecked) > 5 else ''}; export the bundle "
                           "again with cmtune 0.3 or later (or `cmtune verify --step ... --decide`), which writes them")
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
