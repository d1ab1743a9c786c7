"""`cmtune tune` over the engine: the study engine over an in-memory store, its trials run on this
process's devices by a `cmtune.workers.runner.LocalRunner`.  In a multi-process group only process 0
runs the engine and hands each trial to the others (`cmtune.workers.runner.follow`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cmtune.tuner.engine import Engine, task_for
from cmtune.tuner.search import SearchSettings
from cmtune.tuner.store import InMemoryStore, StudyRecord, TrialRecord, utcnow
from cmtune.tuner.warm import Known, best_ring
from cmtune.workers.runner import Runner, Watchdog
from collective_matmul.planning.problem import Hardware, Problem
from collective_matmul.wire import GroupMessage, MeasurementProtocol, TrialKind
from collective_matmul.wire.bundle import TunedConfig


@dataclass(frozen=True)
class Outcome:
    """One finished study of a local run."""

    study: StudyRecord
    trials: list[TrialRecord]
    tuned: TunedConfig | None

    @property
    def search(self) -> list[TrialRecord]:
        return [t for t in self.trials if t.kind == TrialKind.SEARCH and t.finished_at is not None]

    def known(self) -> Known | None:
        """This study as the warm start of a later one (`cmtune.tuner.warm`); None if it tuned nothing."""
        if self.tuned is None:
            return None
        ring, ratio = best_ring(self.trials) or (None, None)
        return Known(self.tuned, ring, ratio, source="local")


class LocalTuner:
    """The engine over an in-memory store, trials run by ``runner`` (process 0 of a group decides).

    Args:
        runner: times the trials (a `LocalRunner`, or a test double).
        group: the process group (None alone); process 0 sends each trial to the others.
        on_trial: called with each finished trial (progress display).
    """

    def __init__(self, runner: Runner, *, group=None, engine: Engine | None = None,
                 on_trial: Callable[[TrialRecord], None] | None = None, clock=utcnow, grace_s: float = 120.0):
        self.runner, self.group, self.on_trial, self.clock = runner, group, on_trial, clock
        self.grace_s = grace_s
        self.engine = engine or Engine(ready=1)
        self.store = InMemoryStore()

    def tune(self, problem: Problem, hardware: Hardware, settings: SearchSettings,
             protocol: MeasurementProtocol) -> Outcome:
        """Run one study to its end; returns the study, its trials and its tuned config."""
        with self.store.transaction(write=True) as tx:
            study = self.engine.create_study(tx, problem=problem, hardware=hardware, settings=settings,
                                             protocol=protocol, now=self.clock())
        while True:
            with self.store.transaction(write=True) as tx:
                trial = self.engine.claim(tx, study_ids=[study.id], now=self.clock())
                current = tx.study(study.id)
            if trial is None:
                if current.state.active:
                    raise RuntimeError(f"study {study.id} is {current.state} with no trial to run")
                break
            task = task_for(current, trial)
            if self.group is not None:
                self.group.send(GroupMessage(kind="trial", task=task))
            what = f"{problem.key}: trial {trial.number} ({', '.join(d.id for d in task.decompositions)})"
            with Watchdog(Watchdog.deadline(task, self.grace_s), what):
                result = self.runner.run(task)
            with self.store.transaction(write=True) as tx:
                finished = self.engine.record(tx, trial.id, result, now=self.clock())
            if self.on_trial is not None:
                self.on_trial(finished)
        with self.store.transaction() as tx:
            study = tx.study(study.id)
            return Outcome(study, tx.trials(study.id, measurements=True), tx.tuned_config(problem, study.hardware))

    def stop(self) -> None:
        """Release the other processes of the group (call once, after the last study)."""
        if self.group is not None:
            self.group.send(GroupMessage(kind="stop"))
