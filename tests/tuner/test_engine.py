"""The engine's contract suite: one lifecycle over every store (memory, SQLite, PostgreSQL).

The results are synthetic (the engine is under test, not the devices): a deterministic
landscape of ratios, failures on demand.  Every test runs once per store, and the first test
checks that every store drives the same study to the same decisions.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from cmtune.service import migrate
from cmtune.service.db import Database
from cmtune.service.store import SqlStore
from cmtune.tuner import states
from cmtune.tuner.engine import Engine, task_for
from cmtune.tuner.errors import ConflictError, InvalidError
from cmtune.tuner.search import SearchSettings, default_budget
from cmtune.tuner.search_studies import profile_name_for, study_settings
from cmtune.tuner.states import move_study, move_trial
from cmtune.tuner.store import InMemoryStore
from cmtune.tuner.variants import FIXED_RING
from collective_matmul import Decomposition, Hardware, OpConfigs, Problem
from collective_matmul.planning.models import PRESETS, ROLES, SLOTS, MeshSpec, role_problems
from collective_matmul.planning.problem import Software
from collective_matmul.planning.space import candidates
from collective_matmul.wire import (
    BoundsMeasurement,
    ConfirmResult,
    Measurement,
    MeasurementProtocol,
    SearchResult,
    Status,
    StepMeasurement,
    StepResult,
    StepVariant,
    StudyState,
    Timing,
    TrialKind,
    TrialState,
    result_of,
)
from collective_matmul.wire.bundle import TunedConfig
from tests.service.conftest import reset_postgres

PROBLEM = Problem.parse("ag:256x64x128:float32:8")  # 49 candidates
HW = Hardware(platform="cpu", device_kind="cpu", device_count=8)
START = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
ROOT = Path(__file__).resolve().parents[2]
D = Decomposition.from_id


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "memory":
        yield InMemoryStore()
        return
    if request.param == "sqlite":
        db = Database(f"sqlite:///{tmp_path / 'engine.sqlite'}")
    else:
        url = request.getfixturevalue("pg_url")
        reset_postgres(url)
        migrate.upgrade(create_engine(url))
        db = Database(url)
    migrate.upgrade(db.engine)
    yield SqlStore(db)
    db.dispose()


def ratio_of(config: Decomposition) -> float:
    """bidirectional, 2 chunks, full unroll is best (0.7); the baseline is 1 by definition."""
    if config.method == "baseline":
        return 1.0
    return (0.7 + (0.1 if config.direction == "unidirectional" else 0) + 0.02 * abs(config.chunks - 2)
            + (0.03 if config.unroll != "full" else 0) + (0.01 if config.accumulate == "concat" else 0))


def measured(config: Decomposition, status: Status = Status.OK, problem: Problem = PROBLEM,
             ratio: float | None = None) -> Measurement:
    hardware = HW.model_copy(update={"jax_version": "0.10.2"})
    if status != Status.OK:
        return Measurement(problem=problem, decomposition=config, hardware=hardware, status=status, message="boom")
    ratio = ratio or ratio_of(config)
    ring = config.method == "ring"
    return Measurement(problem=problem, decomposition=config, hardware=hardware, status=status,
                       candidate=Timing.of([1e-3 * ratio] * 3), baseline=Timing.of([1e-3] * 3), ratio=ratio,
                       ratio_iqr=0.0, overlap="partly" if ring else "no permutes",
                       memory_bytes=(1 << 20) + 4096 * config.chunks if ring else 1 << 20)


class Driver:
    """Claims and reports trials like a fleet of workers would, through the engine only."""

    def __init__(self, store, engine: Engine | None = None):
        self.store, self.engine = store, engine or Engine(ready=1)
        self.now = START

    def tick(self, seconds: float = 1.0) -> dt.datetime:
        self.now += dt.timedelta(seconds=seconds)
        return self.now

    def create(self, settings: SearchSettings, problem: Problem = PROBLEM) -> int:
        with self.store.transaction(write=True) as tx:
            return self.engine.create_study(tx, problem=problem, hardware=HW, settings=settings,
                                            protocol=MeasurementProtocol(repeats=3), now=self.tick()).id

    def claim(self, study_id: int):
        with self.store.transaction(write=True) as tx:
            return self.engine.claim(tx, study_ids=[study_id], now=self.tick())

    def report(self, trial, fail: set = frozenset()) -> None:
        results = [measured(c, Status.COMPILE_ERROR if c in fail else Status.OK) for c in trial.decompositions]
        with self.store.transaction(write=True) as tx:
            self.engine.record(tx, trial.id, result_of(trial.kind, results), now=self.tick())

    def run(self, study_id: int, fail: set = frozenset()) -> list[str]:
        """Claim and report until the study is final; the ids of what was timed, in order."""
        timed = []
        while (trial := self.claim(study_id)) is not None:
            timed.append(trial.decomposition_id)
            self.report(trial, fail)
        return timed

    def study(self, study_id: int):
        with self.store.transaction() as tx:
            return tx.study(study_id), tx.trials(study_id, measurements=True)

    def tuned(self, study_id: int):
        with self.store.transaction() as tx:
            return tx.tuned_config(PROBLEM, HW)


def settings(**changes) -> SearchSettings:
    return SearchSettings(profile="cpu", **changes)


def test_a_study_runs_to_its_tuned_config_and_every_store_decides_alike(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=12, confirm_top=2))
    timed = driver.run(study_id)
    study, trials = driver.study(study_id)
    assert study.state == StudyState.COMPLETED and study.stop_reason == "trial budget"
    assert timed[0] == "baseline" and timed[-1] == "confirm:3" and len(timed) == 13
    assert study.trials_done == 12 and study.best_ratio == min(ratio_of(t.decomposition) for t in trials[:12])
    tuned = driver.tuned(study_id)
    assert tuned.decomposition == min((t.decomposition for t in trials[:12]), key=ratio_of)
    assert tuned.trials == 12 and tuned.space_size == 49
    # the same study on a fresh in-memory store takes exactly the same decisions
    reference = Driver(InMemoryStore())
    assert reference.run(reference.create(settings(max_trials=12, confirm_top=2))) == timed


def test_default_budget_and_profile_come_from_one_place():
    chosen = study_settings(PROBLEM, HW)
    assert chosen.max_trials == default_budget(49) == 13
    assert chosen.profile == profile_name_for(HW) == "cpu"
    assert study_settings(PROBLEM, HW, trials=5).max_trials == 5
    # an unknown platform gets a fixed profile too: the order never depends on a timing
    other = Hardware(platform="neuron", device_kind="trn1", device_count=8)
    assert study_settings(PROBLEM, other).profile == study_settings(PROBLEM, other).profile


def test_only_the_baseline_ran_completes_with_the_baseline(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=1))
    assert driver.run(study_id) == ["baseline"]  # no confirmation round for a lone baseline
    study, _ = driver.study(study_id)
    assert study.state == StudyState.COMPLETED
    tuned = driver.tuned(study_id)
    assert tuned.decomposition == Decomposition.baseline() and tuned.speedup == 1.0


def test_a_failed_baseline_fails_the_study_with_the_reason(store):
    driver = Driver(store, Engine(ready=2))
    study_id = driver.create(settings(max_trials=8))
    first, second = driver.claim(study_id), driver.claim(study_id)
    assert first.decomposition == Decomposition.baseline()
    driver.report(first, fail={Decomposition.baseline()})
    with driver.store.transaction() as tx:  # the search stopped: no new proposal, the unclaimed one dropped
        assert [t.state for t in tx.trials(study_id)] == [TrialState.COMPLETED, TrialState.LEASED]
    driver.report(second, fail={second.decomposition})
    study, _ = driver.study(study_id)
    assert study.state == StudyState.FAILED and study.stop_reason == "baseline failed"
    assert "not even the baseline" in study.message and "compile_error" in study.message
    assert driver.tuned(study_id) is None


def test_ready_proposals_make_claims_distinct_and_are_refilled(store):
    driver = Driver(store, Engine(ready=3))
    study_id = driver.create(settings(max_trials=20))
    claimed = [driver.claim(study_id) for _ in range(3)]
    assert len({t.decomposition for t in claimed}) == 3
    assert driver.claim(study_id) is None  # a claim never asks: the next proposals come with a result
    driver.report(claimed[0])
    with driver.store.transaction() as tx:
        pending = [t for t in tx.trials(study_id) if t.state == TrialState.PENDING]
    assert len(pending) == 3  # topped up to three ready, all new candidates
    assert not {t.decomposition for t in pending} & {t.decomposition for t in claimed}
    study, _ = driver.study(study_id)
    assert study.state == StudyState.RUNNING and study.started_at is not None


def test_an_abandoned_confirmation_completes_from_the_search_trials(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=4, confirm_top=2))
    while (trial := driver.claim(study_id)).kind == TrialKind.SEARCH:
        driver.report(trial)
    with driver.store.transaction(write=True) as tx:  # its leases expired max_attempts times
        driver.engine.abandon(tx, trial, status=Status.TIMEOUT, message="lease expired 3 times", now=driver.tick())
    study, trials = driver.study(study_id)
    assert study.state == StudyState.COMPLETED
    assert "confirmation round got no result" in study.message and "search trials" in study.message
    assert trials[-1].state == TrialState.FAILED
    assert driver.tuned(study_id).decomposition == min((t.decomposition for t in trials[:4]), key=ratio_of)


OLD, NEW = Software(jax="0.10.2"), Software(jax="0.11.0", jaxlib="0.11.0")


def on(stack: Software, results: list[Measurement]) -> list[Measurement]:
    """``results`` as measured on ``stack``."""
    return [m.model_copy(update={"hardware": m.hardware.model_copy(update={"software": stack})}) for m in results]


def test_a_claim_on_a_machine_serves_it_and_the_rings_its_devices_split_into_oldest_study_first(store):
    """A worker of 8 devices (2 processes) tunes its own hardware and rings of 4 and 2 of it (``cpu:cpu:4:1/8``,
    ``cpu:cpu:2:1/8``); never a machine of 4 devices, nor a ring of another slice."""
    driver, machine = Driver(store), HW.model_copy(update={"process_count": 2})
    on = {"other machine": Hardware(platform="cpu", device_kind="cpu", device_count=4),
          "ring of 16": Hardware(platform="cpu", device_kind="cpu", device_count=4, slice_devices=16),
          "ring of 2": machine.ring(2), "whole": machine, "ring of 4": machine.ring(4)}
    ids = {}
    with driver.store.transaction(write=True) as tx:
        for name, hardware in on.items():
            problem = Problem.parse(f"ag:256x64x128:float32:{hardware.device_count}")
            ids[name] = driver.engine.create_study(tx, problem=problem, hardware=hardware, now=driver.tick(),
                                                   settings=settings(max_trials=2), protocol=MeasurementProtocol()).id
    claimed = []
    with driver.store.transaction(write=True) as tx:
        while (trial := driver.engine.claim(tx, hardware=machine, now=driver.tick())) is not None:
            claimed.append(trial.study_id)
    assert set(claimed) == {ids["ring of 2"], ids["whole"], ids["ring of 4"]}
    assert claimed == sorted(claimed)  # the oldest study first, whatever its ring
    with driver.store.transaction() as tx:
        assert tx.study(ids["ring of 4"]).hardware.key == "cpu:cpu:4:1/8"


def test_a_reconfirmation_retimes_the_winner_its_runner_up_and_the_baseline_on_its_stack_only(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=6, confirm_top=2))
    driver.run(study_id)
    stored = driver.tuned(study_id)
    _, trials = driver.study(study_id)
    rings = sorted((t.decomposition for t in trials if t.kind == TrialKind.SEARCH and t.decomposition.method == "ring"),
                   key=ratio_of)
    assert stored.software == OLD and stored.decomposition == rings[0]
    with driver.store.transaction(write=True) as tx:
        with pytest.raises(InvalidError, match="measured on jax 0.10.2"):
            driver.engine.create_reconfirmation(tx, config=stored, software=OLD, now=driver.tick(), study_id=study_id)
        study = driver.engine.create_reconfirmation(tx, config=stored, software=NEW, now=driver.tick(),
                                                    study_id=study_id)
    assert study.state == StudyState.CONFIRMING and study.software == NEW
    assert study.reconfirm.contenders == [Decomposition.baseline(), rings[0], rings[1]]
    assert study.reconfirm.runner_up == rings[1] and study.reconfirm.study_id == study_id
    # only a claim of the new stack (or of none) takes its round
    with driver.store.transaction(write=True) as tx:
        assert driver.engine.claim(tx, hardware=HW.model_copy(update={"software": OLD}), now=driver.tick()) is None
        trial = driver.engine.claim(tx, hardware=HW.model_copy(update={"software": NEW}), now=driver.tick())
    assert trial.kind == TrialKind.CONFIRM and list(trial.decompositions) == study.reconfirm.contenders
    results = [measured(c) for c in trial.decompositions]
    with pytest.raises(InvalidError, match="runs on jax 0.11.0"), driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, trial.id, ConfirmResult(measurements=on(OLD, results)), now=driver.tick())
    with driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, trial.id, ConfirmResult(measurements=on(NEW, results)), now=driver.tick())
    done, _ = driver.study(study.id)
    assert done.state == StudyState.COMPLETED and done.stop_reason == "re-confirmed"
    assert done.message.startswith(f"re-confirmed on {NEW}: {rings[0].id} still wins")
    with driver.store.transaction() as tx:
        again = tx.tuned_config(PROBLEM, HW, NEW)
        assert tx.tuned_config(PROBLEM, HW, OLD) == stored  # the old stack's stays
        assert tx.tuned_config(PROBLEM, HW) == again  # no stack named: the newest
    assert again.decomposition == stored.decomposition and again.software == NEW and again.jax_version == "0.11.0"
    assert (again.trials, again.space_size) == (stored.trials, stored.space_size)  # the search's evidence


def test_a_reconfirmation_whose_runner_up_wins_replaces_the_config_and_one_without_a_study_takes_a_ring(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=6, confirm_top=2))
    driver.run(study_id)
    stored = driver.tuned(study_id)
    with driver.store.transaction(write=True) as tx:
        study = driver.engine.create_reconfirmation(tx, config=stored, software=NEW, now=driver.tick(),
                                                    study_id=study_id)
        trial = driver.engine.claim(tx, study_ids=[study.id], now=driver.tick())
        ratios = {stored.decomposition: 1.2}  # the new stack slowed the stored winner down
        results = [measured(c, ratio=ratios.get(c)) for c in trial.decompositions]
        driver.engine.record(tx, trial.id, ConfirmResult(measurements=on(NEW, results)), now=driver.tick())
        done, again = tx.study(study.id), tx.tuned_config(PROBLEM, HW, NEW)
    assert done.stop_reason == "replaced" and again.decomposition == study.reconfirm.runner_up
    assert f"replaced on {NEW}: {again.decomposition.id}" in done.message
    # a config imported from a bundle has no study: the cost model's first ring is its runner-up
    imported = stored.model_copy(update={"decomposition": Decomposition.baseline()})
    with driver.store.transaction(write=True) as tx:
        study = driver.engine.create_reconfirmation(tx, config=imported, software=NEW, now=driver.tick())
    assert study.reconfirm.runner_up is None and study.reconfirm.study_id is None
    baseline, ring = study.reconfirm.contenders
    assert baseline == Decomposition.baseline() and ring.method == "ring"
    # a round that gets no result fails the re-confirmation, and the old stack's config is all there is
    with driver.store.transaction(write=True) as tx:
        trial = driver.engine.claim(tx, study_ids=[study.id], now=driver.tick())
        driver.engine.abandon(tx, trial, status=Status.TIMEOUT, message="lease expired 3 times", now=driver.tick())
        failed = tx.study(study.id)
    assert failed.state == StudyState.FAILED and "the re-confirmation round on jax 0.11.0" in failed.message


def test_an_abandoned_search_trial_counts_and_the_study_goes_on(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=3))
    trial = driver.claim(study_id)
    with driver.store.transaction(write=True) as tx:
        driver.engine.abandon(tx, trial, status=Status.TIMEOUT, message="lease expired", now=driver.tick())
    timed = driver.run(study_id)
    study, trials = driver.study(study_id)
    assert study.state == StudyState.COMPLETED and study.trials_done == 3
    assert trials[0].state == TrialState.FAILED and len(timed) == 3  # two more candidates, then the round


def test_patience_drops_proposals_nobody_claimed(store):
    driver = Driver(store, Engine(ready=2))
    study_id = driver.create(settings(patience=2, sampler="enumerate"))
    first = driver.claim(study_id)
    driver.report(first)  # the baseline: best so far
    worse = [driver.claim(study_id), driver.claim(study_id)]
    for trial in worse:
        with driver.store.transaction(write=True) as tx:
            driver.engine.record(tx, trial.id, SearchResult(measurement=measured(trial.decomposition, ratio=1.5)),
                                 now=driver.tick())
    study, trials = driver.study(study_id)
    assert study.stop_reason == "no improvement"
    assert [t.state for t in trials if t.kind == TrialKind.SEARCH].count(TrialState.CANCELLED) == 2
    assert study.state == StudyState.CONFIRMING


def test_time_budget_counts_from_the_first_claim(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_seconds=30, sampler="enumerate"))
    driver.tick(3600)  # an hour in the queue before any worker came: not spent
    trial = driver.claim(study_id)
    driver.report(trial)
    study, _ = driver.study(study_id)
    assert study.state == StudyState.RUNNING
    driver.tick(60)
    driver.report(driver.claim(study_id))
    study, _ = driver.study(study_id)
    assert study.stop_reason == "time budget" and study.state == StudyState.CONFIRMING


def test_results_must_match_the_trial_and_transitions_are_guarded(store):
    driver = Driver(store, Engine(ready=2))
    study_id = driver.create(settings(max_trials=6))
    trial = driver.claim(study_id)
    with driver.store.transaction() as tx:
        pending = next(t for t in tx.trials(study_id) if t.state == TrialState.PENDING)
    with pytest.raises(ConflictError, match="not leased"), driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, pending.id, SearchResult(measurement=measured(pending.decomposition)),
                             now=driver.tick())
    other = Decomposition(direction="bidirectional", chunks=4)
    with pytest.raises(InvalidError, match="the result is for"), driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, trial.id, SearchResult(measurement=measured(other)), now=driver.tick())
    wrong_problem = measured(trial.decomposition, problem=Problem.parse("ag:512x64x128:float32:8"))
    with pytest.raises(InvalidError, match="is for allgather_matmul:256x64x128"), \
            driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, trial.id, SearchResult(measurement=wrong_problem), now=driver.tick())
    with pytest.raises(InvalidError, match="is a search trial: send 'measurement'"), \
            driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, trial.id, ConfirmResult(measurements=[measured(trial.decomposition)]),
                             now=driver.tick())
    with driver.store.transaction(write=True) as tx:
        driver.engine.cancel(tx, study_id, now=driver.tick())
    study, trials = driver.study(study_id)
    assert study.state == StudyState.CANCELLED
    assert {t.state for t in trials} == {TrialState.CANCELLED}
    with pytest.raises(ConflictError, match="cancelled"), driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, trial.id, SearchResult(measurement=measured(trial.decomposition)), now=driver.tick())
    with pytest.raises(ConflictError, match="only pending, running or confirming"), \
            driver.store.transaction(write=True) as tx:
        driver.engine.cancel(tx, study_id, now=driver.tick())


def test_a_small_space_is_enumerated_to_exhaustion(store):
    small = Problem.parse("ag:64x8x8:float32:4")
    driver = Driver(store)
    study_id = driver.create(settings(), problem=small)
    timed = []
    while (trial := driver.claim(study_id)) is not None:
        timed.append(trial.decomposition_id)
        with driver.store.transaction(write=True) as tx:
            driver.engine.record(tx, trial.id, result_of(trial.kind, [measured(c, problem=small)
                                                                       for c in trial.decompositions]),
                                 now=driver.tick())
    study, _ = driver.study(study_id)
    assert study.stop_reason == "exhausted" and len(timed) == len(candidates(small)) + 1


def test_states_change_only_through_the_engines_guard(store, monkeypatch):
    """No caller of a store sets a state around `TRIAL_MOVES` / `STUDY_MOVES`: `update_study` and the study
    changes of a trial's move refuse one, and a claim is a move the table must allow."""
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=3))
    with driver.store.transaction(write=True) as tx:
        trial = tx.trials(study_id)[0]
        with pytest.raises(TypeError, match="engine's guard"):
            tx.update_study(study_id, state=StudyState.COMPLETED)
        with pytest.raises(TypeError, match="engine's guard"):
            tx.apply_trial_move(trial.id, TrialState.CANCELLED, expected=TrialState.PENDING, study_id=study_id,
                                study_changes={"state": StudyState.CANCELLED})
        with pytest.raises(TypeError, match="engine's guard"):
            tx.apply_study_move(study_id, StudyState.RUNNING, expected=StudyState.PENDING,
                                state=StudyState.COMPLETED)
    assert driver.study(study_id)[0].state == StudyState.PENDING
    monkeypatch.setitem(states.TRIAL_MOVES, TrialState.PENDING,
                        frozenset({TrialState.FAILED, TrialState.CANCELLED}))
    with pytest.raises(ConflictError, match="is pending; it cannot become leased"):
        driver.claim(study_id)
    with driver.store.transaction() as tx:
        assert [t.state for t in tx.trials(study_id)] == [TrialState.PENDING]


