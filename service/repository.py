"""All SQL of the service: one verb per function, keyword-only arguments."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
import uuid
from collections.abc import Sequence

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, selectinload

from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.bundle import TunedConfig
from service.errors import NotFoundError
from service.models import (
    HardwareRow,
    Lease,
    ProblemRow,
    Study,
    Submission,
    SubmissionStudy,
    Token,
    Trial,
    TunedConfigRow,
    Worker,
    utcnow,
)

ACTIVE_STUDY_STATES = ("pending", "running", "confirming")


# --- keys -----------------------------------------------------------------------------------


def get_or_create_hardware(*, session: Session, hardware: Hardware) -> HardwareRow:
    hw = hardware.identity()
    row = session.scalar(select(HardwareRow).where(HardwareRow.key == hw.key))
    if row is None:
        row = HardwareRow(key=hw.key, platform=hw.platform, device_kind=hw.device_kind,
                          device_count=hw.device_count, process_count=hw.process_count)
        session.add(row)
        session.flush()
    return row


def get_or_create_problem(*, session: Session, problem: Problem) -> ProblemRow:
    row = session.scalar(select(ProblemRow).where(ProblemRow.key == problem.key))
    if row is None:
        row = ProblemRow(key=problem.key, **problem.model_dump())
        session.add(row)
        session.flush()
    return row


def to_problem(row: ProblemRow) -> Problem:
    return Problem(collective=row.collective, m=row.m, k=row.k, n=row.n, dtype=row.dtype, axis_size=row.axis_size)


def to_hardware(row: HardwareRow) -> Hardware:
    return Hardware(platform=row.platform, device_kind=row.device_kind, device_count=row.device_count,
                    process_count=row.process_count)


# --- studies --------------------------------------------------------------------------------


def create_study(
    *, session: Session, problem: ProblemRow, hardware: HardwareRow, settings: dict, protocol: dict, space_size: int
) -> Study:
    study = Study(problem_id=problem.id, hardware_id=hardware.id, state="pending", settings=settings,
                  protocol=protocol, space_size=space_size)
    session.add(study)
    session.flush()
    return study


def find_open_study(*, session: Session, problem: ProblemRow, hardware: HardwareRow) -> Study | None:
    """The newest study of this (problem, hardware) that is active or completed."""
    return session.scalar(
        select(Study)
        .where(Study.problem_id == problem.id, Study.hardware_id == hardware.id,
               Study.state.in_((*ACTIVE_STUDY_STATES, "completed")))
        .order_by(Study.id.desc())
        .limit(1)
    )


def _row(session: Session, model, key, *, lock: bool):
    """The row of ``model`` with primary key ``key`` (locked FOR UPDATE if asked), or None."""
    query = select(model).where(model.id == key)
    return session.scalar(query.with_for_update() if lock else query)


def get_study(*, session: Session, study_id: int, lock: bool = False) -> Study:
    study = _row(session, Study, study_id, lock=lock)
    if study is None:
        raise NotFoundError(f"study {study_id} does not exist")
    return study


def list_studies(
    *, session: Session, state: str | None, hardware_key: str | None, offset: int, limit: int
) -> tuple[list[Study], int]:
    query = select(Study)
    if state:
        query = query.where(Study.state == state)
    if hardware_key:
        query = query.join(HardwareRow, Study.hardware_id == HardwareRow.id).where(HardwareRow.key == hardware_key)
    total = session.scalar(select(func.count()).select_from(query.subquery()))
    rows = session.scalars(
        query.options(selectinload(Study.problem), selectinload(Study.hardware))
        .order_by(Study.id.desc()).offset(offset).limit(limit)
    ).all()
    return list(rows), int(total or 0)


def list_trials(*, session: Session, study_id: int) -> list[Trial]:
    return list(session.scalars(select(Trial).where(Trial.study_id == study_id).order_by(Trial.number)).all())


def active_studies_for(*, session: Session, hardware_id: int) -> list[int]:
    return list(session.scalars(
        select(Study.id).where(Study.hardware_id == hardware_id, Study.state.in_(ACTIVE_STUDY_STATES))
        .order_by(Study.id)
    ).all())


def count_studies_by_state(*, session: Session) -> dict[str, int]:
    return dict(session.execute(select(Study.state, func.count()).group_by(Study.state)).all())


# --- trials and leases ----------------------------------------------------------------------


def add_trial(*, session: Session, study: Study, kind: str, decompositions: Sequence[Decomposition]) -> Trial:
    number = (session.scalar(select(func.max(Trial.number)).where(Trial.study_id == study.id)) or 0) + 1
    trial = Trial(
        study_id=study.id, number=number, kind=kind,
        decompositions=[d.model_dump(mode="json") for d in decompositions],
        decomposition_id=decompositions[0].id if kind == "search" else f"confirm:{len(decompositions)}",
        state="pending",
    )
    session.add(trial)
    session.flush()
    return trial


def next_pending_trial(*, session: Session, study_id: int) -> Trial | None:
    """The oldest pending trial of a study, skipping rows another transaction holds."""
    return session.scalar(
        select(Trial).where(Trial.study_id == study_id, Trial.state == "pending")
        .order_by(Trial.number).limit(1).with_for_update(skip_locked=True)
    )


def get_trial(*, session: Session, trial_id: int, lock: bool = False) -> Trial:
    trial = _row(session, Trial, trial_id, lock=lock)
    if trial is None:
        raise NotFoundError(f"trial {trial_id} does not exist")
    return trial


def create_lease(*, session: Session, trial: Trial, worker: Worker, now: dt.datetime, seconds: float) -> Lease:
    lease = Lease(id=str(uuid.uuid4()), trial_id=trial.id, worker_id=worker.id, created_at=now,
                  expires_at=now + dt.timedelta(seconds=seconds), active=True)
    trial.state = "leased"
    trial.attempts += 1
    trial.worker_id = worker.id
    session.add(lease)
    session.flush()
    return lease


def get_lease(*, session: Session, lease_id: str, lock: bool = False) -> Lease | None:
    return _row(session, Lease, lease_id, lock=lock)


def expire_leases(*, session: Session, now: dt.datetime, max_attempts: int) -> int:
    """Return the trials of expired leases to the queue (failed after ``max_attempts``)."""
    expired = session.scalars(
        select(Lease).where(Lease.active.is_(True), Lease.expires_at < now).with_for_update(skip_locked=True)
    ).all()
    for lease in expired:
        lease.active = False
        trial = session.get(Trial, lease.trial_id)
        if trial is None or trial.state != "leased":
            continue
        if trial.attempts >= max_attempts:
            trial.state, trial.status, trial.finished_at = "failed", "timeout", now
            trial.message = f"lease expired {trial.attempts} times (limit {max_attempts}); no result"
        else:
            trial.state = "pending"
    session.flush()
    return len(expired)


def release_worker_leases(*, session: Session, worker_id: int) -> int:
    """A worker leaving on purpose gives its trials back (the attempt does not count)."""
    leases = session.scalars(select(Lease).where(Lease.worker_id == worker_id, Lease.active.is_(True))).all()
    for lease in leases:
        lease.active = False
        trial = session.get(Trial, lease.trial_id)
        if trial is not None and trial.state == "leased":
            trial.state = "pending"
            trial.attempts = max(trial.attempts - 1, 0)
    session.flush()
    return len(leases)


def count_trials_by_state(*, session: Session) -> dict[str, int]:
    return dict(session.execute(select(Trial.state, func.count()).group_by(Trial.state)).all())


def count_active_leases(*, session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Lease).where(Lease.active.is_(True))) or 0)


# --- workers --------------------------------------------------------------------------------


def create_worker(*, session: Session, name: str, hardware: HardwareRow, software: dict) -> Worker:
    worker = Worker(name=name, hardware_id=hardware.id, software=software)
    session.add(worker)
    session.flush()
    return worker


def get_worker(*, session: Session, worker_id: int) -> Worker:
    worker = session.get(Worker, worker_id)
    if worker is None or not worker.active:
        raise NotFoundError(f"worker {worker_id} is not registered; register again with POST /v1/workers")
    return worker


def list_workers(*, session: Session, include_inactive: bool = False) -> list[Worker]:
    query = select(Worker).options(selectinload(Worker.hardware)).order_by(Worker.id)
    if not include_inactive:
        query = query.where(Worker.active.is_(True))
    return list(session.scalars(query).all())


def current_trials(*, session: Session) -> dict[int, int]:
    """worker id -> the trial it holds an active lease on."""
    rows = session.execute(select(Lease.worker_id, Lease.trial_id).where(Lease.active.is_(True))).all()
    return {worker_id: trial_id for worker_id, trial_id in rows}


def count_workers_online(*, session: Session, since: dt.datetime) -> int:
    return int(session.scalar(
        select(func.count()).select_from(Worker).where(Worker.active.is_(True), Worker.last_heartbeat >= since)
    ) or 0)


# --- tuned configs --------------------------------------------------------------------------


def upsert_tuned(*, session: Session, config: TunedConfig, study_id: int | None) -> TunedConfigRow:
    problem = get_or_create_problem(session=session, problem=config.problem)
    hardware = get_or_create_hardware(session=session, hardware=config.hardware)
    row = session.scalar(select(TunedConfigRow).where(TunedConfigRow.problem_id == problem.id,
                                                      TunedConfigRow.hardware_id == hardware.id))
    values = dict(
        decomposition=config.decomposition.model_dump(mode="json"), time_s=config.time_s,
        baseline_s=config.baseline_s, speedup=config.speedup, speedup_iqr=config.speedup_iqr,
        trials=config.trials, invalid=config.invalid, failed=config.failed, space_size=config.space_size,
        software={"jax": config.jax_version, "jaxlib": config.jaxlib_version}, updated_at=utcnow(),
        study_id=study_id,
    )
    if row is None:
        row = TunedConfigRow(problem_id=problem.id, hardware_id=hardware.id, **values)
        session.add(row)
    else:
        for name, value in values.items():
            setattr(row, name, value)
    session.flush()
    return row


def list_tuned(*, session: Session, platform: str | None = None, device_kind: str | None = None,
               hardware_key: str | None = None) -> list[TunedConfigRow]:
    query = (select(TunedConfigRow).join(HardwareRow, TunedConfigRow.hardware_id == HardwareRow.id)
             .options(selectinload(TunedConfigRow.problem), selectinload(TunedConfigRow.hardware)))
    if platform:
        query = query.where(HardwareRow.platform == platform)
    if device_kind:
        query = query.where(HardwareRow.device_kind == device_kind)
    if hardware_key:
        query = query.where(HardwareRow.key == hardware_key)
    return list(session.scalars(query.order_by(TunedConfigRow.id)).all())


def get_tuned(*, session: Session, problem_id: int, hardware_id: int) -> TunedConfigRow | None:
    return session.scalar(select(TunedConfigRow).where(TunedConfigRow.problem_id == problem_id,
                                                       TunedConfigRow.hardware_id == hardware_id))


def to_tuned_config(row: TunedConfigRow) -> TunedConfig:
    return TunedConfig(
        problem=to_problem(row.problem), hardware=to_hardware(row.hardware),
        decomposition=Decomposition.model_validate(row.decomposition), time_s=row.time_s,
        baseline_s=row.baseline_s, speedup=row.speedup, speedup_iqr=row.speedup_iqr, trials=row.trials,
        invalid=row.invalid, failed=row.failed, space_size=row.space_size,
        jax_version=row.software.get("jax", ""), jaxlib_version=row.software.get("jaxlib", ""),
        tuned_at=row.updated_at.isoformat(timespec="seconds"),
    )


# --- submissions ----------------------------------------------------------------------------


def create_submission(*, session: Session, model: dict, mesh: dict, hardware: HardwareRow) -> Submission:
    submission = Submission(model=model, mesh=mesh, hardware_id=hardware.id)
    session.add(submission)
    session.flush()
    return submission


def link_submission(*, session: Session, submission: Submission, study_id: int | None, problem: ProblemRow,
                    roles: Sequence[str], count: int) -> None:
    session.add(SubmissionStudy(submission_id=submission.id, study_id=study_id, problem_id=problem.id,
                                roles=list(roles), count=count))


def list_submissions(*, session: Session, limit: int = 100) -> list[Submission]:
    return list(session.scalars(
        select(Submission).options(selectinload(Submission.hardware), selectinload(Submission.entries))
        .order_by(Submission.id.desc()).limit(limit)
    ).all())


def get_submission(*, session: Session, submission_id: int) -> Submission:
    submission = session.scalar(
        select(Submission).where(Submission.id == submission_id)
        .options(selectinload(Submission.entries).selectinload(SubmissionStudy.problem),
                 selectinload(Submission.entries).selectinload(SubmissionStudy.study),
                 selectinload(Submission.hardware))
    )
    if submission is None:
        raise NotFoundError(f"submission {submission_id} does not exist")
    return submission


# --- tokens ---------------------------------------------------------------------------------


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(*, session: Session, name: str, role: str, value: str | None = None) -> tuple[Token, str]:
    """A new token (random unless ``value``); only its SHA-256 is stored.  Returns the row and the token."""
    plain = value or "cmt_" + secrets.token_urlsafe(32)
    row = Token(name=name, role=role, hash=hash_token(plain))
    session.add(row)
    session.flush()
    return row, plain


def find_token(*, session: Session, token: str) -> Token | None:
    return session.scalar(select(Token).where(Token.hash == hash_token(token), Token.revoked.is_(False)))


def cancel_active_leases_of_study(*, session: Session, study_id: int) -> None:
    trial_ids = select(Trial.id).where(Trial.study_id == study_id)
    session.execute(update(Lease).where(Lease.trial_id.in_(trial_ids), Lease.active.is_(True)).values(active=False))
