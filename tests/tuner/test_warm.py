"""Warm start: the seeds of a new study (order, provenance, fit), the searcher's use of them, the stop rule
they enable, and their round trip through every store (memory, SQLite, PostgreSQL)."""

from __future__ import annotations

import itertools

import pytest

from cmtune.service.store import SqlStore
from cmtune.tuner.engine import Engine
from cmtune.tuner.errors import InvalidError
from cmtune.tuner.search import Finished, Searcher, SearchSettings, neighbours_agree, stop_reason
from cmtune.tuner.search_studies import study_settings
from cmtune.tuner.store import InMemoryStore
from cmtune.tuner.warm import Known, nearest_seeds, seeds
from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.planning.costmodel import PROFILES
from collective_matmul.planning.space import candidates
from collective_matmul.wire import MeasurementProtocol, Seed, StudyState, TrialKind, TrialState
from collective_matmul.wire.bundle import TunedConfig
from tests.tuner.test_engine import HW, START, Driver, store  # noqa: F401 - the contract suite's store fixture
from tests.tuner.test_engine import PROBLEM as ENGINE_PROBLEM
from tests.tuner.test_search import KnownCosts, random_costs, tune

PROBLEM = Problem.parse("ag:1024x256x1024:float32:8")  # 49 candidates
BASELINE = Decomposition.baseline()
RING = Decomposition(direction="bidirectional", chunks=2, unroll="full", accumulate="update_slice")
OTHER = Decomposition(direction="unidirectional", chunks=1, unroll=1, accumulate="concat")
THIRD = Decomposition(direction="unidirectional", chunks=4, unroll="full", accumulate="update_slice")


def tuned(key: str, decomposition: Decomposition = BASELINE, speedup: float = 1.0, hardware: Hardware = HW,
          ) -> TunedConfig:
    return TunedConfig(problem=Problem.parse(key), hardware=hardware, decomposition=decomposition, time_s=1e-3,
                       baseline_s=1e-3 * speedup, speedup=speedup)


def test_seeds_are_the_nearest_neighbours_winners_then_best_rings_with_where_they_came_from():
    near = Known(tuned("ag:512x256x1024:float32:8"), RING, 0.8, study_id=7)  # distance log 2
    ring_winner = Known(tuned("ag:1024x256x4096:float32:8", OTHER, 1.25), THIRD, 0.85, source="bundle")  # log 4
    far = Known(tuned("ag:64x16x64:float32:8", RING.model_copy(update={"chunks": 1}), 1.1), source="local")
    others = [
        Known(tuned("rs:512x256x1024:float32:8"), RING, 0.5, study_id=1),  # another collective
        Known(tuned("ag:512x256x1024:bfloat16:8"), RING, 0.5, study_id=2),  # another dtype
        Known(tuned("ag:512x256x1024:float32:8", hardware=HW.model_copy(update={"device_kind": "other"})),
              OTHER, 0.5, study_id=3),  # another hardware
    ]
    found = seeds(PROBLEM, HW, [far, *others, ring_winner, near], neighbours=2)
    assert [(s.decomposition, s.kind, s.neighbour, s.source, s.study_id) for s in found] == [
        (BASELINE, "winner", "allgather_matmul:512x256x1024:float32:8", "study", 7),
        (RING, "best ring", "allgather_matmul:512x256x1024:float32:8", "study", 7),
        (OTHER, "winner", "allgather_matmul:1024x256x4096:float32:8", "bundle", None),
        (THIRD, "best ring", "allgather_matmul:1024x256x4096:float32:8", "bundle", None),
    ]
    assert [s.ratio for s in found] == pytest.approx([1.0, 0.8, 0.8, 0.85])
    assert found[0].distance == pytest.approx(0.6931, abs=1e-4) and found[2].distance == pytest.approx(1.3863,
                                                                                                        abs=1e-4)
    # any order of what is known gives the same seeds; three neighbours reach the far one
    everything = [far, *others, ring_winner, near]
    assert all(seeds(PROBLEM, HW, order, neighbours=2) == found for order in itertools.permutations(everything))
    assert seeds(PROBLEM, HW, everything)[-1].neighbour == "allgather_matmul:64x16x64:float32:8"
    assert seeds(PROBLEM, HW, others) == ()


