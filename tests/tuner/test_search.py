"""Search logic over a runner with known costs: the engine's search, stop rules and confirmation.

The runner is a test double (the search layer alone is under test); tests/tuner/test_engine.py
runs the same engine over every store, and test_cli.py over real devices.
"""

from __future__ import annotations

import datetime as dt
import random

import pytest

from cmtune.tuner.search import Finished, Searcher, SearchSettings, stop_reason
from cmtune.workers.local import LocalTuner
from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.planning.costmodel import PROFILES
from collective_matmul.planning.space import candidates
from collective_matmul.wire import Measurement, MeasurementProtocol, Timing, result_of

PROBLEM = Problem.parse("ag:1024x256x1024:float32:8")  # 49 candidates
HW = Hardware(platform="cpu", device_kind="cpu", device_count=8)
PROFILE = PROFILES["cpu"]


def tune(problem, runner, settings, clock=None):
    """One study to its end with the engine over the in-memory store."""
    tuner = LocalTuner(runner, clock=clock or (lambda: dt.datetime.now(dt.UTC)))
    return tuner.tune(problem, HW, settings.model_copy(update={"profile": "cpu"}), MeasurementProtocol(repeats=3))


def record(problem, config, ratio, status="ok"):
    if status != "ok":
        return Measurement(problem=problem, decomposition=config, hardware=HW, status=status, message="boom")
    base = 1e-3
    return Measurement(
        problem=problem, decomposition=config, hardware=HW, status="ok",
        candidate=Timing.of([base * ratio] * 3), baseline=Timing.of([base] * 3), ratio=ratio, ratio_iqr=0.0,
    )


class KnownCosts:
    """Returns a fixed ratio per candidate; optionally a lucky first sample for some."""

    def __init__(self, costs, lucky=None, failing=()):
        self.costs, self.lucky, self.failing = costs, dict(lucky or {}), set(failing)
        self.calls: list[tuple[Decomposition, int]] = []

    def run(self, task):
        problem, protocol = task.problem, task.protocol
        out = []
        for config in task.decompositions:
            self.calls.append((config, protocol.repeats))
            if config in self.failing:
                out.append(record(problem, config, None, status="compile_error"))
                continue
            ratio = self.lucky.pop(config, None) or self.costs[config]
            out.append(record(problem, config, ratio))
        return result_of(task.kind, out)


def random_costs(problem, seed):
    rng = random.Random(seed)
    costs = {c: rng.uniform(0.7, 1.5) for c in candidates(problem)}
    costs[Decomposition.baseline()] = 1.0
    return costs


@pytest.mark.parametrize("sampler", ["tpe", "random", "enumerate"])
def test_full_budget_finds_the_optimum_and_never_repeats(sampler):
    costs = random_costs(PROBLEM, 1)
    runner = KnownCosts(costs)
    result = tune(PROBLEM, runner, SearchSettings(sampler=sampler, seed=3))
    timed = [t.decomposition for t in result.search]
    assert len(timed) == len(set(timed)) == 49
    assert result.study.stop_reason == "exhausted"
    assert result.tuned.decomposition == min(costs, key=costs.get)
    assert timed[0] == Decomposition.baseline()


def test_tpe_beats_random_order_on_structured_costs():
    """Costs that depend smoothly on the fields: TPE should get near the best in a quarter of the space."""
    def cost(c):
        if c.method == "baseline":
            return 1.0
        return (0.8 + 0.05 * abs(c.chunks - 4) / 2 + (0.1 if c.direction == "unidirectional" else 0)
                + (0.04 if c.unroll == "full" else 0) + (0.03 if c.accumulate == "concat" else 0))
    costs = {c: cost(c) for c in candidates(PROBLEM)}
    best = min(costs.values())
    for seed in range(3):
        settings = SearchSettings(sampler="tpe", seed=seed, max_trials=13, startup=4)
        result = tune(PROBLEM, KnownCosts(costs), settings)
        assert 1 / result.tuned.speedup <= best * 1.03


