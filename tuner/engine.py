"""The study engine: the one owner of the study lifecycle, for `cmtune tune` and for the service.

The engine is stateless: each call reads a study's history from a store transaction (`cmtune.tuner.store`) and
writes its decisions back, so any process can drive any study (a replica of the service, or `cmtune tune` over
the in-memory store) and a restart loses nothing.  The lifecycle, the same for every kind of study:

1. create: `create_study` (a search of one problem's decompositions), `create_reconfirmation` (a stored config
   re-timed on another software stack) or `create_step_study` (a model's whole training step); the study starts
   ``pending`` with its first trials queued (a step study once the studies it depends on are final).
2. `claim`: a worker (or the local runner) takes the oldest pending trial: a claim, never an ask.  The first
   claim starts the study (``running``); `release` puts a claimed trial back.
3. `record`: a claimed trial's result is stored and the study brought forward (`refill`): more trials, a
   confirmation, or the study's end (``completed`` or ``failed``).
4. `abandon`: a trial that will get no result (its attempts are used up) is ``failed`` with the reason, and the
   study goes on as after a result.
5. `cancel`: final; trials in flight are cancelled.

What a study does at each step depends on its kind, and is the kind's module: `cmtune.tuner.search_studies` (a search
and its re-confirmation) and `cmtune.tuner.step_studies` (a step study); `part_of` chooses one, once per call.  Every
state change goes through `cmtune.tuner.states`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Protocol

from cmtune.tuner.errors import ConflictError, InvalidError
from cmtune.tuner.search import SearchSettings
from cmtune.tuner.search_studies import Searching
from cmtune.tuner.states import StopReason, check_trial_move, move_study, move_trial
from cmtune.tuner.step_studies import Stepping
from cmtune.tuner.store import StoreTx, StudyRecord, TrialRecord
from collective_matmul.planning.models import MeshSpec, TransformerBlock
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import (
    STEP_ROUND_VARIANTS,
    STEP_SEARCH_ROUNDS,
    MeasurementProtocol,
    Status,
    StudyKind,
    StudyState,
    TrialResult,
    TrialState,
    TrialTask,
    what_to_send,
)
from collective_matmul.wire.bundle import TunedConfig

S, T = StudyState, TrialState


class Part(Protocol):
    """One kind of study's part of the lifecycle: what the engine dispatches to (`part_of`).  ``study`` is
    locked by the caller's transaction and active unless said otherwise."""

    def refill(self, tx: StoreTx, study: StudyRecord, *, now: dt.datetime,
               trials: Sequence[TrialRecord] | None = None) -> list[TrialRecord]:
        """Bring the study forward (``study`` in any state; ``trials``: its trials, if the caller knows them);
        the trials it queued."""

    def record(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, result: TrialResult, *, now: dt.datetime,
               lease_id: str | None) -> TrialRecord:
        """Store the result of ``trial`` (leased, ``result`` of its kind; ``study`` in any state) and bring the
        study forward."""

    def abandon(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, *, message: str, now: dt.datetime) -> None:
        """Bring the study forward without a result of ``trial`` (failed already, for ``message``)."""

    def cancelled(self, tx: StoreTx, study: StudyRecord, *, now: dt.datetime) -> None:
        """What follows once the study is cancelled."""

    def task(self, study: StudyRecord, trial: TrialRecord) -> TrialTask:
        """What a worker runs for ``trial``."""


def part_of(study: StudyRecord, *, ready: int = 1) -> Part:
    """The one dispatch on a study's kind: the part of the lifecycle that runs ``study`` (``ready``: a search's
    proposals kept queued)."""
    return Stepping() if study.kind == StudyKind.STEP else Searching(ready=ready)


