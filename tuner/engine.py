"""The study engine: the one owner of the study lifecycle, for `cmtune tune` and for the service.

A study searches the decompositions of one (problem, hardware).  The engine is stateless: each
call reads the study's history from a store transaction (`cmtune.tuner.store`) and writes its
decisions back, so any process can drive any study (a replica of the service, or `cmtune tune`
over the in-memory store) and a restart loses nothing.  The lifecycle:

1. `create_study`: the study starts ``pending`` with ``ready`` proposals (search trials) queued.
   Proposals come from a `Searcher` rebuilt from the history (finished trials and those in
   flight, so parallel proposals differ: Optuna's constant liar); its settings carry the seeds
   of a warm start (`cmtune.tuner.warm`), timed right after the baseline.
2. `claim`: a worker (or the local runner) takes the oldest pending trial: a claim, never an
   ask.  The first claim starts the study (``running``; its time budget counts from here).
3. `record`: a result is stored, then `refill` brings the study forward: while the stop rule
   (trial budget, time budget, patience, seeds that agree with their neighbours, exhaustion, a
   failed baseline) lets the search go on, it tops the proposals up to ``ready``; once it stops,
   unclaimed proposals are cancelled and, when nothing is in flight any more, the confirmation
   round is queued: the top ``confirm_top`` candidates and the baseline, re-timed together.  If
   only the baseline ran, the study finishes at once.
4. `_finish`: the confirmation round's winner becomes the tuned config (``completed``), with the
   bounds the round timed after its candidates (`collective_matmul.bounds`); a study the baseline
   won says why in its message, from those bounds (`collective_matmul.bounds.reason`).  When
   the round produced nothing usable, the search trials' own measurements decide and the
   study's message says so; when nothing ran at all, not even the baseline, the study
   ``failed`` with the reasons.
5. `abandon`: a trial that will get no result (its attempts are used up) is ``failed`` with the
   reason, and the study goes on as after a result; an abandoned confirmation finishes the
   study from the search trials.
6. `cancel`: final; trials in flight are cancelled.

7. A step study (`create_step_study`) measures a submitted model's whole training step once the
   search studies it depends on are final, and searches its per-role configs with the step as the
   objective (`cmtune.tuner.stepsearch`): each round is one step trial naming exactly the variants
   to time (each with its per-role configs), rebuilt into the search from the stored rounds when
   its result comes (`_record_step`), which queues the next round; once the budget is spent or a
   full pass over the roles changed nothing, the study is ``confirming`` and a last trial grades
   the choice in fresh rounds.  Candidates per slot are each problem's best search trials
   (`step_space`).  With a budget of one round, one trial times the standard menu (the tuned
   configs against the block as written, the all-baseline custom VJP, the whole-step
   alternatives, each role set back and each ring weight gradient fused) and the worker grades
   `step_decision`'s choice itself, as step trials before the search did.  Either way the
   choice's changes become per-model, per-role overrides (`RoleOverride`) with their reasons, and
   the study records the measured speedup of what will run (`StepChoice`).

8. A re-confirmation (`create_reconfirmation`) re-times a stored config on another software stack:
   a study created straight into its confirmation round (the stored winner, its runner-up from the
   study that tuned it, and the baseline), whose trial only workers of that stack lease.  `_finish`
   saves the round's winner for the new stack, ``re-confirmed`` (the same decomposition) or
   ``replaced`` (a new winner), which the study's stop reason and message say; the old stack's
   config stays.

Every state change goes through `_move_study` / `_move_trial`, which refuse transitions that are
not in `STUDY_MOVES` / `TRIAL_MOVES` (`check_study_move`, `check_trial_move`; the database's CHECK
constraints hold the same states) and are the only callers of the store's `apply_study_move` /
`apply_trial_move`.  A store's claim (pending to leased, in one statement) checks the same table.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
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
from cmtune.tuner.stepsearch import SearchSpace, StepDecision, StepSearch, replay, step_decision
from cmtune.tuner.store import StepSpec, StoreTx, StudyRecord, TrialRecord
from cmtune.tuner.variants import variant_configs
from collective_matmul.bounds import reason, step_bound
from collective_matmul.bundle import TunedConfig
from collective_matmul.costmodel import PROFILES, profile_for
from collective_matmul.decomposition import Decomposition, OpConfigs
from collective_matmul.lookup import weight_gradient
from collective_matmul.models import ROLES, SLOTS, MeshSpec, TransformerBlock, role_problems
from collective_matmul.problem import Hardware, Problem, Software
from collective_matmul.space import candidates, has_ring, no_ring_reason
from collective_matmul.wire import (
    STEP_ROUND_VARIANTS,
    STEP_SEARCH_ROUNDS,
    BoundsMeasurement,
    Confirmation,
    Measurement,
    Protocol,
    Reconfirmation,
    Seed,
    Status,
    StepChoice,
    StepMeasurement,
    StepTask,
    StudyKind,
    StudyState,
    TrialKind,
    TrialState,
    TrialTask,
)

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
_DROP_PROPOSALS = ("time budget", "no improvement", "neighbours agree", "baseline failed")
STEP_CANDIDATES = 3  # a problem's best search trials a step search considers per slot (the winner among them)


def profile_name_for(hardware: Hardware) -> str:
    """The static cost-model profile of a platform, ``generic`` for one without figures (the engine
    never calibrates: see `study_settings`)."""
    profile = profile_for(hardware)
    return profile.name if profile is not None else "generic"


def study_settings(problem: Problem, hardware: Hardware, *, trials: int | None = None, minutes: float | None = None,
                   patience: int | None = None, sampler: Sampler = "auto", seed: int = 0,
                   confirm_top: int = 3, seeds: Sequence[Seed] = ()) -> SearchSettings:
    """A study's settings from what a user asks (command line or API), defaults filled in one place.

    The trial budget defaults to `default_budget` of the space; the cost-model profile that orders
    the candidates is the static profile of the hardware's platform (`profile_name_for`), never a
    timing taken on one process, so every process and every replica orders them alike.  ``seeds``
    (warm start: `cmtune.tuner.warm.seeds`) are timed right after the baseline.
    """
    return SearchSettings(
        sampler=sampler, seed=seed, max_trials=trials or default_budget(len(candidates(problem))),
        max_seconds=minutes * 60 if minutes else None, patience=patience, confirm_top=confirm_top,
        profile=profile_name_for(hardware), seeds=tuple(seeds),
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
        """A new study with its first proposals queued.

        Raises:
            InvalidError: no ring fits ``problem`` (nothing to search), the settings' profile is unknown, or a
                seed is not one of ``problem``'s candidates.
        """
        if not has_ring(problem):
            raise InvalidError(f"{problem.key}: nothing to tune: {no_ring_reason(problem)}")
        space = set(candidates(problem))
        misfits = [s.decomposition.id for s in settings.seeds if s.decomposition not in space]
        if misfits:
            raise InvalidError(f"{problem.key}: the seeds {misfits} are not candidates of this problem: leave them "
                               "out (cmtune.tuner.warm.seeds keeps only those that fit)")
        if settings.profile is None:
            settings = settings.model_copy(update={"profile": profile_name_for(hardware)})
        if settings.profile not in PROFILES:
            raise InvalidError(f"unknown cost-model profile {settings.profile!r}; one of {sorted(PROFILES)}")
        study = tx.add_study(problem=problem, hardware=hardware.identity(), settings=settings, protocol=protocol,
                             space_size=len(candidates(problem)), now=now)
        self._refill(tx, study, now=now, trials=())
        return tx.study(study.id)

    def searcher(self, study: StudyRecord) -> Searcher:
        return _searcher(study.problem, study.settings.profile or profile_name_for(study.hardware), study.settings)

    def refill(self, tx: StoreTx, study_id: int, *, now: dt.datetime) -> list[TrialRecord]:
        """Bring a searching study forward: top its proposals up, or confirm, or finish.

        Returns the trials it queued (proposals or the confirmation).
        """
        return self._refill(tx, tx.study(study_id, lock=True), now=now)

    def _refill(self, tx: StoreTx, study: StudyRecord, *, now: dt.datetime,
                trials: Sequence[TrialRecord] | None = None) -> list[TrialRecord]:
        """`refill` for a study this transaction has locked (its settings and state as read), whose trials
        are ``trials`` if the caller knows them (a study it just created has none)."""
        study_id = study.id
        if study.kind == StudyKind.STEP:
            return self._refill_step(tx, study, now=now)
        if study.state not in (S.PENDING, S.RUNNING):
            return []
        trials = tx.trials(study_id) if trials is None else trials
        last = max((t.number for t in trials), default=0)
        history = History.of(trials)
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
            return tx.add_trials(study_id, TrialKind.SEARCH, [[c] for c in proposals], now, after=last)
        if reason is None:
            return []
        if reason in _DROP_PROPOSALS:
            # a proposal a worker claimed since it was read stays leased: its result is a measurement like any
            for trial in history.pending:
                self._move_trial(tx, trial, T.CANCELLED, strict=False,
                                 message=f"not needed: the search stopped ({reason}) after "
                                         f"{len(history.finished)} trials")
            trials = tx.trials(study_id)
            history = History.of(trials)
        if history.in_flight:
            return []  # the search is over: confirm once every trial is back
        tx.update_study(study_id, stop_reason=reason)
        contenders = searcher.confirm_set(history.finished)
        if len(contenders) == 1:  # nothing but the baseline ran: it is the tuned config
            self._finish(tx, study_id, confirmation=None, now=now)
            return []
        self._move_study(tx, study, S.CONFIRMING)
        return tx.add_trials(study_id, TrialKind.CONFIRM, [contenders], now, after=last)

    def claim(self, tx: StoreTx, *, study_ids: Sequence[int] | None = None, hardware: Hardware | None = None,
              worker_id: int | None = None, now: dt.datetime) -> TrialRecord | None:
        """Claim the oldest pending trial (of ``study_ids``, or of the active studies on ``hardware``).

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
            self._move_study(tx, study, S.RUNNING, strict=False, started_at=now)

    def release(self, tx: StoreTx, trial: TrialRecord, *, count_attempt: bool) -> None:
        """A claimed trial goes back to the queue (its worker left, or its lease expired)."""
        self._move_trial(tx, trial, T.PENDING, attempts=trial.attempts if count_attempt else max(trial.attempts - 1, 0))

    # -- results ----------------------------------------------------------------------------

    def record(self, tx: StoreTx, trial: int | TrialRecord,
               results: Sequence[Measurement] | Confirmation | StepMeasurement, *, now: dt.datetime,
               lease_id: str | None = None, kind: TrialKind | None = None) -> TrialRecord:
        """Store a claimed trial's result and bring its study forward.

        Args:
            trial: the trial's id, or its record as this transaction has read and locked it.
            results: a search trial's measurement (as a list); a confirmation's measurements, as a list or as a
                `Confirmation` with the problem's bounds; a step trial's measurement.

        Raises:
            ConflictError: the trial is not claimed (finished, cancelled, or back in the queue).
            InvalidError: the results are not of this trial's problem and candidates.
        """
        if not isinstance(trial, TrialRecord):
            trial = tx.trial(trial, lock=True)
        trial_id = trial.id
        study = tx.study(trial.study_id, lock=True)
        if trial.state != T.LEASED:
            raise ConflictError(f"trial {trial_id} is {trial.state}, not leased: drop this result")
        if kind is not None and kind != trial.kind:
            field = {TrialKind.SEARCH: "measurement", TrialKind.CONFIRM: "measurements"}.get(trial.kind, "step")
            raise InvalidError(f"trial {trial_id} is a {trial.kind} trial: send '{field}'")
        if trial.kind == TrialKind.STEP:
            return self._record_step(tx, study, trial, results, now=now, lease_id=lease_id)
        bounds = None
        if isinstance(results, Confirmation):
            if trial.kind != TrialKind.CONFIRM:
                raise InvalidError(f"trial {trial_id} is a {trial.kind} trial: send 'measurement' (bounds come with "
                                   "a confirmation only)")
            results, bounds = results.measurements, results.bounds
        _check_matches(study, trial, results)
        if bounds is not None and bounds.problem != study.problem:
            raise InvalidError(f"trial {trial_id} is for {study.problem.key}, its bounds are for {bounds.problem.key}")
        if trial.kind == TrialKind.SEARCH:
            (m,) = results
            status, ratio, message = m.status, (m.ratio if m.ok else None), (m.message[:2000] or None)
        else:
            ok = [m for m in results if m.ok]
            status, ratio, message = (Status.OK if ok else Status.ERROR), min((m.ratio for m in ok), default=None), None
        done = dict(state=T.COMPLETED, status=status, ratio=ratio, measurements=tuple(results), message=message,
                    finished_at=now, result_lease_id=lease_id, **({"bounds": bounds} if bounds is not None else {}))
        counted = study.state.active and trial.kind == TrialKind.SEARCH
        self._move_trial(tx, trial, study_changes=self._progress(study, trial_id, ratio) if counted else None, **done)
        if study.state.active:
            if trial.kind == TrialKind.CONFIRM:
                self._finish(tx, study.id, confirmation=list(results), now=now, bounds=bounds)
            else:
                self._refill(tx, study, now=now)
        return dataclasses.replace(trial, **done)

    def abandon(self, tx: StoreTx, trial: TrialRecord, *, status: Status, message: str, now: dt.datetime) -> None:
        """A trial that will get no result: failed with the reason; its study goes on."""
        self._move_trial(tx, trial, T.FAILED, status=status, message=message[:2000], finished_at=now)
        study = tx.study(trial.study_id, lock=True)
        if not study.state.active:
            return
        if trial.kind == TrialKind.CONFIRM:
            self._finish(tx, study.id, confirmation=None, now=now,
                         note=f"the confirmation round got no result ({message})")
        elif trial.kind == TrialKind.STEP:
            if trial.variants is None or trial.number == 1:
                self._move_study(tx, study, S.FAILED, finished_at=now,
                                 message=f"the step measurement got no result: {message}"[:2000])
            else:  # a search round, or the grading, without a result: the search goes on without it
                self._advance_step(tx, study, trial, None, now=now)
        else:
            tx.update_study(study.id, **self._progress(study, trial.id, None))
            self.refill(tx, study.id, now=now)

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
            if self._move_trial(tx, trial, T.CANCELLED, strict=False, message="study cancelled", finished_at=now):
                continue
            now_as = tx.trial(trial.id, lock=True)  # claimed (or reported) since it was read: as it is now
            if now_as.state.in_flight:
                self._move_trial(tx, now_as, T.CANCELLED, message="study cancelled", finished_at=now)
        self._move_study(tx, study, S.CANCELLED, stop_reason="cancelled", finished_at=now)
        if study.kind == StudyKind.SEARCH:
            self._wake_step_studies(tx, study.hardware, now=now)
        return tx.study(study_id)

    # -- re-confirmation on a new software stack ----------------------------------------------

    def create_reconfirmation(self, tx: StoreTx, *, config: TunedConfig, software: Software, now: dt.datetime,
                              study_id: int | None = None) -> StudyRecord:
        """A study that re-times the stored ``config`` on the stack ``software``, straight into its confirmation
        round: the stored winner, its runner-up (the best other candidate of the study ``study_id`` that tuned
        it; without one, the cost model's first ring) and the baseline, with that study's settings and protocol.
        Only workers of ``software`` lease its trial (`StoreTx.claim`); `_finish` saves its winner for
        ``software``.

        Raises:
            InvalidError: ``config`` was measured on ``software`` already, or no ring fits its problem.
        """
        problem, hardware = config.problem, config.hardware.identity()
        if config.software.key == software.key:
            raise InvalidError(f"{problem.key} was measured on {software} already: nothing to re-confirm")
        if not has_ring(problem):
            raise InvalidError(f"{problem.key}: nothing to re-confirm: {no_ring_reason(problem)}")
        origin = tx.study(study_id) if study_id is not None else None
        settings = origin.settings if origin is not None else study_settings(problem, hardware)
        protocol = origin.protocol if origin is not None else Protocol()
        winner = config.decomposition
        runner_up = self._runner_up(tx, origin, winner) if origin is not None else None
        contenders = [Decomposition.baseline(),
                      *(d for d in (winner, runner_up) if d is not None and d.method == "ring")]
        if len(contenders) < 3 and runner_up is None:  # something to compare the stored winner with
            searcher = _searcher(problem, settings.profile or profile_name_for(hardware), settings)
            contenders += [d for d in searcher.by_model if d.method == "ring" and d not in contenders][:1]
        record = Reconfirmation(config=config, decomposition_id=winner.id, runner_up=runner_up, contenders=contenders,
                                study_id=origin.id if origin is not None else None)
        study = tx.add_study(problem=problem, hardware=hardware, settings=settings, protocol=protocol,
                             space_size=len(candidates(problem)), now=now, software=software, reconfirm=record)
        self._move_study(tx, study, S.CONFIRMING, started_at=now)
        tx.add_trials(study.id, TrialKind.CONFIRM, [contenders], now, after=0)
        return tx.study(study.id)

    @staticmethod
    def _runner_up(tx: StoreTx, origin: StudyRecord, winner: Decomposition) -> Decomposition | None:
        """The best ring of ``origin``'s search other than ``winner`` (of a re-confirmation: its other contenders)."""
        ranked = sorted((f for f in History.of(tx.trials(origin.id)).finished
                         if f.ratio is not None and f.config.method == "ring"), key=lambda f: f.ratio)
        others = [f.config for f in ranked] + list(origin.reconfirm.contenders if origin.reconfirm else ())
        return next((d for d in others if d.method == "ring" and d != winner), None)

    # -- the step study ---------------------------------------------------------------------

    def create_step_study(self, tx: StoreTx, *, block: TransformerBlock, mesh: MeshSpec, hardware: Hardware,
                          depends_on: Sequence[int], protocol: Protocol, now: dt.datetime,
                          submission_id: int | None = None, ablation: bool = True,
                          search_rounds: int = STEP_SEARCH_ROUNDS, round_variants: int = STEP_ROUND_VARIANTS,
                          software: Software | None = None) -> StudyRecord:
        """A study of a model's whole step, run once the search studies ``depends_on`` are final (on the stack
        ``software`` only, with its configs, where given: a model's step again after a software upgrade).

        Args:
            search_rounds: the step search's budget of rounds, the seeds' included (0 or 1: one round of
                the standard menu, graded by the worker).
            round_variants: changes of one role a search round times beside the incumbent.
        """
        role_problems(block, mesh)  # the model must fit the mesh (ValueError otherwise)
        spec = StepSpec(block, mesh, tuple(depends_on), ablation, max(search_rounds, 1), round_variants)
        study = tx.add_study(problem=None, hardware=hardware.identity(), settings=SearchSettings(), protocol=protocol,
                             space_size=0, now=now, kind=StudyKind.STEP, submission_id=submission_id, step=spec,
                             software=software)
        self._refill_step(tx, study, now=now)
        return tx.study(study.id)

    @staticmethod
    def step_study_of(tx: StoreTx, *, block: TransformerBlock, mesh: MeshSpec, hardware: Hardware,
                      ) -> StudyRecord | None:
        """The step study of this model (block and mesh) on ``hardware`` that is not final, if any: one
        measures a model at a time, and an identical submission joins it."""
        return next((s for s in tx.active_step_studies(hardware) if s.step.block == block and s.step.mesh == mesh),
                    None)

    @staticmethod
    def _step_tuned(tx: StoreTx, study: StudyRecord, problem: Problem) -> TunedConfig | None:
        """The tuned config a step study runs for ``problem``: its stack's (another's newest where it has none);
        of no stack, the newest of any."""
        return ((study.software is not None and tx.tuned_config(problem, study.hardware, study.software))
                or tx.tuned_config(problem, study.hardware))

    def step_configs(self, tx: StoreTx, study: StudyRecord) -> dict[str, OpConfigs]:
        """Each role's tuned configs for a step study: the tuned decomposition of each of its problems.

        A problem without a tuned config runs the baseline; a weight gradient what
        `collective_matmul.lookup.weight_gradient` makes of its tuned config (a tuned ring runs unfused: the
        step trial also times it fused).  A step study of one stack takes that stack's configs (another's
        newest where it has none); of none, the newest of any stack.
        """
        configs = {}
        for role, problems in role_problems(study.step.block, study.step.mesh).items():
            chosen = {}
            for slot, problem in problems.items():
                tuned = self._step_tuned(tx, study, problem)
                found = tuned.decomposition if tuned is not None else None
                chosen[slot] = weight_gradient(found) if slot == "grad_weight" else found or Decomposition.baseline()
            configs[role] = OpConfigs(**chosen)
        return configs

    def step_space(self, tx: StoreTx, study: StudyRecord, winners: dict[str, OpConfigs] | None = None
                   ) -> SearchSpace:
        """What a step study's search chooses from: each role's tuned configs, and per slot the candidates of
        `cmtune.tuner.variants.slot_candidates` (the problem's best ring search trials as runners-up), the
        cost model's whole-step choice beside them."""
        return SearchSpace.of(winners or self.step_configs(tx, study), role_problems(study.step.block, study.step.mesh),
                              study.hardware, measured=lambda problem: tx.best_search_trials(
                                  problem, study.hardware, limit=STEP_CANDIDATES))

    def _step_search(self, tx: StoreTx, study: StudyRecord, rounds: Sequence[TrialRecord], *,
                     winners: dict[str, OpConfigs]) -> StepSearch:
        """The step study's search, rebuilt from its finished ``rounds`` (step trials, in number order); a round's
        wall time runs from the one before it finished (the first's is not counted)."""
        stored, previous = [], None
        for trial in rounds:
            wall = (trial.finished_at - previous).total_seconds() if previous and trial.finished_at else None
            stored.append((trial.variants or {}, trial.step if trial.state == T.COMPLETED else None, wall))
            previous = trial.finished_at
        return replay(self.step_space(tx, study, winners), stored, rounds=study.step.search_rounds,
                      per_round=study.step.round_variants, ablation=study.step.ablation, model=study.step.block.name)

    def _refill_step(self, tx: StoreTx, study: StudyRecord, *, now: dt.datetime) -> list[TrialRecord]:
        """Queue the first step trial once every search study it depends on is final: the search's first
        round (the seeds), or one round of the standard menu."""
        if study.state != S.PENDING or tx.trials(study.id):
            return []
        if any(tx.study(d).state.active for d in study.step.depends_on):
            return []
        configs = self.step_configs(tx, study)
        flat = [getattr(configs[role], slot) for role in ROLES for slot in SLOTS]
        if not study.step.searches:
            return tx.add_trials(study.id, TrialKind.STEP, [flat], now, after=0)
        first = self._step_search(tx, study, (), winners=configs).plan()
        return tx.add_trials(study.id, TrialKind.STEP, [flat], now, after=0, variants=[first.variants])

    def _wake_step_studies(self, tx: StoreTx, hardware: Hardware, *, now: dt.datetime) -> None:
        for waiting in tx.waiting_step_studies(hardware):
            self._refill_step(tx, waiting, now=now)

    def _record_step(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, result, *, now: dt.datetime,
                     lease_id: str | None) -> TrialRecord:
        if not isinstance(result, StepMeasurement):
            raise InvalidError(f"trial {trial.id} is a step trial: send 'step'")
        configs = step_task_configs(trial)
        problems = _check_step_result(study, trial, result, configs)
        if trial.variants is not None:
            done = self._advance_step(tx, study, trial, result, now=now, lease_id=lease_id, problems=problems)
            return dataclasses.replace(trial, **done)
        decision = step_decision(result, configs)  # one round of the menu, graded by the worker
        done = dict(state=T.COMPLETED, status=Status.OK if decision.ok else Status.ERROR, ratio=decision.ratio,
                    step=result, message=decision.summary[:2000], finished_at=now, result_lease_id=lease_id)
        self._move_trial(tx, trial, **done)
        if study.state.active:
            self._conclude_step(tx, study, trial, decision, problems, now=now, stop_reason="measured",
                                software=study.software or result.hardware.software)
        return dataclasses.replace(trial, **done)

    def _advance_step(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, result: StepMeasurement | None,
                      *, now: dt.datetime, lease_id: str | None = None,
                      problems: dict[str, dict[str, Problem]] | None = None) -> dict:
        """A search round's result (None: the round got none, and is failed already): rebuild the search from the
        rounds before it, record it, and queue the next round or the grading; or, when this trial was the
        grading, complete the study with the choice.  Returns the trial's changes (none when it had failed)."""
        earlier = [t for t in tx.trials(study.id, measurements=True)
                   if t.kind == TrialKind.STEP and t.number < trial.number and t.state in (T.COMPLETED, T.FAILED)]
        winners = step_task_configs(trial)
        search = self._step_search(tx, study, earlier, winners=winners)
        problems = problems or role_problems(study.step.block, study.step.mesh)
        grading = search.plan().kind == "grade"
        done: dict = {}
        if grading:
            decision = search.decide(result)
            if result is not None:
                done = dict(state=T.COMPLETED, status=Status.OK if decision.ok else Status.ERROR, ratio=decision.ratio,
                            step=result, message=decision.summary[:2000], finished_at=now, result_lease_id=lease_id)
                self._move_trial(tx, trial, **done)
            if study.state.active:
                self._conclude_step(tx, study, trial, decision, problems, now=now, stop_reason=None,
                                    software=study.software or (result.hardware.software if result else None))
            return done
        previous = earlier[-1].finished_at if earlier else None
        search.record(trial.variants, result, wall_s=(now - previous).total_seconds() if previous else None)
        if result is not None:
            incumbent = search.incumbent
            ratio = next((v.ratio for v in result.variants if v.name == incumbent and v.ok), None)
            done = dict(state=T.COMPLETED, status=Status.OK if search.failure is None else Status.ERROR, ratio=ratio,
                        step=result, message=search.summary()[:2000], finished_at=now, result_lease_id=lease_id)
            self._move_trial(tx, trial, **done)
        if not study.state.active:
            return done
        tx.update_study(study.id, trials_done=len(search.rounds))
        plan = search.plan()
        if plan.kind == "failed":
            self._move_study(tx, study, S.FAILED, finished_at=now, message=plan.reason[:2000])
            return done
        if plan.kind == "grade":
            self._move_study(tx, study, S.CONFIRMING, stop_reason=plan.reason[:200])
        flat = [getattr(winners[role], slot) for role in ROLES for slot in SLOTS]
        tx.add_trials(study.id, TrialKind.STEP, [flat], now, after=trial.number, variants=[plan.variants])
        return done

    def _conclude_step(self, tx: StoreTx, study: StudyRecord, trial: TrialRecord, decision: StepDecision,
                       problems: dict[str, dict[str, Problem]], *, now: dt.datetime, stop_reason: str | None,
                       software: Software | None) -> None:
        """Complete a step study with its decision (its overrides replace the model's, and say which stack,
        ``software``, decided them), or fail it."""
        study = tx.study(study.id, lock=True)
        if not decision.ok:
            self._move_study(tx, study, S.FAILED, finished_at=now, message=decision.summary[:2000])
            return
        model = study.step.block.name
        tx.save_overrides(model, study.hardware, decision.role_overrides(model, study.hardware, problems,
                                                                         software=software))
        tx.update_study(study.id, best_ratio=decision.ratio, best_trial_id=trial.id, trials_done=trial.number)
        record = with_step_bound(decision.record, [self._step_tuned(tx, study, p)
                                                   for slots in problems.values() for p in slots.values()])
        self._move_study(tx, study, S.COMPLETED, finished_at=now, message=decision.summary[:2000],
                         decision=record, **({"stop_reason": stop_reason} if stop_reason else {}))

    # -- internals --------------------------------------------------------------------------

    @staticmethod
    def _progress(study: StudyRecord, trial_id: int, ratio: float | None) -> dict:
        """The study's progress after one more finished search trial: the count and the best so far."""
        best = ratio is not None and (study.best_ratio is None or ratio < study.best_ratio)
        return {"trials_done": study.trials_done + 1,
                **({"best_ratio": ratio, "best_trial_id": trial_id} if best else {})}

    def _finish(self, tx: StoreTx, study_id: int, *, confirmation: list[Measurement] | None, now: dt.datetime,
                note: str | None = None, bounds: BoundsMeasurement | None = None) -> None:
        """Complete a study with its tuned config (and the bounds its confirmation timed, where they are ok), or
        fail it with the reasons; a study the baseline won says why (`collective_matmul.bounds.reason`)."""
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
            self._move_study(tx, study, S.FAILED, finished_at=now,
                             message=("no candidate, not even the baseline, ran successfully: " + reasons)[:2000])
            self._wake_step_studies(tx, study.hardware, now=now)
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
        self._move_study(tx, study, S.COMPLETED, finished_at=now, message=note[:2000] if note else None,
                         **({"stop_reason": outcome["stop_reason"], "trials_done": 1} if outcome else {}))
        self._wake_step_studies(tx, study.hardware, now=now)

    @staticmethod
    def _move_study(tx: StoreTx, study: StudyRecord, to: StudyState, *, strict: bool = True, **changes) -> bool:
        """Move a study along `STUDY_MOVES` from the state ``study`` was read in; whether it moved (another
        transaction may have moved it since: `ConflictError` if ``strict``)."""
        check_study_move(study.id, study.state, to)
        moved = tx.apply_study_move(study.id, to, expected=study.state, **changes)
        if strict and not moved:
            raise ConflictError(f"study {study.id} is no longer {study.state}; it cannot become {to}: try again")
        return moved

    @staticmethod
    def _move_trial(tx: StoreTx, trial: TrialRecord, to: TrialState | None = None, *, strict: bool = True,
                    study_changes: dict | None = None, **changes) -> bool:
        """Move a trial along `TRIAL_MOVES` from the state ``trial`` was read in; ``study_changes`` update its
        study in the same write.  Whether it moved (another transaction may have claimed it since:
        `ConflictError` if ``strict``)."""
        to = changes.pop("state", to)
        check_trial_move(trial.id, trial.state, to)
        moved = tx.apply_trial_move(trial.id, to, expected=trial.state, study_id=trial.study_id,
                                    study_changes=study_changes, **changes)
        if strict and not moved:
            raise ConflictError(f"trial {trial.id} is no longer {trial.state}; it cannot become {to}: try again")
        return moved