def test_stop_rules():
    costs = random_costs(PROBLEM, 2)
    result = tune(PROBLEM, KnownCosts(costs), SearchSettings(max_trials=7))
    assert (len(result.search), result.study.stop_reason) == (7, "trial budget")

    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    ticks = iter(range(10_000))
    result = tune(PROBLEM, KnownCosts(costs), SearchSettings(max_seconds=5),
                  clock=lambda: start + dt.timedelta(seconds=next(ticks)))
    assert result.study.stop_reason == "time budget"
    assert 1 < len(result.search) < 10  # the clock advances a second per engine call

    flat = {c: 1.0 for c in candidates(PROBLEM)}
    result = tune(PROBLEM, KnownCosts(flat), SearchSettings(patience=5))
    assert (len(result.search), result.study.stop_reason) == (6, "no improvement")

    small = Problem.parse("ag:64x8x8:float32:4")
    result = tune(small, KnownCosts(random_costs(small, 3)), SearchSettings())
    assert result.study.stop_reason == "exhausted"
    assert len(result.search) == len(candidates(small))


def test_stop_reason_unit():
    finished = [Finished(Decomposition.baseline(), 1.0)] + [Finished(Decomposition(chunks=2), 1.2)] * 3
    s = SearchSettings(patience=3)
    assert stop_reason(s, finished, elapsed_s=0, exhausted=False) == "no improvement"
    assert stop_reason(SearchSettings(), finished, elapsed_s=0, exhausted=True) == "exhausted"
    assert stop_reason(SearchSettings(max_trials=5), finished, elapsed_s=0, exhausted=False) is None


def test_confirmation_round_overturns_a_lucky_sample():
    costs = {c: 1.1 for c in candidates(PROBLEM)}
    costs[Decomposition.baseline()] = 1.0
    lucky = Decomposition(direction="bidirectional", chunks=2, unroll=1, accumulate="concat")
    truly_best = Decomposition(direction="unidirectional", chunks=4, unroll="full", accumulate="update_slice")
    costs[lucky], costs[truly_best] = 0.9, 0.8
    runner = KnownCosts(costs, lucky={lucky: 0.5})
    result = tune(PROBLEM, runner, SearchSettings(sampler="enumerate", confirm_repeats=21))
    first_round_best = min(result.search, key=lambda t: t.ratio)
    assert first_round_best.decomposition == lucky
    assert result.tuned.decomposition == truly_best
    confirmed = [c for c, repeats in runner.calls if repeats == 21]
    assert confirmed[0] == Decomposition.baseline() and lucky in confirmed and truly_best in confirmed


def test_baseline_wins_when_nothing_beats_it():
    costs = {c: 1.3 for c in candidates(PROBLEM)}
    costs[Decomposition.baseline()] = 1.0
    result = tune(PROBLEM, KnownCosts(costs), SearchSettings(max_trials=10))
    assert result.tuned.decomposition == Decomposition.baseline()
    assert result.tuned.speedup == 1.0


def test_failures_are_recorded_and_the_study_goes_on():
    costs = random_costs(PROBLEM, 4)
    failing = [c for c in candidates(PROBLEM) if c.chunks == 8]
    result = tune(PROBLEM, KnownCosts(costs, failing=failing), SearchSettings(sampler="enumerate"))
    assert len(result.search) == 49
    assert result.tuned.failed == len(failing)
    assert result.tuned.decomposition not in failing


def test_deterministic_given_a_seed():
    costs = random_costs(PROBLEM, 5)

    def sequence(seed):
        result = tune(PROBLEM, KnownCosts(costs), SearchSettings(seed=seed, max_trials=15))
        return [t.decomposition.id for t in result.search]

    assert sequence(1) == sequence(1)
    assert sequence(1) != sequence(2)