def test_a_move_from_a_state_read_before_another_claim_changes_nothing(store):
    """A move is conditional on the state the engine read: a proposal claimed after it was read is not
    cancelled under its lease (nor its study moved twice), and the move says it did not happen."""
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=3))
    with driver.store.transaction(write=True) as tx:
        (stale,) = tx.trials(study_id)
        study = tx.study(study_id)
    driver.claim(study_id)  # another worker claims it (and starts the study) in between
    with driver.store.transaction(write=True) as tx:
        assert not move_trial(tx, stale, TrialState.CANCELLED, strict=False, message="not needed")
        with pytest.raises(ConflictError, match="no longer pending"):
            move_trial(tx, stale, TrialState.CANCELLED, message="not needed")
    with driver.store.transaction(write=True) as tx:
        assert not move_study(tx, study, StudyState.RUNNING, strict=False, started_at=START)
    with driver.store.transaction() as tx:
        assert tx.trial(stale.id).state == TrialState.LEASED and tx.trial(stale.id).message is None
        assert tx.study(study_id).state == StudyState.RUNNING


def test_a_search_that_stops_keeps_what_a_worker_claimed_in_between(store):
    """The stop drops only proposals still pending: one claimed between the refill's read of the history and
    its cancel stays leased, its result is stored as a measurement, and the study confirms after it."""
    driver = Driver(store, Engine(ready=3))
    study_id = driver.create(settings(max_seconds=60))
    with driver.store.transaction() as tx:
        stale = tx.trials(study_id)  # the refill's read: three proposals pending
    assert [t.state for t in stale] == [TrialState.PENDING] * 3
    claimed = driver.claim(study_id)  # another worker, in between
    with driver.store.transaction(write=True) as tx:  # the time budget is spent: the search stops
        driver.engine._refill(tx, tx.study(study_id, lock=True), now=driver.tick(3600), trials=stale)
    study, trials = driver.study(study_id)
    assert [t.state for t in trials] == [TrialState.LEASED, TrialState.CANCELLED, TrialState.CANCELLED]
    assert trials[1].message == "not needed: the search stopped (time budget) after 0 trials"
    driver.report(claimed)
    study, trials = driver.study(study_id)
    assert trials[0].state == TrialState.COMPLETED and trials[0].measurements
    assert study.state == StudyState.COMPLETED and study.stop_reason == "time budget"


