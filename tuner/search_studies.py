"""The search study's part of the lifecycle: the decompositions of one (problem, hardware), and its re-confirmation.

1. `Searching.create`: the study starts ``pending`` with ``ready`` proposals (search trials) queued.  Proposals
   come from a `Searcher` rebuilt from the history (finished trials and those in flight, so parallel proposals
   differ: Optuna's constant liar); its settings carry the seeds of a warm start (`cmtune.tuner.warm`), timed
   right after the baseline.
2. `Searching.refill`, after each result: while the stop rule (`cmtune.tuner.search.stop_reason`: trial budget,
   time budget, patience, seeds that agree with their neighbours, exhaustion; or a failed baseline) lets the
   search go on, it tops the proposals up to ``ready``; once it stops, unclaimed proposals are cancelled and,
   when nothing is in flight any more, the confirmation round is queued: the top ``confirm_top`` candidates and
   the baseline, re-timed together.  If only the baseline ran, the study finishes at once.
3. `Searching.finish`: the confirmation round's winner becomes the tuned config (``completed``), with the bounds
   the round timed after its candidates (`collective_matmul.wire.bounds`); a study the baseline won says why in its
   message (`collective_matmul.wire.bounds.reason`).  When the round produced nothing usable, the search trials' own
   measurements decide and the study's message says so; when nothing ran at all, not even the baseline, the
   study ``failed`` with the reasons.  A search study that ends wakes the step studies waiting for it
   (`cmtune.tuner.step_studies.wake_step_studies`).
4. A search trial abandoned counts as a trial without a result and the search goes on; an abandoned
   confirmation finishes the study from the search trials.
5. A re-confirmation (`Searching.create_reconfirmation`) re-times a stored config on another software stack: a
   search study created straight into its confirmation round (the stored winner, its runner-up from the study
   that tuned it, and the baseline), whose trial only workers of that stack lease.  `Searching.finish` saves the
   round's winner for the new stack, ``re-confirmed`` (the same decomposition) or ``replaced`` (a new winner),
   which the study's stop reason and message say; the old stack's config stays.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from cmtune.tuner.errors import InvalidError
from cmtune.tuner.search import (
    Finished,
    Searcher,
    SearchSettings,
    default_budget,
    failure_counts,
    pick_winner,
    stop_reason,
    tuned_config,
)
from cmtune.tuner.states import StopReason, move_study, move_trial
from cmtune.tuner.step_studies import wake_step_studies
from cmtune.tuner.store import StoreTx, StudyRecord, TrialRecord
from collective_matmul.planning.costmodel import PROFILES, profile_for
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.planning.space import candidates, has_ring, no_ring_reason
from collective_matmul.wire import (
    BoundsMeasurement,
    ConfirmResult,
    Measurement,
    MeasurementProtocol,
    Reconfirmation,
    Sampler,
    Screened,
    SearchResult,
    Seed,
    Status,
    StudyState,
    TrialKind,
    TrialState,
    TrialTask,
)
from collective_matmul.wire.bounds import reason
from collective_matmul.wire.bundle import TunedConfig

S, T = StudyState, TrialState
# stop reasons after which proposals nobody has claimed yet are dropped (the others count them)
_DROP_PROPOSALS = frozenset({StopReason.TIME_BUDGET, StopReason.NO_IMPROVEMENT, StopReason.NEIGHBOURS_AGREE,
                             StopReason.BASELINE_FAILED})


def profile_name_for(hardware: Hardware) -> str:
    """The static cost-model profile of a platform, ``generic`` for one without figures (the engine
    never calibrates: see `study_settings`)."""
    profile = profile_for(hardware)
    return profile.name if profile is not None else "generic"


def study_settings(problem: Problem, hardware: Hardware, *, trials: int | None = None, minutes: float | None = None,
                   patience: int | None = None, sampler: Sampler = "auto", seed: int = 0,
                   confirm_top: int = 3, seeds: Sequence[Seed] = (),
                   screen: Sequence[Screened] = ()) -> SearchSettings:
    """A study's settings from what a user asks (command line or API), defaults filled in one place.

    The trial budget defaults to `default_budget` of the space; the cost-model profile that orders
    the candidates is the static profile of the hardware's platform (`profile_name_for`), never a
    timing taken on one process, so every process and every replica orders them alike.  ``seeds``
    (warm start: `cmtune.tuner.warm.seeds`) are timed right after the baseline; ``screen`` (each candidate's
    compiled schedule on the hardware, `cmtune.workers.aot.screen`) puts the forms that overlap first.
    """
    return SearchSettings(
        sampler=sampler, seed=seed, max_trials=trials or default_budget(len(candidates(problem))),
        max_seconds=minutes * 60 if minutes else None, patience=patience, confirm_top=confirm_top,
        profile=profile_name_for(hardware), seeds=tuple(seeds), screen=tuple(screen),
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


class Searching:
    """The search study's part of the lifecycle (the engine dispatches a study of kind ``search`` here).

    Args:
        ready: search proposals kept queued per study, so that a claim never waits for an ask.
    """

    def __init__(self, *, ready: int = 1):
        self.ready = ready

    def create(self, tx: StoreTx, *, problem: Problem, hardware: Hardware, settings: SearchSettings,
               protocol: MeasurementProtocol, now: dt.datetime) -> StudyRecord:
        """A new study with its first proposals queued (`Engine.create_study`)."""
        if not has_ring(problem):
            raise InvalidError(f"{problem.key}: nothing to tune: {no_ring_reason(problem)}")
        space = set(candidates(problem, platform=hardware.platform))
        misfits = [s.decomposition.id for s in settings.seeds if s.decomposition not in space]
        if misfits:
            raise InvalidError(f"{problem.key}: the seeds {misfits} are not candidates of this problem: leave them "
                               "out (cmtune.tuner.warm.seeds keeps only those that fit)")
        if settings.profile is None:
            settings = settings.model_copy(update={"profile": profile_name_for(hardware)})
        if settings.profile not in PROFILES:
            raise InvalidError(f"unknown cost-model profile {settings.profile!r}; one of {sorted(PROFILES)}")
        study = tx.add_study(problem=problem, hardware=hardware.identity(), settings=settings, protocol=protocol,
                             space_size=len(candidates(problem, platform=hardware.platform)), now=now)
        self.refill(tx, study, now=now, trials=())
        return tx.study(study.id)

    def create_reconfirmation(self, tx: StoreTx, *, config: TunedConfig, software: Software, now: dt.datetime,
                              study_id: int | None = None) -> StudyRecord:
        """A re-confirmation of ``config`` on ``software``, straight into its confirmation round
        (`Engine.create_reconfirmation`)."""
        problem, hardware = config.problem, config.hardware.identity()
        if config.software.key == software.key:
            raise InvalidError(f"{problem.key} was measured on {software} already: nothing to re-confirm")
        if not has_ring(problem):
            raise InvalidError(f"{problem.key}: nothing to re-confirm: {no_ring_reason(problem)}")
        origin = tx.study(study_id) if study_id is not None else None
        settings = origin.settings if origin is not None else study_settings(problem, hardware)
        protocol = origin.protocol if origin is not None else MeasurementProtocol()
        winner = config.decomposition
        runner_up = _runner_up(tx, origin, winner) if origin is not None else None
        contenders = [Decomposition.baseline(),
                      *(d for d in (winner, runner_up) if d is not None and d.method == "ring")]
        if len(contenders) < 3 and runner_up is None:  # something to compare the stored winner with
            by_model = searcher(problem, hardware, settings).by_model
            contenders += [d for d in by_model if d.method == "ring" and d not in contenders][:1]
        record = Reconfirmation(config=config, decomposition_id=winner.id, runner_up=runner_up, contenders=contenders,
                                study_id=origin.id if origin is not None else None)
        study = tx.add_study(problem=problem, hardware=hardware, settings=settings, protocol=protocol,
                             space_size=len(candidates(problem)), now=now, software=software, reconfirm=record)
        move_study(tx, study, S.CONFIRMING, started_at=now)
        tx.add_trials(study.id, TrialKind.CONFIRM, [contenders], now, after=0)
        return tx.study(study.id)

    def refill(self, tx: StoreTx, study: StudyRecord, *, now: dt.datetime,
               trials: Sequence[TrialRecord] | None = None) -> list[TrialRecord]:
        """Top a searching study's proposals up, or confirm, or finish; the trials it queued.

        ``study`` is locked by this transaction (its settings and state as read); ``trials`` are its trials if
        the caller knows them (a study just created has none)."""
        study_id = study.id
        if study.state not in (S.PENDING, S.RUNNING):
            return []
        trials = tx.trials(study_id) if trials is None else trials
        last = max((t.number for t in trials), default=0)
        history = History.of(trials)
        asking = searcher(study.problem, study.hardware, study.settings)
        elapsed = (now - study.started_at).total_seconds() if study.started_at else 0.0
        proposals: list[Decomposition] = []
        while True:
            in_flight = history.in_flight + proposals
            why = StopReason.BASELINE_FAILED if history.baseline_failed else stop_reason(
                study.settings, history.finished, elapsed_s=elapsed,
                exhausted=asking.exhausted(history.finished, in_flight), in_flight=len(in_flight))
            if why is not None or len(history.pending) + len(proposals) >= self.ready:
                break
            config = asking.ask(history.finished, in_flight)
            if config is None:
                break
            proposals.append(config)
        if proposals:
            return tx.add_trials(study_id, TrialKind.SEARCH, [[c] for c in proposals], now, after=last)
        if why is None:
            return []
        if why in _DROP_PROPOSALS:
            # a proposal a worker claimed since it was read stays leased: its result is a measurement like any
            for trial in history.pending:
                move_trial(tx, trial, T.CANCELLED, strict=False,
                           message=f"not needed: the search stopped ({why}) after {len(history.finished)} trials")
            trials = tx.trials(study_id)
            history = History.of(trials)
        if history.in_flight:
            return []  # the search is over: confirm once every trial is back
        tx.update_study(study_id, stop_reason=why)
        contenders = asking.confirm_set(history.finished)
        if len(contenders) == 1:  # nothing but the baseline ran: it is the tuned config
            self.finish(tx, study_id, confirmation=None, now=now)
            return []
        move_study(tx, study, S.CONFIRMING)
        return tx.add_trials(study_id, TrialKind.CONFIRM, [contenders], now, after=last)

    def record(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, result: SearchResult | ConfirmResult, *,
               now: dt.datetime, lease_id: str | None) -> TrialRecord:
        """Store a search trial's measurement (the search goes on) or a confirmation's (the study finishes).

        Raises:
            InvalidError: the result is not of this trial's problem and candidates.
        """
        measured = result.measurements
        searched = result.kind == TrialKind.SEARCH
        bounds = None if searched else result.bounds
        _check_matches(study, trial, measured)
        if bounds is not None and bounds.problem != study.problem:
            raise InvalidError(f"trial {trial.id} is for {study.problem.key}, its bounds are for {bounds.problem.key}")
        if searched:
            m = result.measurement
            status, ratio, message = m.status, (m.ratio if m.ok else None), (m.message[:2000] or None)
        else:
            ok = [m for m in measured if m.ok]
            status, ratio, message = (Status.OK if ok else Status.ERROR), min((m.ratio for m in ok), default=None), None
        done = dict(state=T.COMPLETED, status=status, ratio=ratio, measurements=tuple(measured), message=message,
                    finished_at=now, result_lease_id=lease_id, **({"bounds": bounds} if bounds is not None else {}))
        counted = study.state.active and searched
        move_trial(tx, trial, study_changes=_progress(study, trial.id, ratio) if counted else None, **done)
        if study.state.active:
            if searched:
                self.refill(tx, study, now=now)
            else:
                self.finish(tx, study.id, confirmation=list(measured), now=now, bounds=bounds)
        return dataclasses.replace(trial, **done)

    def abandon(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, *, message: str, now: dt.datetime) -> None:
        """A search trial without a result counts as one and the search goes on; a confirmation without one
        finishes the study from the search trials."""
        if trial.kind == TrialKind.CONFIRM:
            self.finish(tx, study.id, confirmation=None, now=now,
                        note=f"the confirmation round got no result ({message})")
        else:
            tx.update_study(study.id, **_progress(study, trial.id, None))
            self.refill(tx, tx.study(study.id, lock=True), now=now)

    def cancelled(self, tx: StoreTx, study: StudyRecord, *, now: dt.datetime) -> None:
        """A cancelled search study is final: the step studies waiting for it may start."""
        wake_step_studies(tx, study.hardware, now=now)

    @staticmethod
    def task(study: StudyRecord, trial: TrialRecord) -> TrialTask:
        """What a worker runs for a search trial, or for a confirmation round (re-timed with `confirm_repeats`
        runs)."""
        protocol = study.protocol
        if trial.kind == TrialKind.CONFIRM:
            protocol = protocol.model_copy(update={"repeats": study.settings.confirm_repeats})
        return TrialTask(id=trial.id, study_id=study.id, kind=trial.kind, problem=study.problem,
                         decomposition=trial.decomposition if trial.kind == TrialKind.SEARCH else None,
                         decompositions=list(trial.decompositions), protocol=protocol)

    @staticmethod
    def finish(tx: StoreTx, study_id: int, *, confirmation: list[Measurement] | None, now: dt.datetime,
               note: str | None = None, bounds: BoundsMeasurement | None = None) -> None:
        """Complete a study with its tuned config (and the bounds its confirmation timed, where they are ok), or
        fail it with the reasons; a study the baseline won says why (`collective_matmul.wire.bounds.reason`)."""
        study = tx.study(study_id, lock=True)
        pool = list(confirmation or [])
        fallback = not any(m.ok for m in pool)  # the search trials' measurements are read only then
        search = [t for t in tx.trials(study_id, measurements=fallback) if t.kind == TrialKind.SEARCH]
        if fallback:
            if confirmation is not None and note is None:
                note = "every measurement of the confirmation round failed"
            pool = [m for t in search for m in (t.measurements or ())]
            note = f"{note}; tuned from the search trials' own measurements" if note else None
        winner = pick_winner(pool)
        if winner is None:
            reasons = "; ".join(f"{t.decomposition.id}: {t.status or t.state} {t.message or ''}".strip()
                                for t in search if t.state in (T.COMPLETED, T.FAILED))
            if study.reconfirm is not None:  # no search of its own: the round is all it had
                said = "; ".join(f"{m.decomposition.id}: {m.status} {m.message}".strip() for m in confirmation or ())
                reasons = f"the re-confirmation round on {study.software}: {said or 'it got no result'}"
            move_study(tx, study, S.FAILED, finished_at=now,
                       message=("no candidate, not even the baseline, ran successfully: " + reasons)[:2000])
            wake_step_studies(tx, study.hardware, now=now)
            return
        finished = [t for t in search if t.state in (T.COMPLETED, T.FAILED)]
        invalid, failed = failure_counts(t.status for t in finished)
        config = tuned_config(study.problem, winner, trials=len(finished), invalid=invalid, failed=failed,
                              space_size=study.space_size)
        config = TunedConfig(**{**dict(config), "hardware": study.hardware.identity(),
                                **((bounds.medians or {}) if bounds is not None else {})})
        outcome = {}
        if study.software is not None:  # a study of one stack saves its config for that stack
            config = config.measured_on(study.software)
        if study.reconfirm is not None:
            config, outcome = _reconfirmed(study, config)
            note = f"{outcome['message']}; {note}" if note else outcome["message"]
        tx.save_tuned(config, study_id=study_id)
        if not config.ring and study.reconfirm is None:
            rings = [m.ratio for m in pool if m.ok and m.decomposition.method == "ring"]
            why = reason(config.bounds, best_ring_ratio=min(rings, default=None))
            note = f"no ring won: {why}" + (f" ({note})" if note else "")
        move_study(tx, study, S.COMPLETED, finished_at=now, message=note[:2000] if note else None,
                   **({"stop_reason": outcome["stop_reason"], "trials_done": 1} if outcome else {}))
        wake_step_studies(tx, study.hardware, now=now)


def searcher(problem: Problem, hardware: Hardware, settings: SearchSettings) -> Searcher:
    """The searcher of a study of ``problem`` on ``hardware`` with ``settings`` (its profile, or the platform's; its
    space holds XLA's own decomposition where the platform has one)."""
    return _searcher(problem, settings.profile or profile_name_for(hardware), settings, hardware.platform)


@functools.lru_cache(maxsize=1024)
def _searcher(problem: Problem, profile: str, settings: SearchSettings, platform: str) -> Searcher:
    """Searchers of the studies in progress: a searcher is a pure function of these four (its space
    and cost-model order are computed once per study, not once per ask)."""
    return Searcher(problem, profile, settings, platform)


def _progress(study: StudyRecord, trial_id: int, ratio: float | None) -> dict:
    """The study's progress after one more finished search trial: the count and the best so far."""
    best = ratio is not None and (study.best_ratio is None or ratio < study.best_ratio)
    return {"trials_done": study.trials_done + 1, **({"best_ratio": ratio, "best_trial_id": trial_id} if best else {})}


def _runner_up(tx: StoreTx, origin: StudyRecord, winner: Decomposition) -> Decomposition | None:
    """The best ring of ``origin``'s search other than ``winner`` (of a re-confirmation: its other contenders)."""
    ranked = sorted((f for f in History.of(tx.trials(origin.id)).finished
                     if f.ratio is not None and f.config.method == "ring"), key=lambda f: f.ratio)
    others = [f.config for f in ranked] + list(origin.reconfirm.contenders if origin.reconfirm else ())
    return next((d for d in others if d.method == "ring" and d != winner), None)


def _reconfirmed(study: StudyRecord, config: TunedConfig) -> tuple[TunedConfig, dict]:
    """A re-confirmation's config (the round's times on the new stack, the search's evidence of the stored
    config) and its outcome: stop reason ``re-confirmed`` or ``replaced``, and a message saying which."""
    stored = study.reconfirm.config
    config = config.model_copy(update={"trials": stored.trials, "invalid": stored.invalid, "failed": stored.failed,
                                       "space_size": stored.space_size})
    if config.decomposition == stored.decomposition:
        message = (f"re-confirmed on {study.software}: {config.decomposition.id} still wins ({config.speedup:.2f}x; "
                   f"{stored.speedup:.2f}x on {stored.software})")
        return config, {"stop_reason": StopReason.RECONFIRMED, "message": message}
    message = (f"replaced on {study.software}: {config.decomposition.id} ({config.speedup:.2f}x) beat the stored "
               f"{stored.decomposition.id} ({stored.speedup:.2f}x on {stored.software})")
    return config, {"stop_reason": StopReason.REPLACED, "message": message}


def _check_matches(study: StudyRecord, trial: TrialRecord, results: Sequence[Measurement]) -> None:
    """`InvalidError` unless ``results`` time exactly ``trial``'s candidates, of the study's problem, on its stack."""
    got = [m.decomposition for m in results]
    if got != list(trial.decompositions):
        raise InvalidError(f"trial {trial.id} timed {[d.id for d in trial.decompositions]}, "
                           f"the result is for {[d.id for d in got]}")
    for m in results:
        if m.problem != study.problem:
            raise InvalidError(f"trial {trial.id} is for {study.problem.key}, the result is for {m.problem.key}")
        stack = m.hardware.software
        if study.software is not None and stack is not None and stack.key != study.software.key:
            raise InvalidError(f"trial {trial.id} runs on {study.software}, the result was measured on {stack}")