def test_a_neighbour_counts_once_and_this_runs_measurement_first():
    key = "ag:512x256x1024:float32:8"
    from_bundle = Known(tuned(key, OTHER, 1.2), source="bundle")
    from_run = Known(tuned(key), RING, 0.8, source="local")
    found = seeds(PROBLEM, HW, [from_bundle, from_run], neighbours=1)
    assert [(s.decomposition, s.source) for s in found] == [(BASELINE, "local"), (RING, "local")]
    # a decomposition two neighbours offer is seeded once, from the nearer
    second = Known(tuned("ag:2048x256x2048:float32:8"), RING, 0.7, study_id=9)
    assert [s.neighbour for s in seeds(PROBLEM, HW, [second, from_run])] == [f"allgather_matmul:{key[3:]}"] * 2


def test_decompositions_that_do_not_fit_the_new_problem_are_left_out():
    small = Problem.parse("ag:16x256x1024:float32:8")  # blocks of 2 rows: chunks 4 and 8 do not divide them
    eight = Decomposition(direction="unidirectional", chunks=8, unroll="full", accumulate="update_slice")
    misfit = Known(tuned("ag:64x256x1024:float32:8", THIRD, 1.2), eight, 0.9, study_id=1)
    fits = Known(tuned("ag:128x256x1024:float32:8"), RING, 0.8, study_id=2)
    assert not small.accepts(THIRD) and not small.accepts(eight) and small.accepts(RING)
    found = seeds(small, HW, [misfit, fits], neighbours=1)  # the misfit does not count as a neighbour
    assert [(s.decomposition, s.study_id) for s in found] == [(BASELINE, 2), (RING, 2)]
    assert all(s.decomposition in candidates(small) for s in seeds(small, HW, [misfit, fits]))


def test_seeds_read_nearest_first_in_batches_are_the_seeds_of_every_config():
    """A store reads the shapes of a family, then the configs of the nearest few at a time (`nearest_seeds`):
    the same seeds as `seeds` over every config, misfits, equal winners and several sources of one problem
    included, reading no more batches than it needs."""
    import random

    rng = random.Random(0)
    small = Problem.parse("ag:16x256x1024:float32:8")  # chunks 4 and 8 misfit here
    eight = Decomposition(direction="unidirectional", chunks=8, unroll="full", accumulate="update_slice")
    for target in (PROBLEM, small):
        for trial in range(20):
            known = []
            for i in range(rng.randrange(0, 30)):
                key = f"ag:{64 * rng.randrange(1, 64)}x{64 * rng.randrange(1, 8)}x1024:float32:8"
                winner = rng.choice([BASELINE, RING, OTHER, THIRD, eight])
                known.append(Known(tuned(key, winner, rng.choice([0.9, 1.0, 1.3])), rng.choice([None, RING, eight]),
                                   0.8, source=rng.choice(["study", "bundle"]), study_id=i + 1))
            shapes = {(k.config.problem.key, k.config.problem.m, k.config.problem.k, k.config.problem.n)
                      for k in known}
            reads = []

            def configs(keys, known=known, reads=reads):
                reads.append(list(keys))
                return [k for k in known if k.config.problem.key in keys]

            assert nearest_seeds(target, HW, shapes, configs, batch=2) == seeds(target, HW, known), trial
            assert sum(map(len, reads)) <= len(shapes)
    # enough fitting neighbours among the nearest: one batch is read
    near = [Known(tuned(f"ag:{m}x256x1024:float32:8"), RING, 0.8, study_id=m) for m in (512, 2048, 4096)]
    far = [Known(tuned(f"ag:{m}x256x1024:float32:8"), RING, 0.8, study_id=m) for m in (16, 32, 64)]
    reads = []
    shapes = [(k.config.problem.key, k.config.problem.m, 256, 1024) for k in near + far]
    nearest_seeds(PROBLEM, HW, shapes, lambda keys: reads.append(keys) or [k for k in near + far
                                                                             if k.config.problem.key in keys],
                  batch=3)
    assert [set(r) for r in reads] == [{k.config.problem.key for k in near}]


def test_a_bundles_implicit_accumulate_is_spelt_out_as_the_candidates_are():
    implicit = Decomposition(direction="bidirectional", chunks=2)
    (seed,) = seeds(PROBLEM, HW, [Known(tuned("ag:512x256x1024:float32:8", implicit, 1.3), source="bundle")])
    assert seed.decomposition == RING and seed.decomposition in candidates(PROBLEM)