def test_only_the_guard_applies_a_move():
    """`apply_study_move` / `apply_trial_move` are called from `move_study` / `move_trial` (`tuner/states.py`) alone
    (the stores define them; nothing else in the installed packages calls them)."""
    callers = set()
    installed = ("collective_matmul", "migrations", "tuner", "workers", "service", "cmtune")
    for path in sorted(p for folder in installed for p in (ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Attribute) and node.attr in ("apply_study_move", "apply_trial_move") \
                        and isinstance(node.ctx, ast.Load):
                    callers.add((path.relative_to(ROOT).as_posix(), function.name, node.attr))
    assert callers == {("tuner/states.py", "move_study", "apply_study_move"),
                       ("tuner/states.py", "move_trial", "apply_trial_move")}, callers


class KindBranches(ast.NodeVisitor):
    """Where code outside the dispatch (`part_of`) tells the kinds of study apart: a comparison with a
    `StudyKind` / `TrialKind` or a re-confirmation, or a read of a study's kind or re-confirmation."""

    def __init__(self):
        self.found: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name != "part_of":
            self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & {"StudyKind", "TrialKind"}:
            self.found.append(f"line {node.lineno}: {ast.unparse(node)}")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "reconfirm" or (node.attr == "kind" and isinstance(node.value, ast.Name)
                                        and node.value.id == "study"):
            self.found.append(f"line {node.lineno}: {ast.unparse(node)}")
        self.generic_visit(node)

    @classmethod
    def of(cls, source: str) -> list[str]:
        visitor = cls()
        visitor.visit(ast.parse(source))
        return visitor.found


def test_the_engine_tells_the_kinds_of_study_apart_in_one_place():
    """`Engine` owns the lifecycle's entry points and leaves what differs by kind to the kind's module
    (`tuner/search_studies.py`, `tuner/step_studies.py`): `part_of` chooses it, and nothing else in `tuner/engine.py`
    branches on a study's kind, a trial's kind or a re-confirmation; the class stays under 300 lines."""
    assert KindBranches.of("if study.kind == StudyKind.STEP or trial.kind != TrialKind.CONFIRM: pass")
    assert KindBranches.of("x = {1: 2}[study.kind] if study.reconfirm is None else 3")
    source = (ROOT / "tuner" / "engine.py").read_text()
    assert KindBranches.of(source) == []
    tree = ast.parse(source)
    (dispatch,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "part_of"]
    assert "StudyKind" in ast.unparse(dispatch)
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    assert engine.end_lineno - engine.lineno + 1 < 300


# ---- the step study's search ---------------------------------------------------------------------------------

TINY = PRESETS["tiny"]
TINY_MESH = MeshSpec.parse("data=1,model=8")
WINNER = {"allgather_matmul": D("ring-bi-c2-full-dus"), "matmul_reduce_scatter": D("ring-bi-c2-full-in"),
          "allgather_grad_weight": D("ring-bi-c2-full-in")}


class StepDriver(Driver):
    """A model's step study over the store: the qkv forward problem searched for real (its ring trials are the
    step search's runners-up), every other problem tuned directly; step rounds timed by ``seconds``."""

    def __init__(self, store, **options):
        super().__init__(store)
        self.qkv = role_problems(TINY, TINY_MESH)["qkv"]["forward"]
        searched = self.create(settings(max_trials=8, confirm_top=1), problem=self.qkv)
        while (trial := self.claim(searched)) is not None:
            results = [measured(c, problem=self.qkv) for c in trial.decompositions]
            with self.store.transaction(write=True) as tx:
                self.engine.record(tx, trial.id, result_of(trial.kind, results), now=self.tick())
        with self.store.transaction(write=True) as tx:
            for slots in role_problems(TINY, TINY_MESH).values():
                for problem in slots.values():
                    if problem != self.qkv:
                        tx.save_tuned(TunedConfig(problem=problem, hardware=HW, decomposition=WINNER[
                            problem.collective], time_s=0.8, baseline_s=1.0, speedup=1.25), study_id=None)
            self.winner = tx.tuned_config(self.qkv, HW).decomposition
            self.runner_up = next(d for d in tx.best_search_trials(self.qkv, HW, limit=3) if d != self.winner)
            self.step_id = self.engine.create_step_study(
                tx, block=TINY, mesh=TINY_MESH, hardware=HW, depends_on=[searched],
                protocol=MeasurementProtocol(repeats=4),
                now=self.tick(), **options).id

    def seconds(self, setting) -> float:
        """Always-ring beats the op-level winners, and beats every fixed setting with qkv's forward on its
        runner-up ring: the planted combination."""
        if setting is None:
            return 1.0
        total = 0.5
        for role, configs in setting.items():
            for slot in SLOTS:
                chosen = getattr(configs, slot)
                total += (0.005 if (role, slot, chosen) == ("qkv", "forward", self.runner_up) else
                          0.02 if chosen.model_copy(update={"fuse": False}) == FIXED_RING else
                          0.03 if chosen.method == "ring" else 0.05)
        return round(total, 6)

    def step_result(self, trial) -> StepResult:
        timed = []
        for name, setting in trial.variants.items():
            times = [self.seconds(setting)] * 4
            timed.append(StepVariant(name=name, status="ok", configs=setting or {}, timing=Timing.of(times),
                                     ratio=times[0], ratio_iqr=0.0))
        return StepResult(step=StepMeasurement(block=TINY, mesh=TINY_MESH.axes, tensor_axis="model", hardware=HW,
                                               protocol=MeasurementProtocol(repeats=4), variants=timed))

    def run_step(self, abandon: int | None = None) -> list:
        """Claim and report the step study's trials until it is final (abandon trial number ``abandon``)."""
        done = []
        while (trial := self.claim(self.step_id)) is not None:
            with self.store.transaction(write=True) as tx:
                study = tx.study(self.step_id)
                assert task_for(study, trial).step.variants == trial.variants
                if trial.number == abandon:
                    self.engine.abandon(tx, trial, status=Status.TIMEOUT, message="lease expired", now=self.tick())
                else:
                    self.engine.record(tx, trial.id, self.step_result(trial), now=self.tick())
            done.append(trial)
        return done


def test_a_step_study_searches_round_by_round_and_every_store_decides_alike(store):
    driver = StepDriver(store, search_rounds=3, round_variants=6)
    states = []
    while (trial := driver.claim(driver.step_id)) is not None:
        with store.transaction(write=True) as tx:
            if trial.number == 2:  # a result for a variant this round did not ask for decides nothing
                assert "baseline" not in trial.variants  # the seeds' round timed it, this one does not ask for it
                forged = driver.step_result(dataclasses.replace(trial, variants=trial.variants | {
                    "baseline": {role: OpConfigs() for role in ROLES}}))
                with pytest.raises(InvalidError, match="'baseline' is not one of them"):
                    driver.engine.record(tx, trial.id, forged, now=driver.tick())
            driver.engine.record(tx, trial.id, driver.step_result(trial), now=driver.tick())
            states.append(tx.study(driver.step_id).state)
    study, trials = driver.study(driver.step_id)
    assert [t.number for t in trials] == [1, 2, 3, 4] and all(t.state == TrialState.COMPLETED for t in trials)
    assert states == [StudyState.RUNNING, StudyState.RUNNING, StudyState.CONFIRMING, StudyState.COMPLETED]
    seeds, improved, _, graded = (t.variants for t in trials)
    # the cost model picks the baseline for every tiny problem on CPU, and the ring fill is the tuned step
    assert list(seeds) == ["as-written", "baseline", "tuned", "always-ring"]
    assert list(improved)[:2] == ["as-written", "always-ring"] and all(n.startswith("r2-qkv-") for n in
                                                                      list(improved)[2:])
    assert list(graded) == ["as-written", "baseline", "tuned", "always-ring", "r2-qkv-fw2"]  # every fixed setting
    assert graded["r2-qkv-fw2"]["qkv"].forward == driver.runner_up
    decision = study.decision
    assert study.stop_reason == "step budget" and decision.variant == "r2-qkv-fw2"
    assert decision.seed == "always-ring" and decision.fresh_rounds and decision.rounds == 3
    assert decision.vs_seed.median == pytest.approx(driver.seconds(graded["always-ring"])
                                                    / driver.seconds(graded["r2-qkv-fw2"]))
    # rounds 2 and 3 on the driver's clock, from the round before them finished: a second per claim and per
    # result (round 2's forged one too)
    assert decision.search_s == pytest.approx(3.0 + 2.0)
    assert study.trials_done == 4 and study.best_trial_id == trials[-1].id
    # the step's own bound: each of the layer's 12 collective matmuls (all tuned) against the graded rounds
    assert decision.time_s == pytest.approx(driver.seconds(graded["r2-qkv-fw2"]))
    assert len(decision.bound.terms) == 12 and decision.bound.measured_tuned_s == decision.time_s
    assert decision.bound.measured_saved_s == pytest.approx(decision.saved_s)
    assert decision.bound.estimated_saved_s == pytest.approx(sum(t.saved_s for t in decision.bound.terms))
    with store.transaction() as tx:
        overrides = {o.role: o for o in tx_overrides(tx, store)}
    assert set(overrides) == set(ROLES)
    assert "r2-qkv-fw2 (round 2 of the step search)" in overrides["qkv"].reason
    assert "always-ring (the seeds' round of the step search)" in overrides["mlp_up"].reason
    assert overrides["qkv"].configs.forward == driver.runner_up
    # the same submission on a fresh in-memory store takes exactly the same decisions
    again = StepDriver(InMemoryStore(), search_rounds=3, round_variants=6)
    again.run_step()
    assert again.study(again.step_id)[0].decision.model_dump(exclude={"search_s", "summary"}) == \
        decision.model_dump(exclude={"search_s", "summary"})  # (no forged result there: a second less)


def test_a_step_search_round_without_a_result_is_passed_over(store):
    driver = StepDriver(store, search_rounds=3, round_variants=6)
    driver.run_step(abandon=2)
    study, trials = driver.study(driver.step_id)
    assert [t.state for t in trials] == [TrialState.COMPLETED, TrialState.FAILED, TrialState.COMPLETED,
                                         TrialState.COMPLETED]
    assert study.state == StudyState.COMPLETED and study.decision.search_s == pytest.approx(2.0 + 2.0)  # lost, counted
    assert list(trials[2].variants)[2].startswith("r3-attn_out-")  # the next role: qkv's round was lost
    assert study.decision.variant == "always-ring" and study.decision.rounds == 3


def test_a_step_study_with_one_round_times_the_menu_in_one_trial(store):
    driver = StepDriver(store, search_rounds=1)
    trial = driver.claim(driver.step_id)
    with store.transaction() as tx:
        task = task_for(tx.study(driver.step_id), trial)
    assert trial.variants is None and task.step.variants is None and task.step.ablation


def tx_overrides(tx, store):
    """The overrides the engine saved for the tiny model (the store's own reading of them)."""
    if isinstance(store, InMemoryStore):
        return list(store._overrides.values())
    return tx.catalog.overrides(model="tiny", hardware=HW)


# --- bounds: timed with the confirmation, stored on its trial and on the tuned config ---------------


def bounds_of(problem: Problem = PROBLEM, compute=0.5e-3, communication=0.3e-3, baseline=1e-3,
              status: Status = Status.OK) -> BoundsMeasurement:
    if status != Status.OK:
        return BoundsMeasurement(problem=problem, hardware=HW, status=status, message="boom")
    return BoundsMeasurement(problem=problem, hardware=HW, status=status, compute=Timing.of([compute] * 3),
                             communication=Timing.of([communication] * 3), baseline=Timing.of([baseline] * 3))


def confirm_with(driver: Driver, study_id: int, bounds: BoundsMeasurement | None, ratio=None):
    """Run the search, then report the confirmation with ``bounds`` (every ring at ``ratio`` if given)."""
    while (trial := driver.claim(study_id)).kind == TrialKind.SEARCH:
        driver.report(trial)
    results = [measured(c, ratio=ratio if ratio and c.method == "ring" else None) for c in trial.decompositions]
    with driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, trial.id, ConfirmResult(measurements=results, bounds=bounds), now=driver.tick())
    return trial


