"""The study engine: the one owner of the study lifecycle, for `cmtune tune` and for the service.

A study searches the decompositions of one (problem, hardware).  The engine is stateless: each
call reads the study's history from a store transaction (`cmtune.tuner.store`) and writes its
decisions back, so any process can drive any study (a replica of the service, or `cmtune tune`
over the in-memory store) and a restart loses nothing.  The lifecycle:

1. `create_study`: the study starts ``pending`` with ``ready`` proposals (search trials) queued.
   Proposals come from a `Searcher` rebuilt from the history (finished trials and those in
   flight, so parallel proposals differ: Optuna's constant liar).
2. `claim`: a worker (or the local runner) takes the oldest pending trial: a claim, never an
   ask.  The first claim starts the study (``running``; its time budget counts from here).
3. `record`: a result is stored, then `refill` brings the study forward: while the stop rule
   (trial budget, time budget, patience, exhaustion, a failed baseline) lets the search go on,
   it tops the proposals up to ``ready``; once it stops, unclaimed proposals are cancelled and,
   when nothing is in flight any more, the confirmation round is queued: the top
   ``confirm_top`` candidates and the baseline, re-timed together.  If only the baseline ran,
   the study finishes at once.
4. `_finish`: the confirmation round's winner becomes the tuned config (``completed``).  When
   the round produced nothing usable, the search trials' own measurements decide and the
   study's message says so; when nothing ran at all, not even the baseline, the study
   ``failed`` with the reasons.
5. `abandon`: a trial that will get no result (its attempts are used up) is ``failed`` with the
   reason, and the study goes on as after a result; an abandoned confirmation finishes the
   study from the search trials.
6. `cancel`: final; trials in flight are cancelled.

Every state change goes through `_move_study` / `_move_trial`, which refuse transitions that are
not in `STUDY_MOVES` / `TRIAL_MOVES` (the database's CHECK constraints hold the same states).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from cmtune.tuner.errors import ConflictError, InvalidError
from cmtune.tuner.search import (
    Finished,
    Sampler,
    Searcher,
    SearchSettings,
    default_budget,
    failure_counts,
    pick_winner,
    stop_reason,
    tuned_config,
)
from cmtune.tuner.store import StoreTx, StudyRecord, TrialRecord
from collective_matmul.costmodel import PROFILES, profile_for
from collective_matmul.decomposition import Decomposition
from collective_matmul.problem import Hardware, Problem
from collective_matmul.space import candidates
from collective_matmul.wire import Measurement, Protocol, Status, StudyState, TrialKind, TrialState, TrialTask

S, T = StudyState, TrialState
STUDY_MOVES: dict[StudyState, frozenset[StudyState]] = {
    S.PENDING: frozenset({S.RUNNING, S.CONFIRMING, S.COMPLETED, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.CONFIRMING, S.COMPLETED, S.FAILED, S.CANCELLED}),
    S.CONFIRMING: frozenset({S.COMPLETED, S.FAILED, S.CANCELLED}),
}
TRIAL_MOVES: dict[TrialState, frozenset[TrialState]] = {
    T.PENDING: frozenset({T.LEASED, T.FAILED, T.CANCELLED}),
    T.LEASED: frozenset({T.PENDING, T.COMPLETED, T.FAILED, T.CANCELLED}),
}
# stop reasons after which proposals nobody has claimed yet are dropped (the others count them)
_DROP_PROPOSALS = ("time budget", "no improvement", "baseline failed")


def profile_name_for(hardware: Hardware) -> str:
    """The static cost-model profile of a platform (the engine never calibrates: see `study_settings`)."""
    profile = profile_for(hardware)
    return profile.name if profile is not None else "tpu-v4"


def study_settings(problem: Problem, hardware: Hardware, *, trials: int | None = None, minutes: float | None = None,
                   patience: int | None = None, sampler: Sampler = "auto", seed: int = 0,
                   confirm_top: int = 3) -> SearchSettings:
    """A study's settings from what a user asks (command line or API), defaults filled in one place.

    The trial budget defaults to `default_budget` of the space; the cost-model profile that orders
    the candidates is the static profile of the hardware's platform (`profile_name_for`), never a
    timing taken on one process, so every process and every replica orders them alike.
    """
    return SearchSettings(
        sampler=sampler, seed=seed, max_trials=trials or default_budget(len(candidates(problem))),
        max_seconds=minutes * 60 if minutes else None, patience=patience, confirm_top=confirm_top,
        profile=profile_name_for(hardware),
    )


@dataclass(frozen=True)
class History:
    """A study's trials as the searcher sees them."""

    finished: list[Finished]
    in_flight: list[Decomposition]
    pending: list[TrialRecord]
    baseline_failed: bool

    @classmethod
    def of(cls, trials: Sequence[TrialRecord]) -> History:
        finished, in_flight, pending, baseline_failed = [], [], [], False
        for t in trials:
            if t.kind != TrialKind.SEARCH or t.state == T.CANCELLED:
                continue
            if t.state.in_flight:
                in_flight.append(t.decomposition)
                if t.state == T.PENDING:
                    pending.append(t)
                continue
            ok = t.status == Status.OK and t.ratio is not None
            finished.append(Finished(t.decomposition, t.ratio if ok else None))
            # the baseline program itself failed (not a lost lease): every other trial times it too
            baseline_failed |= (t.decomposition.method == "baseline" and t.state == T.COMPLETED
                                and t.status not in (Status.OK, Status.TIMEOUT))
        return cls(finished, in_flight, pending, baseline_failed)