def task_for(study: StudyRecord, trial: TrialRecord) -> TrialTask:
    """What a worker runs for ``trial`` of ``study`` (a confirmation round re-times with `confirm_repeats` runs)."""
    return part_of(study).task(study, trial)


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

    # -- creating ---------------------------------------------------------------------------

    def create_study(self, tx: StoreTx, *, problem: Problem, hardware: Hardware, settings: SearchSettings,
                     protocol: MeasurementProtocol, now: dt.datetime) -> StudyRecord:
        """A new search study with its first proposals queued.

        Raises:
            InvalidError: no ring fits ``problem`` (nothing to search), the settings' profile is unknown, or a
                seed is not one of ``problem``'s candidates.
        """
        return Searching(ready=self.ready).create(tx, problem=problem, hardware=hardware, settings=settings,
                                                  protocol=protocol, now=now)

    def create_reconfirmation(self, tx: StoreTx, *, config: TunedConfig, software: Software, now: dt.datetime,
                              study_id: int | None = None) -> StudyRecord:
        """A study that re-times the stored ``config`` on the stack ``software``, straight into its confirmation
        round: the stored winner, its runner-up (the best other candidate of the study ``study_id`` that tuned
        it; without one, the cost model's first ring) and the baseline, with that study's settings and protocol.
        Only workers of ``software`` lease its trial (`StoreTx.claim`); its winner is saved for ``software``.

        Raises:
            InvalidError: ``config`` was measured on ``software`` already, or no ring fits its problem.
        """
        return Searching(ready=self.ready).create_reconfirmation(tx, config=config, software=software, now=now,
                                                                 study_id=study_id)

    def create_step_study(self, tx: StoreTx, *, block: TransformerBlock, mesh: MeshSpec, hardware: Hardware,
                          depends_on: Sequence[int], protocol: MeasurementProtocol, now: dt.datetime,
                          submission_id: int | None = None, ablation: bool = True,
                          search_rounds: int = STEP_SEARCH_ROUNDS, round_variants: int = STEP_ROUND_VARIANTS,
                          software: Software | None = None) -> StudyRecord:
        """A study of a model's whole step, run once the search studies ``depends_on`` are final (on the stack
        ``software`` only, with its configs, where given: a model's step again after a software upgrade).

        Args:
            search_rounds: the step search's budget of rounds, the seeds' included (0 or 1: one round of
                the standard menu, graded by the worker).
            round_variants: changes of one role a search round times beside the incumbent.

        Raises:
            ValueError: the model does not fit the mesh.
        """
        return Stepping().create(tx, block=block, mesh=mesh, hardware=hardware, depends_on=depends_on,
                                 protocol=protocol, now=now, submission_id=submission_id, ablation=ablation,
                                 search_rounds=search_rounds, round_variants=round_variants, software=software)

    # -- driving ----------------------------------------------------------------------------

    def refill(self, tx: StoreTx, study_id: int, *, now: dt.datetime) -> list[TrialRecord]:
        """Bring a study forward: top a search's proposals up, or confirm, or finish; start a waiting step study.

        Returns the trials it queued (proposals, a confirmation, a step round).
        """
        return self._refill(tx, tx.study(study_id, lock=True), now=now)

    def _refill(self, tx: StoreTx, study: StudyRecord, *, now: dt.datetime,
                trials: Sequence[TrialRecord] | None = None) -> list[TrialRecord]:
        """`refill` for a study this transaction has locked, whose trials are ``trials`` if the caller knows them."""
        return self._part(study).refill(tx, study, now=now, trials=trials)

    def claim(self, tx: StoreTx, *, study_ids: Sequence[int] | None = None, hardware: Hardware | None = None,
              worker_id: int | None = None, now: dt.datetime) -> TrialRecord | None:
        """Claim the oldest pending trial (of ``study_ids``, or of the active studies on ``hardware`` or its rings).

        The store moves it to ``leased`` atomically (attempts + 1); the first claim starts its study.
        """
        check_trial_move(None, T.PENDING, T.LEASED)
        trial = tx.claim(study_ids=study_ids, hardware=hardware, worker_id=worker_id, now=now)
        if trial is not None:
            self.claimed(tx, trial, now=now)
        return trial

    def claimed(self, tx: StoreTx, trial: TrialRecord, *, now: dt.datetime) -> None:
        """A trial the store just claimed (`claim`, or a store's own claim that does more): the first claim
        starts its study."""
        study = tx.study(trial.study_id)
        if study.state == S.PENDING:  # a claim of another transaction may have started it already
            move_study(tx, study, S.RUNNING, strict=False, started_at=now)

    def release(self, tx: StoreTx, trial: TrialRecord, *, count_attempt: bool) -> None:
        """A claimed trial goes back to the queue (its worker left, or its lease expired)."""
        move_trial(tx, trial, T.PENDING, attempts=trial.attempts if count_attempt else max(trial.attempts - 1, 0))

    def record(self, tx: StoreTx, trial: int | TrialRecord, result: TrialResult, *, now: dt.datetime,
               lease_id: str | None = None) -> TrialRecord:
        """Store a claimed trial's result and bring its study forward.

        Args:
            trial: the trial's id, or its record as this transaction has read and locked it.
            result: a search trial's measurement, a confirmation's (with the problem's bounds), or a step trial's;
                of the trial's kind.

        Returns:
            the trial as stored.

        Raises:
            ConflictError: the trial is not claimed (finished, cancelled, or back in the queue).
            InvalidError: the result is not of this trial's kind, problem and candidates.
        """
        if not isinstance(trial, TrialRecord):
            trial = tx.trial(trial, lock=True)
        study = tx.study(trial.study_id, lock=True)
        if trial.state != T.LEASED:
            raise ConflictError(f"trial {trial.id} is {trial.state}, not leased: drop this result")
        if result.kind != trial.kind:
            raise InvalidError(f"trial {trial.id} is a {trial.kind} trial: {what_to_send(trial.kind, result)}")
        return self._part(study).record(tx, study, trial, result, now=now, lease_id=lease_id)

    def abandon(self, tx: StoreTx, trial: TrialRecord, *, status: Status, message: str, now: dt.datetime) -> None:
        """A trial that will get no result: failed with the reason; its study goes on."""
        move_trial(tx, trial, T.FAILED, status=status, message=message[:2000], finished_at=now)
        study = tx.study(trial.study_id, lock=True)
        if study.state.active:
            self._part(study).abandon(tx, study, trial, message=message, now=now)

    def cancel(self, tx: StoreTx, study_id: int, *, now: dt.datetime) -> StudyRecord:
        """Cancel an active study and its trials in flight.

        Raises:
            ConflictError: the study is already final.
        """
        study = tx.study(study_id, lock=True)
        if not study.state.active:
            raise ConflictError(f"study {study_id} is {study.state}; only pending, running or confirming studies "
                                "cancel")
        for trial in (t for t in tx.trials(study_id) if t.state.in_flight):
            if move_trial(tx, trial, T.CANCELLED, strict=False, message="study cancelled", finished_at=now):
                continue
            now_as = tx.trial(trial.id, lock=True)  # claimed (or reported) since it was read: as it is now
            if now_as.state.in_flight:
                move_trial(tx, now_as, T.CANCELLED, message="study cancelled", finished_at=now)
        move_study(tx, study, S.CANCELLED, stop_reason=StopReason.CANCELLED, finished_at=now)
        self._part(study).cancelled(tx, study, now=now)
        return tx.study(study_id)

    def _part(self, study: StudyRecord) -> Part:
        return part_of(study, ready=self.ready)