def test_an_answer_depends_only_on_the_history():
    """A searcher reuses the Optuna trials it built for earlier asks (shallow copies of them): its
    answer to a history is still the one a fresh searcher gives."""
    settings = SearchSettings(sampler="tpe", seed=3, startup=2)
    costs = random_costs(PROBLEM, 7)
    warm = Searcher(PROBLEM, PROFILE, settings)
    in_flight = warm.by_model[20:22]
    histories = [[Finished(c, costs[c] if i % 4 else None) for i, c in enumerate(warm.by_model[:n])]
                 for n in range(3, 16)]
    for finished in histories:
        warm.ask(finished, in_flight)
    answers = [warm.ask(finished, in_flight) for finished in histories]
    assert answers == [Searcher(PROBLEM, PROFILE, settings).ask(finished, in_flight) for finished in histories]
    assert len(set(answers)) > 3


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_the_kept_sampler_answers_as_a_new_optuna_sampler_would(sampler):
    """A searcher keeps one Optuna sampler, reseeds it for every ask and gives TPE the known search
    space: its answers are those of a new Optuna sampler, seeded alike, that infers the space itself."""
    import optuna
    from optuna.search_space import IntersectionSearchSpace

    settings = SearchSettings(sampler=sampler, seed=5, startup=3)
    costs = random_costs(PROBLEM, 11)
    rng = random.Random(2)
    searcher = Searcher(PROBLEM, PROFILE, settings)
    cases = []
    for n in range(1, 24):
        finished = [Finished(c, costs[c] if rng.random() > 0.2 else None) for c in searcher.by_model[:n]]
        pending = searcher.by_model[n:n + rng.randrange(3)]
        cases.append((finished, pending, {f.config for f in finished} | set(pending)))
    answers = [searcher._ask_optuna(sampler, *case) for case in cases]
    kept = searcher._samplers[sampler]
    spaces = []

    class New(optuna.samplers.TPESampler):
        def infer_relative_search_space(self, study, trial):
            inferred = super().infer_relative_search_space(study, trial)
            spaces.append((kept.infer_relative_search_space(study, trial), inferred,
                           {k: d for k, d in IntersectionSearchSpace(include_pruned=True).calculate(study).items()
                            if not d.single()}))
            return inferred

    def new(seed):
        if sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        return New(seed=seed, multivariate=True, constant_liar=True, n_startup_trials=settings.startup)

    fresh = Searcher(PROBLEM, PROFILE, settings)
    assert answers == [fresh._ask_study(new(fresh._seed(f, p)), f, p, seen) for f, p, seen in cases]
    assert len(set(answers)) > 5
    if sampler == "tpe":  # the same spaces, in the same order
        assert all(list(ours.items()) == list(theirs.items()) == list(full.items()) for ours, theirs, full in spaces)
        assert any(ours for ours, _, _ in spaces) and any(not ours for ours, _, _ in spaces)


def test_parallel_asks_have_no_duplicates():
    searcher = Searcher(PROBLEM, PROFILE, SearchSettings(sampler="tpe", seed=0, startup=2))
    costs = random_costs(PROBLEM, 6)
    finished = [Finished(c, costs[c]) for c in [Decomposition.baseline(), *searcher.by_model[1:4]]]
    pending: list[Decomposition] = []
    for _ in range(20):
        config = searcher.ask(finished, pending)
        assert config not in pending and config not in {f.config for f in finished}
        pending.append(config)


def test_small_spaces_are_enumerated_in_cost_model_order():
    small = Problem.parse("ag:64x8x8:float32:4")
    searcher = Searcher(small, PROFILE, SearchSettings(enumerate_below=100))
    assert searcher.sampler == "enumerate"
    asked = []
    for _ in range(5):
        asked.append(searcher.ask([Finished(c, 1.0) for c in asked]))
    assert asked[0] == Decomposition.baseline()
    assert asked[1:] == [c for c in searcher.by_model if c.method == "ring"][:4]


