"""Submitting: what ``POST /v1/studies`` does with a problem, a model + mesh, or a user's discovered step.

`Request.of` resolves the body (the targets, the mesh, what is refused and why) without the database;
`submit` then creates, in one transaction, one study per unique problem (skipping what is tuned, under
study, or has nothing to tune), the submission record, and a model's step study, or joins the identical
submission whose step study is in progress.  A problem's ring size must divide the hardware's devices: its
study is on the hardware of such a ring (`Hardware.ring`: ``cpu:cpu:4:1/8``, a ring of 4 of 8 devices), which
every worker of the hardware leases and runs on all its rings at once; a model's step study is on the ring of
its tensor axis.  Unless the body says ``warm_start: false``, each new study is
seeded from the configs already tuned on its hardware (`cmtune.tuner.warm`): those of finished studies, not
of the studies this submission creates.  A problem's compile screen, where the body sends one
(``screens``, `cmtune submit --screen`), orders its study's search once it is checked against the problem.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cmtune.service.errors import InvalidError
from cmtune.service.views import studies_public
from cmtune.tuner.engine import Engine
from cmtune.tuner.search_studies import study_settings
from cmtune.tuner.step_studies import step_study_of
from cmtune.tuner.warm import nearest_seeds
from collective_matmul.planning.models import PRESETS, MeshSpec, TransformerBlock, model_problems, slot_label
from collective_matmul.planning.problem import Hardware, Problem
from collective_matmul.planning.space import candidates, has_ring, no_ring_reason
from collective_matmul.wire import (
    MeasurementProtocol,
    Screened,
    Seed,
    Skipped,
    StudyCreate,
    StudyCreated,
    StudyState,
)

if TYPE_CHECKING:
    from cmtune.service.store import SqlTx

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
        entry[1].append(slot_label(p.role, p.slot))
        entry[2] += p.count
        if entry[2] > MAX_COUNT:
            raise InvalidError(f"{p.problem.key} runs {entry[2]} times per step in all: at most {MAX_COUNT}")
    return MeshSpec(axes=found.mesh, tensor_axis=tensor_axis), [tuple(t) for t in targets.values()]


@dataclass(frozen=True)
class Request:
    """A submission, resolved: the hardware as submitted, the targets (problem, roles, runs per step), and for a
    model or a user's step its mesh and what the submission record keeps."""

    body: StudyCreate
    hardware: Hardware
    targets: list[tuple[Problem, list[str], int]]
    model: TransformerBlock | None = None
    mesh: MeshSpec | None = None
    submitted: dict | None = None
    screens: dict[str, tuple[Screened, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, body: StudyCreate) -> Request:
        """Resolve ``body`` (no database needed).

        Raises:
            InvalidError: what does not fit, and how to fix it.
        """
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
        sizes = {(problem.key, problem.axis_size) for problem, _roles, _count in targets}
        if mesh is not None:
            sizes.add((f"the mesh's tensor axis {mesh.tensor_axis}", mesh.tensor_size))
        for what, size in sorted(sizes):
            if hardware.device_count % size:
                raise InvalidError(
                    f"{what} is a ring of {size} devices, which does not divide the hardware's device_count="
                    f"{hardware.device_count}: a worker tunes the rings its devices split into, so submit to "
                    f"hardware whose device_count is a multiple of {size} (or a ring size dividing "
                    f"{hardware.device_count})")
        if body.problem is not None and not has_ring(body.problem):
            raise InvalidError(f"{body.problem.key}: nothing to tune: {no_ring_reason(body.problem)}")
        return cls(body, hardware, targets, model, mesh, submitted, _screens(body, hardware, targets))

    def ring(self, size: int) -> Hardware:
        """Where a ring of ``size`` devices of this hardware is studied (`Hardware.ring`)."""
        return self.hardware.ring(size)


def _screens(body: StudyCreate, hardware: Hardware, targets: list[tuple]) -> dict[str, tuple[Screened, ...]]:
    """The submitted compile screens by problem key, each checked against its problem: a screen of a problem the
    submission does not tune, compiled for other devices than the hardware's, or naming a form that is not one
    of the problem's candidates there is refused."""
    problems = {problem.key: problem for problem, _roles, _count in targets}
    screens: dict[str, tuple[Screened, ...]] = {}
    for entry in body.screens:
        problem = problems.get(entry.problem)
        if problem is None:
            raise InvalidError(f"screens: {entry.problem} is not a problem of this submission (its problems: "
                               f"{', '.join(sorted(problems))})")
        if entry.problem in screens:
            raise InvalidError(f"screens: {entry.problem} is screened twice: send one screen a problem")
        if entry.device_kind != hardware.device_kind:
            raise InvalidError(f"screens: {entry.problem} was compiled for {entry.device_kind!r}, but the hardware "
                               f"to tune on is {hardware.device_kind!r}: screen on its devices (cmtune submit "
                               "--screen --devices gpu:CARD:D for a GPU node)")
        known = set(candidates(problem, platform=hardware.platform))
        for screened in entry.screen:
            if screened.decomposition not in known:
                raise InvalidError(f"screens: {entry.problem}: {screened.decomposition.id} is not a candidate of "
                                   f"the problem on {hardware.platform}")
        screens[entry.problem] = tuple(entry.screen)
    return screens


def submit(tx: SqlTx, engine: Engine, request: Request, *, now: dt.datetime) -> StudyCreated:
    """One study per unique problem of ``request`` (problems already tuned or under study are skipped unless
    ``force``), its submission record, and for a model its step study, or joined to the one in progress."""
    body, hardware, model, mesh = request.body, request.hardware, request.model, request.mesh
    targets, submitted = request.targets, request.submitted
    created, skipped, depends_on = [], [], []
    step_hardware = request.ring(mesh.tensor_size) if mesh is not None else None
    if model is not None and body.step.measure and not body.force:
        # two identical submissions at once: the second sees the first's study
        tx.submissions.lock_hardware(step_hardware)
        joined = step_study_of(tx, block=model, mesh=mesh, hardware=step_hardware)
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
    shapes: dict[tuple, list] = {}  # per family: nothing this transaction creates adds to them
    for problem, roles, count in targets:
        ring = request.ring(problem.axis_size)
        skip = _skip(tx, problem, ring, force=body.force)
        if skip is not None:
            skipped.append(skip)
            study_id = skip.study_id
        else:
            settings = study_settings(problem, ring, trials=body.budget.trials, minutes=body.budget.minutes,
                                      patience=body.budget.patience, sampler=body.sampler, seed=body.seed,
                                      confirm_top=body.confirm_top, screen=request.screens.get(problem.key, ()),
                                      seeds=_seeds(tx, problem, ring, shapes) if body.warm_start else ())
            protocol = MeasurementProtocol(repeats=body.repeats, seed=body.seed, timeout_s=body.timeout_s)
            study = engine.create_study(tx, problem=problem, hardware=ring, settings=settings, protocol=protocol,
                                        now=now)
            created.append(study)
            study_id = study.id
        if submission_id is not None:
            tx.submissions.link(submission_id=submission_id, study_id=study_id, problem=problem, roles=roles,
                                count=count)
            if study_id is not None:
                depends_on.append(study_id)
    if model is not None and body.step.measure:  # a user's step is measured where it runs (cmtune verify)
        created.append(engine.create_step_study(
            tx, block=model, mesh=mesh, hardware=step_hardware, depends_on=depends_on, now=now,
            protocol=MeasurementProtocol(repeats=body.step.repeats, seed=body.seed, timeout_s=body.timeout_s),
            submission_id=submission_id, ablation=body.step.ablation, search_rounds=body.step.search_rounds,
            round_variants=body.step.round_variants))
    return StudyCreated(studies=studies_public(tx, created), submission_id=submission_id, skipped=skipped)


def _seeds(tx: SqlTx, problem: Problem, hardware: Hardware, shapes: dict[tuple, list]) -> tuple[Seed, ...]:
    """A new study's warm start, from the configs tuned on ``hardware`` for ``problem``'s collective, dtype and
    ring size: their shapes read once per family into ``shapes``, the configs of the nearest only."""
    family = (problem.collective, problem.dtype, problem.axis_size)
    if family not in shapes:
        shapes[family] = tx.catalog.family_shapes(problem, hardware)
    return nearest_seeds(problem, hardware, shapes[family], lambda keys: tx.catalog.neighbours(problem, hardware, keys))


def _skip(tx: SqlTx, problem: Problem, hardware: Hardware, *, force: bool) -> Skipped | None:
    """Why ``problem`` needs no new study (None: it does): no ring fits it, or, unless ``force``, it is under
    study or tuned already."""
    if not has_ring(problem):
        return Skipped(problem=problem.key, study_id=None, reason="nothing to tune")
    if force:
        return None
    existing = tx.catalog.find_study(problem, hardware)
    if existing is not None:
        return Skipped(problem=problem.key, study_id=existing.id,
                       reason="already tuned" if existing.state == StudyState.COMPLETED else "under study")
    tuned = tx.catalog.tuned(problem, hardware)
    return Skipped(problem=problem.key, study_id=tuned.study_id, reason="already tuned") if tuned else None
