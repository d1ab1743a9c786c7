"""Studies: create from a problem or a model + mesh, list, inspect, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from cmtune.service import leasing
from cmtune.service.deps import AdminDep, Id, ReaderDep, StateDep, StoreDep
from cmtune.service.errors import InvalidError, responses
from cmtune.service.models import utcnow
from cmtune.service.views import studies_public, study_public, trial_public
from cmtune.tuner.engine import study_settings
from collective_matmul.models import PRESETS, MeshSpec, TransformerBlock, model_problems
from collective_matmul.problem import HardwareKey
from collective_matmul.space import has_ring, no_ring_reason
from collective_matmul.wire import (
    Protocol,
    Skipped,
    StudyCreate,
    StudyCreated,
    StudyPage,
    StudyPublic,
    StudyState,
    TrialPublic,
)

router = APIRouter(prefix="/v1/studies", tags=["studies"], responses=responses(401, 403, 413, 503))
MAX_COUNT = (1 << 31) - 1  # runs per step of one problem (an integer column)


def _model(body: StudyCreate) -> TransformerBlock:
    """The submitted block: a preset name or an inline shape (never a path on the server)."""
    if isinstance(body.model, TransformerBlock):
        return body.model
    if body.model not in PRESETS:
        raise InvalidError(f"unknown model {body.model!r}: not a preset {sorted(PRESETS)}; send a preset name or "
                           "the block's shape inline (d_model, d_ff, heads, head_dim, seq_len, global_batch, ...)")
    return PRESETS[body.model]


def _discovered(body: StudyCreate) -> tuple[MeshSpec, list[tuple]]:
    """A discovered step's mesh and its unique problems, each with its roles (``role`` or ``role.slot``)."""
    found = body.discovered
    axes = {p.axis for p in found.problems if p.axis is not None}
    unknown = sorted(axes - set(found.mesh))
    if unknown:
        raise InvalidError(f"problems name mesh axes {unknown} that are not in the mesh {found.mesh}")
    tensor_axis = axes.pop() if len(axes) == 1 else list(found.mesh)[-1]
    targets: dict[str, list] = {}
    for p in found.problems:
        entry = targets.setdefault(p.problem.key, [p.problem, [], 0])
        entry[1].append(p.role if p.slot == "forward" else f"{p.role}.{p.slot}")
        entry[2] += p.count
        if entry[2] > MAX_COUNT:
            raise InvalidError(f"{p.problem.key} runs {entry[2]} times per step in all: at most {MAX_COUNT}")
    return MeshSpec(axes=found.mesh, tensor_axis=tensor_axis), [tuple(t) for t in targets.values()]


@router.post("", response_model=StudyCreated, status_code=201)
def create_studies(body: StudyCreate, state: StateDep, _: AdminDep) -> StudyCreated:
    """One study per unique problem; problems already tuned or under study are skipped unless ``force``."""
    hardware = body.hardware.to_hardware()
    model = mesh = submitted = None
    if body.problem is not None:
        targets = [(body.problem, ["problem"], 1)]
    elif body.discovered is not None:
        mesh, targets = _discovered(body)
        submitted = {"name": body.discovered.name, "discovered": True, "layers": 1}  # counts are per step
    else:
        model = _model(body)
        try:
            mesh = MeshSpec(axes=body.mesh.axes, tensor_axis=body.mesh.tensor_axis)
            targets = [(mp.problem, list(mp.roles), mp.count) for mp in model_problems(model, mesh)]
        except ValueError as exc:
            raise InvalidError(str(exc)) from None
        submitted = model.model_dump(mode="json")
    for problem, _roles, _count in targets:
        if problem.axis_size != hardware.device_count:
            raise InvalidError(
                f"{problem.key} is a ring of {problem.axis_size} devices but the hardware has device_count="
                f"{hardware.device_count}; tune each ring on hardware of its size")
    if body.problem is not None and not has_ring(body.problem):
        raise InvalidError(f"{body.problem.key}: nothing to tune: {no_ring_reason(body.problem)}")
    now = utcnow()
    created, skipped, depends_on = [], [], []
    with state.store.write() as tx:
        if model is not None and body.step.measure and not body.force:
            # two identical submissions at once: the second sees the first's study
            tx.submissions.lock_hardware(hardware)
            joined = state.engine.step_study_of(tx, block=model, mesh=mesh, hardware=hardware)
            if joined is not None:
                return StudyCreated(studies=[], submission_id=joined.submission_id, joined=True, skipped=[
                    Skipped(problem=f"step:{model.name}", study_id=joined.id, reason="under study")])
        memory = tx.workers.memory(hardware)
        for problem, _roles, _count in targets:
            if memory is not None and problem.device_bytes > memory:
                raise InvalidError(
                    f"{problem.key}: its inputs need {problem.device_bytes / 2**30:.1f} GiB per device, but the "
                    f"workers of {hardware.key} report at most {memory / 2**30:.1f} GiB: shrink m, k or n (or the "
                    "batch)")
        submission_id = None
        if submitted is not None:
            submission_id = tx.submissions.add(model=submitted, mesh=mesh.model_dump(mode="json"), hardware=hardware,
                                              now=now)
        for problem, roles, count in targets:
            existing = None if body.force else tx.catalog.find_study(problem, hardware)
            tuned = None if body.force or existing is not None else tx.catalog.tuned(problem, hardware)
            if not has_ring(problem):
                skipped.append(Skipped(problem=problem.key, study_id=None, reason="nothing to tune"))
                study_id = None
            elif existing is not None or tuned is not None:
                study_id = existing.id if existing is not None else tuned.study_id
                reason = "under study" if existing is not None and existing.state != StudyState.COMPLETED \
                    else "already tuned"
                skipped.append(Skipped(problem=problem.key, study_id=study_id, reason=reason))
            else:
                settings = study_settings(problem, hardware, trials=body.budget.trials, minutes=body.budget.minutes,
                                          patience=body.budget.patience, sampler=body.sampler, seed=body.seed,
                                          confirm_top=body.confirm_top)
                protocol = Protocol(repeats=body.repeats, seed=body.seed, timeout_s=body.timeout_s)
                study = state.engine.create_study(tx, problem=problem, hardware=hardware, settings=settings,
                                                  protocol=protocol, now=now)
                created.append(study)
                study_id = study.id
            if submission_id is not None:
                tx.submissions.link(submission_id=submission_id, study_id=study_id, problem=problem, roles=roles,
                                   count=count)
                if study_id is not None:
                    depends_on.append(study_id)
        if model is not None and body.step.measure:  # a user's step is measured where it runs (cmtune verify)
            created.append(state.engine.create_step_study(
                tx, block=model, mesh=mesh, hardware=hardware, depends_on=depends_on, now=now,
                protocol=Protocol(repeats=body.step.repeats, seed=body.seed, timeout_s=body.timeout_s),
                submission_id=submission_id, ablation=body.step.ablation))
        return StudyCreated(studies=studies_public(tx, created), submission_id=submission_id, skipped=skipped)


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