def with_step_bound(record: StepChoice | None, tuned: Sequence[TunedConfig | None]) -> StepChoice | None:
    """``record`` with the step's own bound (`collective_matmul.bounds.step_bound`): ``tuned`` holds the tuned
    config of each collective matmul one layer of the step runs (None: not tuned, left out), against the graded
    rounds' all-baseline and chosen steps; unchanged where those rounds did not time the all-baseline step."""
    if record is None or record.saved_s is None or record.time_s is None:
        return record
    entries = [(1, config) for config in tuned if config is not None]
    if not entries:
        return record
    return record.model_copy(update={"bound": step_bound(entries, record.time_s + record.saved_s, record.time_s)})


def _reconfirmed(study: StudyRecord, config: TunedConfig) -> tuple[TunedConfig, dict]:
    """A re-confirmation's config (the round's times on the new stack, the search's evidence of the stored
    config) and its outcome: stop reason ``re-confirmed`` or ``replaced``, and a message saying which."""
    stored = study.reconfirm.config
    config = config.model_copy(update={"trials": stored.trials, "invalid": stored.invalid, "failed": stored.failed,
                                       "space_size": stored.space_size})
    if config.decomposition == stored.decomposition:
        message = (f"re-confirmed on {study.software}: {config.decomposition.id} still wins ({config.speedup:.2f}x; "
                   f"{stored.speedup:.2f}x on {stored.software})")
        return config, {"stop_reason": "re-confirmed", "message": message}
    message = (f"replaced on {study.software}: {config.decomposition.id} ({config.speedup:.2f}x) beat the stored "
               f"{stored.decomposition.id} ({stored.speedup:.2f}x on {stored.software})")
    return config, {"stop_reason": "replaced", "message": message}