def test_measurements_serialise():
    m = record(PROBLEM, Decomposition(chunks=2), 0.9)
    assert Measurement.model_validate_json(m.model_dump_json()) == m
    assert m.speedup == pytest.approx(1 / 0.9)
    failed = record(PROBLEM, Decomposition(), None, status="oom")
    assert Measurement.model_validate_json(failed.model_dump_json()).status == "oom"
    assert MeasurementProtocol.model_validate_json(MeasurementProtocol(repeats=3).model_dump_json()).repeats == 3


def test_on_a_platform_with_a_windowed_einsum_xlas_own_is_timed_after_the_baseline_and_can_win():
    """On TPU (and GPU) the space holds method='xla' (the product as written, XLA decomposing it itself): the search
    times it right after the baseline, and it competes in the confirmation like a ring; on CPU it is not there."""
    from collective_matmul import Decomposition, Problem

    problem = Problem.parse("ag:1024x256x1024:bfloat16:8")
    tpu = Searcher(problem, "tpu-v5p", SearchSettings(), platform="tpu")
    first = tpu.ask([])
    assert first == Decomposition.baseline()
    second = tpu.ask([Finished(first, 1.0)])
    assert second == Decomposition.xla()
    ring = tpu.ask([Finished(first, 1.0), Finished(second, 0.8)])
    assert ring.method == "ring"
    confirm = tpu.confirm_set([Finished(first, 1.0), Finished(second, 0.8), Finished(ring, 0.9)])
    assert confirm[:2] == [Decomposition.baseline(), Decomposition.xla()]
    assert Decomposition.xla() not in Searcher(problem, "cpu", SearchSettings(), platform="cpu").space


def screen_of(problem, verdict_of):
    from collective_matmul.wire import Screened

    return tuple(Screened(decomposition=c, overlap=verdict_of(c)) for c in candidates(problem, include_baseline=False))


@pytest.mark.parametrize("sampler", ["enumerate", "tpe", "random"])
def test_a_compile_screen_times_the_forms_that_overlap_first(sampler):
    """What a GPU node's compile screen says (XLA kept some rings asynchronous, serialised others) orders the
    search: every form that overlaps is timed before any that does not, whatever the sampler or the costs say."""
    costs = random_costs(PROBLEM, 5)
    serialised = {c for c in costs if c.method == "ring" and c.unroll == "full"}
    partly = {c for c in costs if c.method == "ring" and c.unroll == 2}
    broken = next(c for c in costs if c.method == "ring" and c.unroll == 1)
    screen = screen_of(PROBLEM, lambda c: None if c == broken else "serialised" if c in serialised
                       else "partly" if c in partly else "overlaps")
    settings = SearchSettings(sampler=sampler, seed=1, screen=screen, startup=2, enumerate_below=100 * (
        sampler == "enumerate"))
    timed = [t.decomposition for t in tune(PROBLEM, KnownCosts(costs), settings).search]
    assert len(timed) == len(set(timed)) == 49  # the whole space, still: the others are timed, after
    tier = [0 if c.method == "baseline" else 4 if c == broken else 3 if c in serialised else 2 if c in partly
            else 0 for c in timed]
    assert tier == sorted(tier), tier
    unscreened = [t.decomposition for t in tune(PROBLEM, KnownCosts(costs), settings.model_copy(
        update={"screen": ()})).search]
    assert unscreened != timed  # the screen, not the sampler, made that order


def test_a_screen_keeps_the_cost_model_order_within_a_verdict():
    screen = screen_of(PROBLEM, lambda c: "overlaps" if c.accumulate == "concat" else "partly")
    settings = SearchSettings(sampler="enumerate", screen=screen)
    searcher = Searcher(PROBLEM, PROFILE, settings)
    plain = Searcher(PROBLEM, PROFILE, SearchSettings(sampler="enumerate"))
    first = [c for c in searcher.by_model if c.method == "ring" and c.accumulate == "concat"]
    assert searcher.by_model[:len(first)] == first  # the overlapping forms first (the baseline is asked first)...
    assert first == [c for c in plain.by_model if c in set(first)]  # ...in the cost model's order
    assert searcher.screen_rank(Decomposition.baseline()) == 1  # nothing screened: with the forms without permutes