def test_a_confirmations_bounds_are_stored_on_its_trial_and_the_tuned_config(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=4, confirm_top=2))
    trial = confirm_with(driver, study_id, bounds_of())
    study, trials = driver.study(study_id)
    assert trials[-1].id == trial.id and trials[-1].bounds == bounds_of()
    with driver.store.transaction() as tx:
        assert tx.trial(trial.id).bounds == bounds_of()
        assert all(t.bounds is None for t in tx.trials(study_id))  # read with the measurements only
    tuned = driver.tuned(study_id)
    assert (tuned.compute_s, tuned.communication_s, tuned.bounds_baseline_s) == (0.5e-3, 0.3e-3, 1e-3)
    assert tuned.bound_s == 0.5e-3 and tuned.ring
    # the winner's compiled program as its confirmation compiled it: its schedule's verdict and memory
    winner = next(m for m in trials[-1].measurements if m.decomposition == tuned.decomposition)
    assert (tuned.overlap, tuned.memory_bytes) == ("partly", winner.memory_bytes)
    assert tuned.memory_bytes == (1 << 20) + 4096 * tuned.decomposition.chunks
    assert tuned.hidden_fraction == pytest.approx((1 - tuned.time_s / tuned.baseline_s) / 0.5)
    assert study.message is None  # a ring won: the tuned config says how much it hid