def seeded(*configs: Decomposition, ratio: float = 0.8) -> tuple[Seed, ...]:
    return tuple(Seed(decomposition=c, kind="best ring", neighbour="allgather_matmul:512x256x1024:float32:8",
                      source="study", study_id=1, ratio=ratio, distance=0.69) for c in configs)


@pytest.mark.parametrize("sampler", ["tpe", "enumerate", "random"])
def test_the_searcher_times_the_seeds_right_after_the_baseline(sampler):
    plain = SearchSettings(sampler=sampler, seed=2, startup=3)
    warm = plain.model_copy(update={"seeds": (*seeded(BASELINE, RING, OTHER),)})
    costs = random_costs(PROBLEM, 3)

    def asks(settings, n=8):
        searcher, finished = Searcher(PROBLEM, PROFILES["cpu"], settings), []
        for _ in range(n):
            config = searcher.ask(finished)
            finished.append(Finished(config, costs[config]))
        return [f.config for f in finished]

    with_seeds, without = asks(warm), asks(plain)
    assert with_seeds[:3] == [BASELINE, RING, OTHER] and len(set(with_seeds)) == 8
    assert with_seeds == asks(warm)  # deterministic: another searcher, the same seeds, the same asks
    if sampler == "enumerate":  # then the cost model's order, as without seeds, less what is known
        assert with_seeds[3:] == [c for c in without if c not in (RING, OTHER)][1:6]
    if sampler == "tpe":  # the cost model's startup favourites are not used up by the seeds
        searcher = Searcher(PROBLEM, PROFILES["cpu"], warm)
        assert with_seeds[3:6] == [c for c in searcher.by_model if c not in with_seeds[:3]][:3]


def test_neighbours_agree_after_a_seed_runs_as_on_its_neighbour():
    settings = SearchSettings(seeds=seeded(RING, OTHER, ratio=0.8), warm_agreement=0.1, warm_patience=1)
    base = [Finished(BASELINE, 1.0)]
    assert not neighbours_agree(settings, [*base, Finished(RING, 0.85)])  # agreed; one more trial to go
    assert neighbours_agree(settings, [*base, Finished(RING, 0.85), Finished(OTHER, 0.95)])
    assert stop_reason(settings, [*base, Finished(RING, 0.85), Finished(OTHER, 0.95)], elapsed_s=0,
                       exhausted=False) == "neighbours agree"
    # a new best after the agreement starts the count again
    assert not neighbours_agree(settings, [*base, Finished(RING, 0.85), Finished(THIRD, 0.7)])
    assert neighbours_agree(settings, [*base, Finished(RING, 0.85), Finished(THIRD, 0.7), Finished(OTHER, 0.9)])
    # seeds that run otherwise here (or fail) never stop the study
    assert not neighbours_agree(settings, [*base, Finished(RING, 0.6), Finished(OTHER, None), Finished(THIRD, 1.2)])
    # the baseline agrees with every neighbour, so it says nothing
    baseline_only = SearchSettings(seeds=seeded(BASELINE, ratio=1.0), warm_patience=0)
    assert not neighbours_agree(baseline_only, [*base, Finished(RING, 0.9), Finished(OTHER, 0.9)])
    # warm_patience None: the seeds only reorder; 0: stop at the agreeing seed
    assert not neighbours_agree(settings.model_copy(update={"warm_patience": None}),
                                [*base, Finished(RING, 0.8), Finished(OTHER, 0.9), Finished(THIRD, 0.9)])
    assert neighbours_agree(settings.model_copy(update={"warm_patience": 0}), [*base, Finished(RING, 0.8)])