def check_study_move(study_id: int, state: StudyState, to: StudyState) -> None:
    """`ConflictError` unless `STUDY_MOVES` lets a study in ``state`` become ``to``."""
    if to not in STUDY_MOVES.get(state, ()):
        raise ConflictError(f"study {study_id} is {state}; it cannot become {to}")


def check_trial_move(trial_id: int | None, state: TrialState, to: TrialState) -> None:
    """`ConflictError` unless `TRIAL_MOVES` lets a trial in ``state`` become ``to`` (``trial_id`` None: the
    move of a claim, whichever trial it takes)."""
    if to not in TRIAL_MOVES.get(state, ()):
        raise ConflictError(f"trial {'' if trial_id is None else f'{trial_id} '}is {state}; it cannot become {to}")


@functools.lru_cache(maxsize=1024)
def _searcher(problem: Problem, profile: str, settings: SearchSettings) -> Searcher:
    """Searchers of the studies in progress: a searcher is a pure function of these three (its space
    and cost-model order are computed once per study, not once per ask)."""
    return Searcher(problem, profile, settings)


def step_task_configs(trial: TrialRecord) -> dict[str, OpConfigs]:
    """A step trial's per-role tuned configs (stored flat: role by role, forward, grad_input, grad_weight)."""
    flat = list(trial.decompositions)
    return {role: OpConfigs(**dict(zip(SLOTS, flat[i * 3:(i + 1) * 3], strict=True))) for i, role in enumerate(ROLES)}


