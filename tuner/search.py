"""Search over decompositions: which candidate to time next, when to stop, who wins.

`Searcher.ask` is a pure function of a study's recorded history (finished and in-flight
trials), so the study engine (`cmtune.tuner.engine`) rebuilds it from its store for every ask,
in `cmtune tune` and in any replica of the service alike.

Order of asks:
1. the baseline (every study measures it; it wins if nothing beats it);
2. the seeds (warm start, ``SearchSettings.seeds``; `cmtune.tuner.warm`): the winners and best
   rings of the nearest problems tuned on the same hardware, nearest first;
3. small spaces (``enumerate_below``) are enumerated in cost-model order;
4. larger ones: the ``startup`` cost-model favourites, then Optuna's TPE (multivariate, constant
   liar for parallel asks) over the factorised space; a TPE proposal that repeats a finished or
   in-flight candidate is told the known value (or skipped) and asked again, up to
   `MAX_REPEATS` times, then the cost model's next choice is taken, so no candidate is ever
   timed twice.  The seeds are not taken from the ``startup``: a seeded study asks what the
   unseeded one would, with the seeds already known (TPE is told them like any finished trial).
With a compile screen (``SearchSettings.screen``: each candidate's compiled schedule on the study's
hardware, taken on a GPU node before its search), steps 3 and 4 take the forms whose permutes all
hide behind a product first, then partly overlapped ones, then serialised ones: a TPE proposal of a
later form waits while a better-screened one is unmeasured.
At the end, the top ``confirm_top`` candidates and the baseline are re-timed together with more
runs; the winner of that round is the tuned config.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import statistics
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict, Field

from collective_matmul.planning.costmodel import PROFILES, HardwareProfile, rank
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Hardware, Problem
from collective_matmul.planning.space import candidates
from collective_matmul.wire import Measurement, Sampler, Screened, Seed, StopReason, TunedConfig

MAX_REPEATS = 8  # TPE proposals of already-seen candidates before the cost model's next choice is taken

optuna.logging.set_verbosity(optuna.logging.WARNING)


def default_budget(space_size: int) -> int:
    """The trial budget when none is given: a quarter of the space, at least 4 trials."""
    return max(4, -(-space_size // 4))


class SearchSettings(BaseModel):
    """How a study searches and when it stops."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sampler: Sampler = "auto"
    seed: int = 0
    max_trials: int | None = Field(default=None, ge=1, description="finished trials, baseline included")
    max_seconds: float | None = Field(default=None, gt=0)
    patience: int | None = Field(default=None, ge=1, description="stop after this many trials without a new best")
    enumerate_below: int = Field(default=12, ge=0)
    startup: int = Field(default=8, ge=0, description="trials before TPE models the space")
    seed_with_model: bool = Field(default=True, description="startup trials are the cost model's favourites "
                                  "(False: TPE's own random startup, as plain Optuna does)")
    confirm_top: int = Field(default=3, ge=0)
    confirm_repeats: int = Field(default=15, ge=1)
    profile: str | None = Field(default=None, description="cost-model profile that orders the candidates "
                                "(a name in collective_matmul.planning.costmodel.PROFILES); None: by platform")
    seeds: tuple[Seed, ...] = Field(default=(), max_length=64, description="timed right after the baseline, in "
                                    "order (warm start: cmtune.tuner.warm.seeds)")
    warm_agreement: float = Field(default=0.1, gt=0, allow_inf_nan=False, description="a ring seed agrees with its "
                                  "neighbour when its ratio is within this fraction of the neighbour's")
    warm_patience: int | None = Field(default=1, ge=0, description="once a seed agreed, stop after this many "
                                      "further trials without a new best (None: seeds only reorder the search)")
    screen: tuple[Screened, ...] = Field(default=(), max_length=1024, description="each candidate's compiled "
                                         "schedule on this hardware (cmtune.workers.aot.screen): the forms that "
                                         "overlap are proposed before the others")


@dataclass(frozen=True)
class Finished:
    """One finished trial as the searcher sees it: ratio to baseline, or None if it failed."""

    config: Decomposition
    ratio: float | None


def _ring(config: Decomposition) -> str:
    """Direction and unroll as one categorical value: their valid combinations differ by direction,
    and one flat parameter keeps TPE to a single joint (multivariate) model without conditionals."""
    return f"{config.direction}/{config.unroll}"


def _space_distributions(space: Sequence[Decomposition]) -> dict[str, CategoricalDistribution]:
    """The ring part of the space, factorised into three categorical parameters."""
    rings = [c for c in space if c.method == "ring"]
    values = {"ring": [_ring(c) for c in rings], "chunks": [c.chunks for c in rings],
              "accumulate": [c.accumulate for c in rings]}
    return {name: CategoricalDistribution(list(dict.fromkeys(v))) for name, v in values.items()}


