"""The trial queue: studies ask Optuna (rebuilt from the database) and hand trials to workers.

1. A lease request first returns expired leases' trials to the queue.
2. For each active study on the worker's hardware (oldest first), under the study's row lock
   (PostgreSQL ``FOR UPDATE``; on SQLite the whole transaction is ``BEGIN IMMEDIATE``): a
   pending trial is claimed (``SKIP LOCKED``); else the study's `Searcher`, rebuilt from its
   finished and in-flight trials, proposes the next candidate; else, once its stop rule holds
   and nothing is in flight, a confirmation trial of the top candidates is queued.
3. A reported result is stored once; a confirmation result writes the tuned config and
   completes the study.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy.orm import Session

from collective_matmul import Decomposition, Problem, candidates
from collective_matmul.costmodel import PROFILES, profile_for
from service import repository as repo
from service.errors import ConflictError, InvalidError
from service.models import Lease, Study, Trial, Worker, utcnow
from service.settings import Settings
from tuner.measure import Measurement, Protocol
from tuner.search import (
    Finished,
    Searcher,
    SearchSettings,
    failure_counts,
    pick_winner,
    stop_reason,
    tuned_config,
)


def search_settings(study: Study) -> SearchSettings:
    return SearchSettings.model_validate(study.settings)


def default_budget(space_size: int) -> int:
    """A quarter of the space, at least 4 trials."""
    return max(4, -(-space_size // 4))


def history(study: Study, trials: list[Trial]) -> tuple[list[Finished], list[Decomposition]]:
    finished, in_flight = [], []
    for t in trials:
        if t.kind != "search":
            continue
        config = Decomposition.model_validate(t.decompositions[0])
        if t.state in ("completed", "failed"):
            finished.append(Finished(config, t.ratio if t.status == "ok" else None))
        elif t.state in ("pending", "leased"):
            in_flight.append(config)
    return finished, in_flight


def _searcher(study: Study) -> Searcher:
    problem = repo.to_problem(study.problem)
    profile = profile_for(repo.to_hardware(study.hardware)) or PROFILES["tpu-v4"]  # any order will do
    return Searcher(problem, profile, search_settings(study))


def advance(*, session: Session, study: Study, now: dt.datetime, search: bool = True) -> Trial | None:
    """Create the study's next trial if it has one to give now (search or confirmation).

    With ``search=False`` (after a result) only a finished search is moved on to confirmation.
    """
    if study.state not in ("pending", "running"):
        return None
    trials = repo.list_trials(session=session, study_id=study.id)
    finished, in_flight = history(study, trials)
    searcher = _searcher(study)
    elapsed = (now - study.started_at).total_seconds() if study.started_at else 0.0
    reason = stop_reason(searcher.settings, finished, elapsed_s=elapsed,
                         exhausted=searcher.exhausted(finished, in_flight), in_flight=len(in_flight))
    if reason is None:
        if not search:
            return None  # Optuna is asked only when a worker wants a trial
        study.state = "running"
        study.started_at = study.started_at or now
        config = searcher.ask(finished, in_flight)
        return repo.add_trial(session=session, study=study, kind="search", decompositions=[config])
    if in_flight:
        return None  # the search is over or waiting: confirm once every trial is back
    study.stop_reason = reason
    contenders = searcher.confirm_set(finished)
    if len(contenders) == 1:  # nothing but the baseline ran: it is the tuned config
        _finalize(session=session, study=study, trials=trials, confirmation=None, now=now)
        return None
    study.state = "confirming"
    return repo.add_trial(session=session, study=study, kind="confirm", decompositions=contenders)


def lease_for(*, session: Session, worker: Worker, settings: Settings) -> tuple[Lease, Trial, Study] | None:
    """Claim one trial for ``worker``, or None if no study on its hardware has one."""
    now = utcnow()
    repo.expire_leases(session=session, now=now, max_attempts=settings.max_attempts)
    for study_id in repo.active_studies_for(session=session, hardware_id=worker.hardware_id):
        study = repo.get_study(session=session, study_id=study_id, lock=True)
        if study.state not in repo.ACTIVE_STUDY_STATES:
            continue
        trial = repo.next_pending_trial(session=session, study_id=study.id) or advance(
            session=session, study=study, now=now)
        if trial is None:
            continue
        lease = repo.create_lease(session=session, trial=trial, worker=worker, now=now, seconds=settings.lease_seconds)
        return lease, trial, study
    return None


def trial_protocol(study: Study, trial: Trial) -> Protocol:
    protocol = Protocol.model_validate(study.protocol)
    if trial.kind == "confirm":
        protocol = protocol.model_copy(update={"repeats": search_settings(study).confirm_repeats})
    return protocol


def report(*, session: Session, trial_id: int, lease_id: str, measurements: list[Measurement],
           kind: str, worker: Worker | None = None) -> tuple[Trial, bool]:
    """Store a trial's result; returns the trial and whether this was a repeated report.

    Raises:
        ConflictError: the lease is unknown, for another trial, or no longer holds the trial.
        InvalidError: the measurements are not of this trial's problem and candidates.
    """
    lease = repo.get_lease(session=session, lease_id=lease_id, lock=True)
    trial = repo.get_trial(session=session, trial_id=trial_id, lock=True)
    if lease is None or lease.trial_id != trial.id:
        raise ConflictError(f"lease {lease_id} does not hold trial {trial_id}")
    if worker is not None and lease.worker_id != worker.id:
        raise ConflictError(f"lease {lease_id} belongs to another worker")
    if trial.state in ("completed", "failed"):
        if trial.result_lease_id == lease.id:
            return trial, True  # the same report again: harmless
        if trial.status == "cancelled":
            raise ConflictError(f"study of trial {trial_id} was cancelled; drop this result")
        raise ConflictError(f"trial {trial_id} already has a result from another lease; this lease is stale")
    if not lease.active or trial.state != "leased":
        raise ConflictError(f"lease {lease_id} expired and trial {trial_id} went back to the queue; "
                            "drop this result and lease again")
    study = repo.get_study(session=session, study_id=trial.study_id, lock=True)
    _check_matches(study, trial, measurements, kind)
    now = utcnow()
    trial.measurements = [m.model_dump(mode="json") for m in measurements]
    trial.state, trial.finished_at, trial.result_lease_id = "completed", now, lease.id
    if trial.kind == "search":
        (m,) = measurements
        trial.status, trial.ratio, trial.message = m.status, m.ratio if m.ok else None, m.message or None
    else:
        ok = [m for m in measurements if m.ok]
        trial.status = "ok" if ok else "error"
        trial.ratio = min(m.ratio for m in ok) if ok else None
    lease.active = False
    owner = session.get(Worker, lease.worker_id)
    if owner is not None:
        owner.trials_done += 1
    if study.state in repo.ACTIVE_STUDY_STATES:
        if trial.kind == "confirm":
            _finalize(session=session, study=study, trials=repo.list_trials(session=session, study_id=study.id),
                      confirmation=measurements, now=now)
        else:
            advance(session=session, study=study, now=now, search=False)
    return trial, False


def _check_matches(study: Study, trial: Trial, measurements: list[Measurement], kind: str) -> None:
    if kind != trial.kind:
        field = "measurement" if trial.kind == "search" else "measurements"
        raise InvalidError(f"trial {trial.id} is a {trial.kind} trial: send '{field}'")
    expected = [Decomposition.model_validate(d) for d in trial.decompositions]
    got = [m.decomposition for m in measurements]
    if got != expected:
        raise InvalidError(
            f"trial {trial.id} timed {[d.id for d in expected]}, the result is for {[d.id for d in got]}")
    problem = repo.to_problem(study.problem)
    for m in measurements:
        if m.problem != problem:
            raise InvalidError(f"trial {trial.id} is for {problem.key}, the result is for {m.problem.key}")


def _finalize(*, session: Session, study: Study, trials: list[Trial], confirmation: list[Measurement] | None,
              now: dt.datetime) -> None:
    """Write the tuned config from the confirmation round (or the lone baseline) and complete."""
    problem = repo.to_problem(study.problem)
    if confirmation is None:
        confirmation = [Measurement.model_validate(m) for t in trials if t.kind == "search" and t.measurements
                        for m in t.measurements]
    study.finished_at = now
    winner = pick_winner(confirmation)
    if winner is None:
        study.state = "failed"
        study.message = "no candidate, not even the baseline, ran successfully: " + "; ".join(
            f"{m.decomposition.id}: {m.status} {m.message}" for m in confirmation)[:1900]
        return
    search = [t for t in trials if t.kind == "search"]
    invalid, failed = failure_counts(t.status for t in search)
    config = tuned_config(
        problem, winner, trials=len(search), invalid=invalid, failed=failed, space_size=study.space_size,
    ).model_copy(update={"hardware": repo.to_hardware(study.hardware)})
    repo.upsert_tuned(session=session, config=config, study_id=study.id)
    study.state = "completed"


def cancel(*, session: Session, study: Study) -> None:
    if study.state not in repo.ACTIVE_STUDY_STATES:
        raise ConflictError(f"study {study.id} is {study.state}; only pending, running or confirming studies cancel")
    study.state, study.finished_at, study.stop_reason = "cancelled", utcnow(), "cancelled"
    repo.cancel_active_leases_of_study(session=session, study_id=study.id)
    for trial in repo.list_trials(session=session, study_id=study.id):
        if trial.state in ("pending", "leased"):
            trial.state, trial.status, trial.message = "failed", "cancelled", "study cancelled"


def space_size(problem: Problem) -> int:
    return len(candidates(problem))