def _check_step_result(study: StudyRecord, trial: TrialRecord, result: StepMeasurement,
                       configs: dict[str, OpConfigs]) -> dict[str, dict[str, Problem]]:
    """A step result decides what a model runs: it must measure this study's block, only the variants
    the trial asked for (a search round's own, or the standard menu of ``configs``) with the configs it
    gave them, each config fitting its role's problem.  Its ratios were checked against its samples
    where it was parsed (`StepMeasurement`).

    Returns:
        the block's problems by role and slot.

    Raises:
        InvalidError: naming the first thing that does not hold.
    """
    if result.block is None or result.block.name != study.step.block.name:
        raise InvalidError(f"trial {trial.id} measures the block {study.step.block.name!r}: send its 'block'")
    problems = role_problems(study.step.block, study.step.mesh)
    asked = trial.variants if trial.variants is not None else variant_configs(configs, ablation=study.step.ablation)
    if trial.variants is not None and result.confirmation:
        raise InvalidError(f"trial {trial.id} is a round of the step search: it asks for no confirmation (the "
                           "grading is a trial of its own); leave 'confirmation' empty")
    measured = {v.name for v in result.variants}
    for variant in [*result.variants, *result.confirmation]:
        for role, role_configs in variant.configs.items():
            if role not in problems:
                raise InvalidError(f"trial {trial.id}: variant {variant.name} has configs for {role!r}, which is "
                                   f"not a role of the block ({', '.join(problems)})")
            for slot in SLOTS:
                try:
                    problems[role][slot].check(getattr(role_configs, slot))
                except ValueError as exc:
                    raise InvalidError(f"trial {trial.id}: variant {variant.name}, {role} {slot}: {exc}") from None
        if variant.name not in asked:
            raise InvalidError(f"trial {trial.id} asked for the variants {', '.join(asked)}: "
                               f"{variant.name!r} is not one of them")
        if variant.configs != (asked[variant.name] or {}):
            raise InvalidError(f"trial {trial.id}: variant {variant.name} measured other configs than the trial "
                               "gave it")
        if variant.name not in measured:
            raise InvalidError(f"trial {trial.id}: the confirmation re-times {variant.name}, which the rounds "
                               "did not measure")
    return problems


def task_for(study: StudyRecord, trial: TrialRecord) -> TrialTask:
    """What a worker runs for ``trial``: a confirmation round re-times with `confirm_repeats` runs."""
    if trial.kind == TrialKind.STEP:
        spec = study.step
        return TrialTask(id=trial.id, study_id=study.id, kind=trial.kind, problem=None, decomposition=None,
                         decompositions=list(trial.decompositions), protocol=study.protocol,
                         step=StepTask(block=spec.block, mesh=spec.mesh.axes, tensor_axis=spec.mesh.tensor_axis,
                                       configs=step_task_configs(trial), ablation=spec.ablation,
                                       variants=trial.variants))
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
        stack = m.hardware.software
        if study.software is not None and stack is not None and stack.key != study.software.key:
            raise InvalidError(f"trial {trial.id} runs on {study.software}, the result was measured on {stack}")