class Engine:
    """The study lifecycle over any `StoreTx`.

    Args:
        ready: search proposals kept queued per study, so that a claim never waits for an ask
            (1 for a single local runner; a few for a fleet of workers).
    """

    def __init__(self, *, ready: int = 1):
        if ready < 1:
            raise ValueError(f"ready must be >= 1, got {ready}")
        self.ready = ready

    # -- creating and driving ---------------------------------------------------------------

    def create_study(self, tx: StoreTx, *, problem: Problem, hardware: Hardware, settings: SearchSettings,
                     protocol: Protocol, now: dt.datetime) -> StudyRecord:
        """A new study with its first proposals queued."""
        if settings.profile is None:
            settings = settings.model_copy(update={"profile": profile_name_for(hardware)})
        if settings.profile not in PROFILES:
            raise InvalidError(f"unknown cost-model profile {settings.profile!r}; one of {sorted(PROFILES)}")
        study = tx.add_study(problem=problem, hardware=hardware.identity(), settings=settings, protocol=protocol,
                             space_size=len(candidates(problem)), now=now)
        self.refill(tx, study.id, now=now)
        return tx.study(study.id)

    def searcher(self, study: StudyRecord) -> Searcher:
        return Searcher(study.problem, study.settings.profile or profile_name_for(study.hardware), study.settings)

    def refill(self, tx: StoreTx, study_id: int, *, now: dt.datetime) -> list[TrialRecord]:
        """Bring a searching study forward: top its proposals up, or confirm, or finish.

        Returns the trials it queued (proposals or the confirmation).
        """
        study = tx.study(study_id, lock=True)
        if study.state not in (S.PENDING, S.RUNNING):
            return []
        history = History.of(tx.trials(study_id))
        searcher = self.searcher(study)
        elapsed = (now - study.started_at).total_seconds() if study.started_at else 0.0
        proposals: list[Decomposition] = []
        while True:
            in_flight = history.in_flight + proposals
            reason = "baseline failed" if history.baseline_failed else stop_reason(
                study.settings, history.finished, elapsed_s=elapsed,
                exhausted=searcher.exhausted(history.finished, in_flight), in_flight=len(in_flight))
            if reason is not None or len(history.pending) + len(proposals) >= self.ready:
                break
            config = searcher.ask(history.finished, in_flight)
            if config is None:
                break
            proposals.append(config)
        if proposals:
            return tx.add_trials(study_id, TrialKind.SEARCH, [[c] for c in proposals], now)
        if reason is None:
            return []
        if reason in _DROP_PROPOSALS:
            for trial in history.pending:
                self._move_trial(tx, trial, T.CANCELLED, message=f"not needed: the search stopped ({reason})")
            history = History.of(tx.trials(study_id))
        if history.in_flight:
            return []  # the search is over: confirm once every trial is back
        tx.update_study(study_id, stop_reason=reason)
        contenders = searcher.confirm_set(history.finished)
        if len(contenders) == 1:  # nothing but the baseline ran: it is the tuned config
            self._finish(tx, study_id, confirmation=None, now=now)
            return []
        self._move_study(tx, tx.study(study_id), S.CONFIRMING)
        return tx.add_trials(study_id, TrialKind.CONFIRM, [contenders], now)

    def claim(self, tx: StoreTx, *, study_ids: Sequence[int] | None = None, hardware: Hardware | None = None,
              worker_id: int | None = None, now: dt.datetime) -> TrialRecord | None:
        """Claim the oldest pending trial (of ``study_ids``, or of the active studies on ``hardware``).

        The store moves it to ``leased`` atomically (attempts + 1); the first claim starts its study.
        """
        trial = tx.claim(study_ids=study_ids, hardware=hardware, worker_id=worker_id, now=now)
        if trial is not None:
            study = tx.study(trial.study_id)
            if study.state == S.PENDING:
                self._move_study(tx, study, S.RUNNING, started_at=now)
        return trial

    def release(self, tx: StoreTx, trial: TrialRecord, *, count_attempt: bool) -> None:
        """A claimed trial goes back to the queue (its worker left, or its lease expired)."""
        self._move_trial(tx, trial, T.PENDING, attempts=trial.attempts if count_attempt else max(trial.attempts - 1, 0))

    # -- results ----------------------------------------------------------------------------

    def record(self, tx: StoreTx, trial_id: int, results: Sequence[Measurement], *, now: dt.datetime,
               lease_id: str | None = None, kind: TrialKind | None = None) -> TrialRecord:
        """Store a claimed trial's result and bring its study forward.

        Raises:
            ConflictError: the trial is not claimed (finished, cancelled, or back in the queue).
            InvalidError: the results are not of this trial's problem and candidates.
        """
        trial = tx.trial(trial_id, lock=True)
        study = tx.study(trial.study_id, lock=True)
        if trial.state != T.LEASED:
            raise ConflictError(f"trial {trial_id} is {trial.state}, not leased: drop this result")
        if kind is not None and kind != trial.kind:
            field = "measurement" if trial.kind == TrialKind.SEARCH else "measurements"
            raise InvalidError(f"trial {trial_id} is a {trial.kind} trial: send '{field}'")
        _check_matches(study, trial, results)
        if trial.kind == TrialKind.SEARCH:
            (m,) = results
            status, ratio, message = m.status, (m.ratio if m.ok else None), (m.message or None)
        else:
            ok = [m for m in results if m.ok]
            status, ratio, message = (Status.OK if ok else Status.ERROR), min((m.ratio for m in ok), default=None), None
        self._move_trial(tx, trial, T.COMPLETED, status=status, ratio=ratio, measurements=tuple(results),
                         message=message, finished_at=now, result_lease_id=lease_id)
        if study.state.active:
            if trial.kind == TrialKind.CONFIRM:
                self._finish(tx, study.id, confirmation=list(results), now=now)
            else:
                self._count(tx, study, trial_id, ratio)
                self.refill(tx, study.id, now=now)
        return tx.trial(trial_id)

    def abandon(self, tx: StoreTx, trial: TrialRecord, *, status: Status, message: str, now: dt.datetime) -> None:
        """A trial that will get no result: failed with the reason; its study goes on."""
        self._move_trial(tx, trial, T.FAILED, status=status, message=message[:2000], finished_at=now)
        study = tx.study(trial.study_id, lock=True)
        if not study.state.active:
            return
        if trial.kind == TrialKind.CONFIRM:
            self._finish(tx, study.id, confirmation=None, now=now,
                         note=f"the confirmation round got no result ({message})")
        else:
            self._count(tx, study, trial.id, None)
            self.refill(tx, study.id, now=now)

    def cancel(self, tx: StoreTx, study_id: int, *, now: dt.datetime) -> StudyRecord:
        """Cancel an active study and its trials in flight.

        Raises:
            ConflictError: the study is already final.
        """
        trials = [t for t in tx.trials(study_id) if t.state.in_flight]
        study = tx.study(study_id, lock=True)
        if not study.state.active:
            raise ConflictError(f"study {study_id} is {study.state}; only pending, running or confirming studies "
                                "cancel")
        for trial in trials:
            self._move_trial(tx, trial, T.CANCELLED, message="study cancelled", finished_at=now)
        self._move_study(tx, study, S.CANCELLED, stop_reason="cancelled", finished_at=now)
        return tx.study(study_id)

    # -- internals --------------------------------------------------------------------------

    def _count(self, tx: StoreTx, study: StudyRecord, trial_id: int, ratio: float | None) -> None:
        """Progress kept on the study row: finished search trials and the best so far."""
        best = ratio is not None and (study.best_ratio is None or ratio < study.best_ratio)
        tx.update_study(study.id, trials_done=study.trials_done + 1,
                        **({"best_ratio": ratio, "best_trial_id": trial_id} if best else {}))

    def _finish(self, tx: StoreTx, study_id: int, *, confirmation: list[Measurement] | None, now: dt.datetime,
                note: str | None = None) -> None:
        """Complete a study with its tuned config, or fail it with the reasons."""
        study = tx.study(study_id, lock=True)
        search = [t for t in tx.trials(study_id, measurements=True) if t.kind == TrialKind.SEARCH]
        pool = list(confirmation or [])
        if not any(m.ok for m in pool):
            if confirmation is not None and note is None:
                note = "every measurement of the confirmation round failed"
            pool = [m for t in search for m in (t.measurements or ())]
            note = f"{note}; tuned from the search trials' own measurements" if note else None
        winner = pick_winner(pool)
        if winner is None:
            reasons = "; ".join(f"{t.decomposition.id}: {t.status or t.state} {t.message or ''}".strip()
                                for t in search if t.state in (T.COMPLETED, T.FAILED))
            self._move_study(tx, study, S.FAILED, finished_at=now,
                             message=("no candidate, not even the baseline, ran successfully: " + reasons)[:2000])
            return
        finished = [t for t in search if t.state in (T.COMPLETED, T.FAILED)]
        invalid, failed = failure_counts(t.status for t in finished)
        config = tuned_config(study.problem, winner, trials=len(finished), invalid=invalid, failed=failed,
                              space_size=study.space_size)
        tx.save_tuned(config.model_copy(update={"hardware": study.hardware.identity()}), study_id=study_id)
        self._move_study(tx, study, S.COMPLETED, finished_at=now, message=note)

    @staticmethod
    def _move_study(tx: StoreTx, study: StudyRecord, to: StudyState, **changes) -> None:
        if to not in STUDY_MOVES.get(study.state, ()):
            raise ConflictError(f"study {study.id} is {study.state}; it cannot become {to}")
        tx.update_study(study.id, state=to, **changes)

    @staticmethod
    def _move_trial(tx: StoreTx, trial: TrialRecord, to: TrialState, **changes) -> None:
        if to not in TRIAL_MOVES.get(trial.state, ()):
            raise ConflictError(f"trial {trial.id} is {trial.state}; it cannot become {to}")
        tx.update_trial(trial.id, state=to, **changes)


def task_for(study: StudyRecord, trial: TrialRecord) -> TrialTask:
    """What a worker runs for ``trial``: a confirmation round re-times with `confirm_repeats` runs."""
    protocol = study.protocol
    if trial.kind == TrialKind.CONFIRM:
        protocol = protocol.model_copy(update={"repeats": study.settings.confirm_repeats})
    return TrialTask(id=trial.id, study_id=study.id, kind=trial.kind, problem=study.problem,
                     decomposition=trial.decomposition if trial.kind == TrialKind.SEARCH else None,
                     decompositions=list(trial.decompositions), protocol=protocol)


def _check_matches(study: StudyRecord, trial: TrialRecord, results: Sequence[Measurement]) -> None:
    got = [m.decomposition for m in results]
    if got != list(trial.decompositions):
        raise InvalidError(f"trial {trial.id} timed {[d.id for d in trial.decompositions]}, "
                           f"the result is for {[d.id for d in got]}")
    for m in results:
        if m.problem != study.problem:
            raise InvalidError(f"trial {trial.id} is for {study.problem.key}, the result is for {m.problem.key}")
