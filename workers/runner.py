"""Running trials on this process's devices (or its group's): the runner, its watchdog, what a follower of
a group does, and the one record of a trial that could not run.

In a multi-process group only process 0 decides: it hands each trial to the others
(`cmtune.workers.cluster.Group`), and all of them run it together as one SPMD program.  No decision can
depend on one process's timings, because no other process decides anything.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Protocol

from cmtune.workers.cluster import EXIT_HUNG
from collective_matmul.planning.problem import Problem
from collective_matmul.planning.text import as_message
from collective_matmul.wire import (
    BoundsMeasurement,
    GroupMessage,
    MeasurementProtocol,
    Status,
    StepResult,
    TrialKind,
    TrialResult,
    TrialTask,
    result_of,
)


class Runner(Protocol):
    def run(self, task: TrialTask) -> TrialResult:
        """Time every decomposition of ``task`` (a confirmation: then the problem's bounds too), or its step;
        failures come back as measurement statuses."""
        ...


log = logging.getLogger("cmtune.worker")


class LocalRunner:
    """Times trials on this process's devices (its group's): a problem on every ring of its size they split into,
    all at once, unless ``mesh`` and ``axis`` say which (`OpSession`); keeps one `OpSession` (inputs, compiled
    baseline) at a time.

    Nothing a trial does stops the runner: inputs that would not fit (checked before anything is
    allocated), a failed allocation, a compile error, a crash of the program all come back as
    measurement statuses (``oom``, ``error``, ...) of the trial's candidates.
    """

    def __init__(self, **session_kwargs):
        self._sessions: dict[tuple, object] = {}
        self._session_kwargs = session_kwargs
        self._memory: int | None = None

    def session(self, problem: Problem, protocol: MeasurementProtocol):
        from cmtune.workers.measure import OpSession

        key = (problem.key, protocol.seed)
        if key not in self._sessions:
            self._sessions.clear()  # one problem's inputs at a time
            self._sessions[key] = OpSession(problem, protocol=protocol, **self._session_kwargs)
        return self._sessions[key]

    @property
    def device_memory(self) -> int | None:
        """Bytes one local device may use (cached; see `cmtune.workers.measure.device_memory`)."""
        if self._memory is None:
            from cmtune.workers.measure import device_memory

            self._memory = device_memory()
        return self._memory

    def run(self, task: TrialTask) -> TrialResult:
        """A search trial's measurement, a confirmation's (every contender, then the problem's bounds) or a step
        trial's.  Every process of a group takes the same path: nothing here depends on a result."""
        from cmtune.workers.measure import classify_failure

        if task.kind == TrialKind.STEP:
            return self._run_step(task)
        needed, memory = task.problem.device_bytes, self.device_memory
        if memory is not None and needed > memory:
            message = (f"inputs need {needed / 2**30:.1f} GiB per device, the device has {memory / 2**30:.1f} GiB: "
                       "nothing was allocated")
            return failed(task, Status.OOM, message)
        try:
            session = self.session(task.problem, task.protocol)
        except Exception as exc:  # noqa: BLE001 - the inputs or the baseline could not be built: a result
            self._sessions.clear()
            message = f"preparing the inputs and the baseline failed: {type(exc).__name__}: {exc}"[:2000]
            return failed(task, classify_failure(exc), message)
        measured = [session.measure(config, task.protocol) for config in task.decompositions]
        bounds = session.bounds(task.protocol) if task.kind == TrialKind.CONFIRM else None
        return result_of(task.kind, measured, bounds)

    def _run_step(self, task: TrialTask) -> StepResult:
        """The whole training step (`cmtune.workers.step`); a setup failure is a failed measurement.

        The step's session (parameters, inputs, compiled programs) is kept for the next trial of the
        same step: the rounds of a step search time the reference and the incumbent again.
        """
        from cmtune.workers.measure import classify_failure, error_message
        from cmtune.workers.step import run_step, step_session, step_session_key

        key = ("step", *step_session_key(task))
        if key not in self._sessions:
            self._sessions.clear()  # a step needs the memory more than a problem's cached inputs
        try:
            session = self._sessions.get(key) or step_session(task)
            self._sessions[key] = session
            return StepResult(step=run_step(task, session))
        except Exception as exc:  # noqa: BLE001 - the block could not be set up here: a result
            self._sessions.clear()
            return failed(task, classify_failure(exc), error_message(exc))


def failed(task: TrialTask, status: Status, message: str) -> TrialResult:
    """The result of a trial that could not be run at all, of its kind: every candidate failed with ``status``
    (a confirmation's bounds with them), or a step trial's reference and tuned step."""
    from cmtune.workers.measure import failure

    if task.kind == TrialKind.STEP:
        from cmtune.workers.step import failed_step

        return StepResult(step=failed_step(task, status, message))
    records = [failure(task.problem, c, task.protocol, status, message) for c in task.decompositions]
    bounds = BoundsMeasurement(problem=task.problem, hardware=records[0].hardware, status=status,
                               message=as_message(message, 2000), protocol=task.protocol,
                               ) if task.kind == TrialKind.CONFIRM else None
    return result_of(task.kind, records, bounds)


class Watchdog:
    """Ends this process if the trial in hand overruns its deadline.

    A collective that never completes blocks its thread inside XLA, where no signal handler runs;
    this timer thread still does, and ``os._exit`` ends the process at once (a group's launcher
    then kills the others, and a lease that stops being extended expires).

    Args:
        seconds: the deadline, from `__enter__`.
        what: says in the log what hung.
        on_overrun: called first (e.g. to stop extending the trial's lease).
    """

    def __init__(self, seconds: float, what: str, on_overrun: Callable[[], None] | None = None):
        self.seconds, self.what, self.on_overrun = seconds, what, on_overrun
        self._timer: threading.Timer | None = None

    @staticmethod
    def deadline(task: TrialTask, grace_s: float) -> float:
        """Seconds a trial may take: twice each candidate's (or step variant's) timing budget (and a confirmation's
        bounds rounds'), plus ``grace_s``."""
        variants = len(task.step.variants or ()) if task.step is not None else 0
        timed = max(len(task.decompositions) + (task.kind == TrialKind.CONFIRM), variants)
        return timed * 2 * task.protocol.timeout_s + grace_s

    def _fire(self) -> None:
        if self.on_overrun is not None:
            self.on_overrun()
        message = f"{self.what} hung: no result after {self.seconds:.0f} s; ending this process"
        log.error(message)
        print(f"cmtune: {message}", file=sys.stderr, flush=True)
        os._exit(EXIT_HUNG)

    def __enter__(self) -> Watchdog:
        self._timer = threading.Timer(self.seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()


def follow(group, runner: Runner, *, grace_s: float = 120.0) -> int:
    """Processes other than 0: run every trial process 0 hands over, until it says stop.

    Only process 0's results count; an error in this process's own record of a trial is logged
    and the next trial follows (the programs themselves ran in step with process 0's).  Each trial runs under
    the watchdog process 0 has (`Watchdog.deadline`): a trial hung here ends this process as it would end
    process 0, and with it the group, whoever started it.
    """
    done = 0
    while True:
        message = group.receive(GroupMessage)
        if message.kind == "stop":
            return done
        if message.kind == "trial":
            task = message.task
            what = f"trial {task.id} on process {group.index} (following process 0)"
            with Watchdog(Watchdog.deadline(task, grace_s), what):
                try:
                    runner.run(task)
                except Exception:  # noqa: BLE001 - see above
                    log.exception("this process's record of trial %s failed", task.id)
            done += 1
