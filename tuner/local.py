"""Running trials on this process's devices (or its group's), and `cmtune tune` over the engine.

`cmtune tune` is the study engine over an in-memory store with a local runner.  In a
multi-process group only process 0 runs the engine: it decides every trial and hands each to
the others (`cmtune.tuner.cluster.Group`), and all of them run it together as one SPMD program.
No decision can depend on one process's timings, because no other process decides anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol as TypingProtocol

from cmtune.tuner.engine import Engine, task_for
from cmtune.tuner.search import SearchSettings
from cmtune.tuner.store import InMemoryStore, StudyRecord, TrialRecord, utcnow
from collective_matmul.bundle import TunedConfig
from collective_matmul.problem import Hardware, Problem
from collective_matmul.wire import Measurement, Protocol, TrialKind, TrialTask


class Runner(TypingProtocol):
    def run(self, task: TrialTask) -> list[Measurement]:
        """Time every decomposition of ``task``; failures come back as measurement statuses."""
        ...


class LocalRunner:
    """Times trials on this process's devices; keeps one `Session` (inputs, compiled baseline) at a time."""

    def __init__(self, **session_kwargs):
        self._sessions: dict[tuple[str, int], object] = {}
        self._session_kwargs = session_kwargs

    def session(self, problem: Problem, protocol: Protocol):
        from cmtune.tuner.measure import Session

        key = (problem.key, protocol.seed)
        if key not in self._sessions:
            self._sessions.clear()  # one problem's inputs at a time
            self._sessions[key] = Session(problem, protocol=protocol, **self._session_kwargs)
        return self._sessions[key]

    def run(self, task: TrialTask) -> list[Measurement]:
        session = self.session(task.problem, task.protocol)
        return [session.measure(config, task.protocol) for config in task.decompositions]


def follow(group, runner: Runner) -> int:
    """Processes other than 0: run every trial process 0 hands over, until it says stop."""
    done = 0
    while True:
        message = group.receive()
        if message["kind"] == "stop":
            return done
        if message["kind"] == "trial":
            runner.run(TrialTask.model_validate(message["task"]))
            done += 1


@dataclass(frozen=True)
class Outcome:
    """One finished study of a local run."""

    study: StudyRecord
    trials: list[TrialRecord]
    tuned: TunedConfig | None

    @property
    def search(self) -> list[TrialRecord]:
        return [t for t in self.trials if t.kind == TrialKind.SEARCH and t.finished_at is not None]


class LocalTuner:
    """The engine over an in-memory store, trials run by ``runner`` (process 0 of a group decides).

    Args:
        runner: times the trials (a `LocalRunner`, or a test double).
        group: the process group (None alone); process 0 sends each trial to the others.
        on_trial: called with each finished trial (progress display).
    """

    def __init__(self, runner: Runner, *, group=None, engine: Engine | None = None,
                 on_trial: Callable[[TrialRecord], None] | None = None, clock=utcnow):
        self.runner, self.group, self.on_trial, self.clock = runner, group, on_trial, clock
        self.engine = engine or Engine(ready=1)
        self.store = InMemoryStore()

    def tune(self, problem: Problem, hardware: Hardware, settings: SearchSettings, protocol: Protocol) -> Outcome:
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
                self.group.send({"kind": "trial", "task": task.model_dump(mode="json")})
            results = self.runner.run(task)
            with self.store.transaction(write=True) as tx:
                finished = self.engine.record(tx, trial.id, results, now=self.clock())
            if self.on_trial is not None:
                self.on_trial(finished)
        with self.store.transaction() as tx:
            study = tx.study(study.id)
            return Outcome(study, tx.trials(study.id, measurements=True),
                           self.store.tuned.get((problem.key, study.hardware.key)))

    def stop(self) -> None:
        """Release the other processes of the group (call once, after the last study)."""
        if self.group is not None:
            self.group.send({"kind": "stop"})