def _params(config: Decomposition) -> dict:
    return {"ring": _ring(config), "chunks": config.chunks, "accumulate": config.accumulate}


class _Template(FrozenTrial):
    """A trial of a study's history as `Searcher._trial` builds it, once.  Optuna's in-memory storage
    deep-copies each trial it is given; nothing changes a template or a stored trial that is not
    asked (the finished ones, and the running ones standing for trials in flight), so a shallow copy
    is the same study for a quarter less of an ask's time."""

    def __deepcopy__(self, memo):
        return copy.copy(self)


class _TPE(optuna.samplers.TPESampler):
    """Optuna's TPE (multivariate, constant liar) for one searcher: built once, reseeded for every ask.

    Seeding a new sampler builds two NumPy random states (~0.2 ms each, as much as TPE's own
    sampling in a small study); reseeding them gives the same streams in microseconds.  TPE's
    relative search space is the intersection of the parameters of the finished trials; every
    trial a searcher adds or asks has all of the space's parameters, so that intersection is the
    whole space (by name, single-valued ones left out) once one has finished, and empty before:
    what Optuna computes, without walking the trials for it.
    """

    def __init__(self, space: dict[str, BaseDistribution], startup: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            super().__init__(seed=0, multivariate=True, constant_liar=True, n_startup_trials=startup)
        self._known_space = {name: d for name, d in sorted(space.items()) if not d.single()}

    def reseed(self, seed: int) -> None:
        self._rng.rng.seed(seed)
        self._random_sampler._rng.rng.seed(seed)

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        return dict(self._known_space) if finished else {}


class _Random(optuna.samplers.RandomSampler):
    """Optuna's random sampler, built once and reseeded for every ask (see `_TPE`)."""

    def reseed(self, seed: int) -> None:
        self._rng.rng.seed(seed)


class Searcher:
    """Proposes the next candidate of one study from its history."""

    def __init__(self, problem: Problem, profile: HardwareProfile | str, settings: SearchSettings = SearchSettings(),
                 platform: str | None = None):
        self.problem = problem
        self.settings = settings
        self.space = candidates(problem, platform=platform)  # XLA's own (method "xla") where the platform has it
        self.screen = {s.decomposition: s for s in settings.screen}
        by_model = rank(problem, self.space, PROFILES[profile] if isinstance(profile, str) else profile)
        self.by_model = sorted(by_model, key=self.screen_rank)  # stable: the cost model's order within a verdict
        self._dists = _space_distributions(self.space)
        self._valid = set(self.space)
        self.seeds = [c for c in dict.fromkeys(s.decomposition for s in settings.seeds)
                      if c.method == "ring" and c in self._valid]  # the baseline goes first anyway
        self._templates: dict[tuple, FrozenTrial] = {}  # `_trial`'s answers: each ask rebuilds a study from them
        self._samplers: dict[str, _TPE | _Random] = {}
        self._sampler_lock = threading.Lock()

    @property
    def sampler(self) -> Sampler:
        if self.settings.sampler != "auto":
            return self.settings.sampler
        return "enumerate" if len(self.space) <= self.settings.enumerate_below else "tpe"

    def exhausted(self, finished: Sequence[Finished], pending: Sequence[Decomposition] = ()) -> bool:
        """True when every candidate is finished or in flight (cheap: no Optuna)."""
        return len({f.config for f in finished} | set(pending)) >= len(self.space)

    def ask(self, finished: Sequence[Finished], pending: Sequence[Decomposition] = ()) -> Decomposition | None:
        """The next candidate to time, or None when every candidate is finished or in flight."""
        seen = {f.config for f in finished} | set(pending)
        unmeasured = [c for c in self.by_model if c not in seen]
        if not unmeasured:
            return None
        baseline = Decomposition.baseline()
        if baseline not in seen:
            return baseline
        if Decomposition.xla() in self._valid and Decomposition.xla() not in seen:
            return Decomposition.xla()  # what XLA would do itself: a ring must beat that, not just the baseline
        seed = next((c for c in self.seeds if c not in seen), None)
        if seed is not None:
            return seed
        sampler = self.sampler
        startup = 1 + (Decomposition.xla() in self._valid) + len(self.seeds) + self.settings.startup
        seeding = sampler == "tpe" and self.settings.seed_with_model and len(seen) < startup
        if sampler == "enumerate" or seeding:
            return unmeasured[0]
        proposal = self._ask_optuna(sampler, finished, pending, seen)
        if proposal is None or self.screen_rank(proposal) > self.screen_rank(unmeasured[0]):
            return unmeasured[0]  # a form the screen puts after one still unmeasured waits for it
        return proposal

    def screen_rank(self, config: Decomposition) -> int:
        """Where the compile screen puts ``config`` (`Screened.rank`); a candidate it has no verdict for sits
        with those that have no permutes."""
        screened = self.screen.get(config)
        return screened.rank if screened is not None else 1

    def _ask_optuna(self, sampler, finished, pending, seen) -> Decomposition | None:
        with self._sampler_lock:  # one sampler per searcher, and a searcher is shared by studies of one problem
            optuna_sampler = self._samplers.get(sampler)
            if optuna_sampler is None:
                optuna_sampler = self._samplers[sampler] = (
                    _Random() if sampler == "random" else _TPE(self._dists, self.settings.startup))
            optuna_sampler.reseed(self._seed(finished, pending))
            return self._ask_study(optuna_sampler, finished, pending, seen)

    def _seed(self, finished: Sequence[Finished], pending: Sequence[Decomposition]) -> int:
        """An ask's seed: a function of the settings and the history's size, so any process answers alike."""
        digest = hashlib.sha256(f"{self.settings.seed}:{len(finished)}:{len(pending)}".encode()).digest()
        return int.from_bytes(digest[:4], "little")

    def _ask_study(self, optuna_sampler, finished, pending, seen) -> Decomposition | None:
        study = optuna.create_study(direction="minimize", sampler=optuna_sampler)
        known: dict[Decomposition, float | None] = {}
        for f in finished:
            if f.config.method != "ring":
                continue
            known[f.config] = f.ratio
            study.add_trial(self._trial(f.config, f.ratio))
        for config in pending:
            if config.method == "ring":
                study.add_trial(self._trial(config, None, TrialState.RUNNING))
        for _ in range(MAX_REPEATS):
            trial = study.ask()
            config = self._suggest(trial)
            if config not in seen and config in self._valid:
                return config
            if config in known and known[config] is not None:
                study.tell(trial, known[config])  # teach it, then ask again
            else:
                study.tell(trial, state=TrialState.FAIL)
        return None

    def _trial(self, config: Decomposition, ratio: float | None, state: TrialState | None = None) -> FrozenTrial:
        """The Optuna trial of a finished (or, with ``state``, running) candidate; Optuna copies it when it is
        added to a study, so one is built once per (candidate, ratio, state) and reused by every ask."""
        key = (config, ratio, state)
        template = self._templates.get(key)
        if template is None:
            params = _params(config)
            dists = {name: self._dists[name] for name in params}
            if state is None:
                state = TrialState.COMPLETE if ratio is not None else TrialState.FAIL
            now = datetime.datetime.now()
            template = _Template(number=-1, trial_id=-1, state=state, values=None,
                                 value=ratio if state == TrialState.COMPLETE else None, datetime_start=now,
                                 datetime_complete=now if state.is_finished() else None, params=params,
                                 distributions=dists, user_attrs={}, system_attrs={}, intermediate_values={})
            if len(self._templates) >= 4 * len(self.space):  # bounded: a candidate is re-measured only rarely
                self._templates.clear()
            self._templates[key] = template
        return template

    def _suggest(self, trial: optuna.Trial) -> Decomposition:
        d = self._dists
        direction, unroll = trial.suggest_categorical("ring", d["ring"].choices).split("/")
        try:
            return Decomposition(
                direction=direction, unroll=unroll if unroll == "full" else int(unroll),
                chunks=trial.suggest_categorical("chunks", d["chunks"].choices),
                accumulate=trial.suggest_categorical("accumulate", d["accumulate"].choices),
            )
        except ValueError:  # a combination outside the space: told as failed, asked again
            return Decomposition.baseline()

    def confirm_set(self, finished: Sequence[Finished]) -> list[Decomposition]:
        """The top candidates (by ratio) plus the baseline, for the confirmation round."""
        ok = sorted((f for f in finished if f.ratio is not None and f.config.method in ("ring", "xla")),
                    key=lambda f: f.ratio)
        top = [f.config for f in ok[: self.settings.confirm_top]]
        return [Decomposition.baseline(), *top]


def stop_reason(
    settings: SearchSettings, finished: Sequence[Finished], *, elapsed_s: float, exhausted: bool, in_flight: int = 0
) -> StopReason | None:
    """Why a study should ask for no more candidates, or None to go on.

    Trials in flight count against the trial budget: they will finish.  A seeded study also stops when
    its neighbours agree (`neighbours_agree`).
    """
    if exhausted:
        return StopReason.EXHAUSTED
    if settings.max_trials is not None and len(finished) + in_flight >= settings.max_trials:
        return StopReason.TRIAL_BUDGET
    if settings.max_seconds is not None and elapsed_s >= settings.max_seconds:
        return StopReason.TIME_BUDGET
    if settings.patience is not None:
        best, since = float("inf"), 0
        for f in finished:
            if f.ratio is not None and f.ratio < best:
                best, since = f.ratio, 0
            else:
                since += 1
        if since >= settings.patience:
            return StopReason.NO_IMPROVEMENT
    if neighbours_agree(settings, finished):
        return StopReason.NEIGHBOURS_AGREE
    return None


def neighbours_agree(settings: SearchSettings, finished: Sequence[Finished]) -> bool:
    """Whether a seeded study has learnt what its neighbours predicted, and may stop before its budget.

    1. A ring seed *agrees* when its ratio here is within ``warm_agreement`` (relative) of the ratio its
       neighbour measured: this problem ranks the neighbour's best candidates as the neighbour did, and the
       neighbour's own search already covered the space around them.
    2. From the first agreeing seed on, the study stops after ``warm_patience`` further trials (the other
       seeds, then the cost model's next choices) without a new best; a new best starts the count again.

    Where the neighbours do not predict (no seed agrees: their rings run otherwise here, or fail) this
    never fires and the study spends the budget an unseeded one would, its seeds in place of its last
    trials: seeding saves trials only where it has been shown to predict, and costs none elsewhere.  The
    baseline (the winner on many a machine) carries no information here: its ratio is 1 on every problem.
    Finished trials are read in trial order, so every process and replica decides alike.
    """
    if settings.warm_patience is None:
        return False
    expected: dict[Decomposition, float] = {}  # a seed's ratio on its neighbour (the nearest, if two propose it)
    for seed in settings.seeds:
        if seed.decomposition.method == "ring":
            expected.setdefault(seed.decomposition, seed.ratio)
    best, since, agreed = float("inf"), 0, False
    for f in finished:
        improved = f.ratio is not None and f.ratio < best
        if improved:
            best = f.ratio
        if agreed:
            since = 0 if improved else since + 1
        elif f.ratio is not None and f.config in expected:
            agreed = abs(f.ratio / expected[f.config] - 1) <= settings.warm_agreement
    return agreed and since >= settings.warm_patience


def failure_counts(statuses: Iterable[str | None]) -> tuple[int, int]:
    """(invalid, failed) among finished trials' statuses; None (no result yet) counts as neither."""
    statuses = list(statuses)
    invalid = sum(s == "invalid" for s in statuses)
    return invalid, sum(s not in (None, "ok", "invalid") for s in statuses)


def effective_ratio(m: Measurement) -> float:
    """A candidate's ratio to the baseline; the baseline's own is 1 by definition (its measured
    ratio to itself is only the noise floor)."""
    return 1.0 if m.decomposition.method == "baseline" else m.ratio


def pick_winner(measurements: Sequence[Measurement]) -> Measurement | None:
    """The confirmation round's winner: lowest ratio; a candidate must beat 1.0 to displace the baseline."""
    ok = sorted((m for m in measurements if m.ok), key=lambda m: m.decomposition.method != "baseline")
    return min(ok, key=effective_ratio) if ok else None


def tuned_config(problem: Problem, winner: Measurement, *, trials: int, invalid: int, failed: int,
                 space_size: int) -> TunedConfig:
    """The stored record of a study's winner (a baseline winner has speedup 1 and no saving)."""
    if winner.decomposition.method == "baseline":
        time_s = baseline_s = statistics.median(winner.candidate.samples_s + winner.baseline.samples_s)
        speedup = 1.0
    else:
        time_s, baseline_s, speedup = winner.candidate.median_s, winner.baseline.median_s, winner.speedup
    return TunedConfig(
        problem=problem, hardware=winner.hardware.identity(), decomposition=winner.decomposition,
        time_s=time_s, baseline_s=baseline_s, speedup=speedup,
        speedup_iqr=winner.speedup_iqr, trials=trials, invalid=invalid, failed=failed,
        space_size=space_size, overlap=winner.overlap, memory_bytes=winner.memory_bytes,
        **_stack_of(winner.hardware),
    )


def _stack_of(hardware: Hardware) -> dict:
    """A tuned config's software fields from the hardware of its measurement: its stack, or (a record without
    one) its versions."""
    if hardware.software is not None:
        return {"software": hardware.software}
    return {"jax_version": hardware.jax_version, "jaxlib_version": hardware.jaxlib_version}