def test_a_seeded_study_proposes_the_neighbours_winner_after_the_baseline_and_stops_when_it_agrees():
    costs = random_costs(PROBLEM, 8)
    costs[RING], costs[OTHER] = 0.62, 0.61  # this problem behaves as its neighbour: the rings it seeds lead
    neighbour = Known(tuned("ag:512x256x1024:float32:8", RING, 1 / 0.6), OTHER, 0.6, study_id=3)
    warm = seeds(PROBLEM, HW, [neighbour])
    assert [s.kind for s in warm] == ["winner", "best ring"]
    settings = study_settings(PROBLEM, HW, seeds=warm)
    result = tune(PROBLEM, KnownCosts(costs), settings)
    timed = [t.decomposition for t in result.search]
    assert timed[:3] == [BASELINE, RING, OTHER]
    assert result.study.stop_reason == "neighbours agree" and len(timed) == 4 < settings.max_trials == 13
    assert result.tuned.decomposition == OTHER
    # where the neighbour does not predict (its rings run otherwise here), the study spends its budget
    costs[RING], costs[OTHER] = 1.4, 1.3
    result = tune(PROBLEM, KnownCosts(costs), settings)
    assert [t.decomposition for t in result.search][:3] == [BASELINE, RING, OTHER]
    assert result.study.stop_reason == "trial budget" and len(result.search) == 13
    # switched off: the plain search
    plain = tune(PROBLEM, KnownCosts(costs), study_settings(PROBLEM, HW))
    assert plain.study.settings.seeds == () and [t.decomposition for t in plain.search][1] != RING


def test_a_local_run_seeds_each_study_from_those_before_it():
    first, second = Problem.parse("ag:512x256x1024:float32:8"), PROBLEM
    costs = {**random_costs(first, 1), **{c: 0.6 + i / 100 for i, c in enumerate(candidates(first)[1:])}}
    from cmtune.workers.local import LocalTuner

    tuner = LocalTuner(KnownCosts(costs))
    outcome = tuner.tune(first, HW, study_settings(first, HW), MeasurementProtocol(repeats=3))
    known = outcome.known()
    assert known.source == "local" and known.best_ring == min(
        (t.decomposition for t in outcome.search if t.decomposition.method == "ring"), key=costs.get)
    warm = seeds(second, HW, [known])
    assert warm and warm[0].decomposition == outcome.tuned.decomposition and warm[0].source == "local"
    result = tuner.tune(second, HW, study_settings(second, HW, seeds=warm), MeasurementProtocol(repeats=3))
    assert result.search[1].decomposition == next(s.decomposition for s in warm if s.decomposition != BASELINE)


def test_the_engine_refuses_a_seed_that_is_no_candidate_of_the_problem():
    small = Problem.parse("ag:16x256x1024:float32:8")
    with InMemoryStore().transaction(write=True) as tx, pytest.raises(InvalidError, match="ring-uni-c4"):
        Engine().create_study(tx, problem=small, hardware=HW, protocol=MeasurementProtocol(),
                              settings=SearchSettings(profile="cpu", seeds=seeded(THIRD)), now=START)


def test_seeds_survive_the_store_and_every_store_proposes_them_alike(store):  # noqa: F811 - the fixture
    warm = seeded(RING, OTHER)
    driver = Driver(store)
    study_id = driver.create(SearchSettings(profile="cpu", max_trials=6, seeds=warm), problem=ENGINE_PROBLEM)
    if isinstance(store, SqlStore):  # a store that has not seen the study reads it from the database
        store = SqlStore(store.db)
    with store.transaction() as tx:
        assert tx.study(study_id).settings.seeds == warm
    timed = Driver(store).run(study_id)
    assert timed[:3] == ["baseline", RING.id, OTHER.id]
    reference = Driver(InMemoryStore())
    assert reference.run(reference.create(SearchSettings(profile="cpu", max_trials=6, seeds=warm),
                                          problem=ENGINE_PROBLEM)) == timed


def test_seeds_that_agree_stop_the_study_and_drop_the_proposals_nobody_claimed(store):  # noqa: F811
    from tests.tuner.test_engine import ratio_of

    driver = Driver(store, Engine(ready=3))
    agreeing = tuple(s.model_copy(update={"ratio": ratio_of(s.decomposition)}) for s in seeded(RING, OTHER))
    study_id = driver.create(SearchSettings(profile="cpu", max_trials=20, seeds=agreeing), problem=ENGINE_PROBLEM)
    timed = [driver.claim(study_id) for _ in range(3)]
    assert [t.decomposition for t in timed] == [BASELINE, RING, OTHER]
    for trial in timed:  # RING agrees and is the best; OTHER is the one trial after it without a new best
        driver.report(trial)
    study, trials = driver.study(study_id)
    assert study.stop_reason == "neighbours agree" and study.state == StudyState.CONFIRMING
    search = [t for t in trials if t.kind == TrialKind.SEARCH]
    assert [t.state for t in search].count(TrialState.CANCELLED) == 3 and study.trials_done == 3