def test_a_study_the_baseline_won_says_why_from_its_bounds(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=4, confirm_top=2))
    confirm_with(driver, study_id, bounds_of(compute=0.6e-3, communication=0.35e-3), ratio=1.1)
    study, _ = driver.study(study_id)
    tuned = driver.tuned(study_id)
    assert not tuned.ring and tuned.hidden_fraction == 0.0
    assert study.message.startswith("no ring won: the ring's steps cost more than the transfer they hide")
    assert "0.91x" in study.message  # the best ring of the round


def test_failed_or_missing_bounds_leave_the_config_without_them(store):
    driver = Driver(store)
    first = driver.create(settings(max_trials=3, confirm_top=1))
    confirm_with(driver, first, bounds_of(status=Status.OOM), ratio=1.2)
    tuned = driver.tuned(first)
    assert tuned.bounds is None and tuned.hidden_fraction is None
    study, trials = driver.study(first)
    assert trials[-1].bounds.status == Status.OOM
    assert study.message.startswith("no ring won: no bounds were measured")


def test_bounds_must_be_of_the_studys_problem_and_come_with_a_confirmation(store):
    driver = Driver(store)
    study_id = driver.create(settings(max_trials=3, confirm_top=1))
    trial = driver.claim(study_id)
    with pytest.raises(InvalidError, match="bounds come with a confirmation only"), \
            driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, trial.id, ConfirmResult(measurements=[measured(trial.decomposition)],
                                                         bounds=bounds_of()), now=driver.tick())
    driver.report(trial)
    while (trial := driver.claim(study_id)).kind == TrialKind.SEARCH:
        driver.report(trial)
    other = bounds_of(problem=Problem.parse("ag:512x64x128:float32:8"))
    with pytest.raises(InvalidError, match="its bounds are for allgather_matmul:512x64x128"), \
            driver.store.transaction(write=True) as tx:
        driver.engine.record(tx, trial.id, ConfirmResult(measurements=[measured(c) for c in trial.decompositions],
                                                         bounds=other), now=driver.tick())
