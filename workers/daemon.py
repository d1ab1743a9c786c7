"""The worker daemon: register, heartbeat in the side, lease, measure, report, repeat.

Like procrastinate's worker loop: one main loop that claims and runs, a side thread that keeps
the worker (and its current lease) alive, a stop event set by SIGTERM/Ctrl-C, and a graceful
finish: the trial in hand is finished and reported (a second signal gives it back at once),
then the worker unregisters.  A hard crash is recovered by lease expiry on the service.

On a multi-host group (`jax.distributed`), process 0 alone talks to the service and hands every
trial to the others with a broadcast; all of them run it (an SPMD program), and process 0
reports the slowest process's time (the measurement protocol takes the max across processes).

Nothing a trial does ends the daemon: failures come back as results (the runner's statuses, or
``error`` for anything else).  A trial that hangs (a collective that never completes) is
ended by a watchdog: heartbeats stop extending its lease and the process exits at once with
`EXIT_HUNG`; the lease then expires (the attempt counts) and the supervisor restarts the
worker: docker's restart policy, systemd, or `supervise` (``cmtune worker --restart``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from cmtune.workers.cluster import EXIT_HUNG, Group
from cmtune.workers.runner import LocalRunner, Watchdog, failed, follow
from collective_matmul.client.rest import ApiClient, ApiError, Conflict, Invalid, NotRegistered
from collective_matmul.planning.problem import Hardware, Software
from collective_matmul.wire import (
    BoundsMeasurement,
    GroupMessage,
    HardwareIn,
    LeaseGranted,
    Measurement,
    ResultIn,
    Status,
    TrialKind,
    TrialTask,
    WorkerCreate,
)

EXIT_CRASHED = 70  # the daemon failed outside any trial's protocol (its supervisor restarts it)
SIGNAL_ECHO_S = 1.0  # a signal this soon after the first is the same one, passed on by a launcher
PATIENCE_S = 600.0  # how long a call waits for a service that is away, restarting or overloaded

log = logging.getLogger("cmtune.worker")


@dataclass
class WorkerState:
    worker_id: int | None = None
    lease_id: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    abort: threading.Event = field(default_factory=threading.Event)
    trials_done: int = 0


class WorkerDaemon:
    """One worker (process 0 of its group, or the only process)."""

    def __init__(self, server: str, token: str | None, *, name: str | None = None, poll_s: float = 2.0,
                 heartbeat_s: float = 10.0, max_trials: int | None = None, exit_when_idle: bool = False,
                 grace_s: float = 120.0):
        self.api = ApiClient(server, token, timeout=30, patience_s=PATIENCE_S)
        self.name = name or socket.gethostname()
        self.poll_s, self.heartbeat_s, self.grace_s = poll_s, heartbeat_s, grace_s
        self.max_trials, self.exit_when_idle = max_trials, exit_when_idle
        self.state = WorkerState()
        self._runner = LocalRunner()
        self._group = Group()

    # -- lifecycle -----------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        first: list[float] = []

        def on_signal(signum, _frame):
            # A signal to the whole process group (Ctrl-C in a terminal, `kill -- -PGID`) reaches a process of a
            # group twice: from the sender and passed on by its launcher.  Only a second signal a while after
            # the first means "now": an interrupt inside a collective would leave the others waiting in it.
            if first and time.monotonic() - first[0] > SIGNAL_ECHO_S:
                log.warning("second %s: giving the current trial back now", signal.Signals(signum).name)
                self.state.abort.set()
                raise KeyboardInterrupt
            if not first:
                first.append(time.monotonic())
                log.info("%s: finishing the current trial, then leaving", signal.Signals(signum).name)
            self.state.stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run(self) -> int:
        """Serve until stopped; returns the number of trials done."""
        hardware = Hardware.detect()
        if not self._group.leader:
            return follow(self._group, self._runner, grace_s=self.grace_s)
        idle_since = time.monotonic()
        try:
            self.register(hardware)
            threading.Thread(target=self._heartbeats, name="cmtune-heartbeat", daemon=True).start()
            grant = None  # a trial leased with the last result (a lease the daemon leaves with is given back)
            while not self.state.stop.is_set():
                if self.max_trials is not None and self.state.trials_done >= self.max_trials:
                    break
                grant = grant or self.lease()
                if grant is None:
                    if self.exit_when_idle and time.monotonic() - idle_since > max(self.poll_s * 3, 5.0):
                        break
                    self._group.send(GroupMessage(kind="idle"))
                    self.state.stop.wait(self.poll_s)
                    continue
                idle_since = time.monotonic()
                grant = self.run_trial(grant)
        except KeyboardInterrupt:
            log.warning("interrupted; the current trial goes back to the queue")
        except Exception:
            # A bug or a lost service: the group's other processes may be inside a collective of the
            # trial in hand, so end at once; the lease expires (the attempt counts), the supervisor
            # restarts the worker.
            log.exception("the worker failed; its lease will expire and the trial will be leased again")
            logging.shutdown()
            os._exit(EXIT_CRASHED)
        finally:
            self._group.send(GroupMessage(kind="stop"))
            self.unregister()
        return self.state.trials_done

    def register(self, hardware: Hardware) -> None:
        """Register (again); every later call carries the worker credential the answer holds."""
        body = WorkerCreate(name=self.name, hardware=HardwareIn.of(hardware), memory_bytes=self._runner.device_memory,
                            software=hardware.software or Software(jax=hardware.jax_version,
                                                                   jaxlib=hardware.jaxlib_version))
        registered = self.api.register(body)
        self.state.worker_id = registered.id
        memory = registered.memory_bytes
        log.info("registered as worker %s on %s (%s)", registered.id, hardware.key,
                 f"{memory / 2**30:.1f} GiB per device" if memory else "device memory unknown")

    def unregister(self) -> None:
        if self.state.worker_id is None:
            return
        try:
            self.api.unregister(self.state.worker_id)
            log.info("unregistered worker %s after %d trials", self.state.worker_id, self.state.trials_done)
        except ApiError as exc:
            log.warning("could not unregister (%s); the service will expire the lease", exc)

    def _heartbeats(self) -> None:
        while not self.state.stop.wait(self.heartbeat_s):
            if self.state.abort.is_set():
                return  # a trial overran: its lease must expire, not be extended
            try:
                self.api.heartbeat(self.state.worker_id, self.state.lease_id)
            except ApiError as exc:
                log.warning("heartbeat failed: %s", exc)

    # -- trials --------------------------------------------------------------------------------

    def lease(self) -> LeaseGranted | None:
        try:
            return self.api.lease(self.state.worker_id)
        except NotRegistered as exc:  # the service forgot us (a fresh database, a revoked credential)
            log.warning("lease refused (%s): registering again", exc.detail)
            self.register(Hardware.detect())
            return None

    def run_trial(self, grant: LeaseGranted) -> LeaseGranted | None:
        """Run a leased trial and report it; returns the next trial, leased with the result (one request)
        unless the daemon is leaving or has done its ``max_trials``."""
        task = grant.trial
        self.state.lease_id = grant.lease.id
        self._group.send(GroupMessage(kind="trial", task=task))
        what = f"trial {task.id} ({describe(task)})"
        with Watchdog(Watchdog.deadline(task, self.grace_s), what, on_overrun=self.state.abort.set):
            try:
                result = self._runner.run(task)
            except Exception as exc:  # noqa: BLE001 - anything the runner lets through is still a result
                log.exception("%s failed outside the measurement protocol", what)
                result = failed(task, Status.ERROR, f"{type(exc).__name__}: {exc}")
        last = self.max_trials is not None and self.state.trials_done + 1 >= self.max_trials
        more = not (self.state.stop.is_set() or last)
        body = ResultIn.of(grant.lease.id, result, lease_next=more)
        try:
            answer = self.api.result(task.id, body)
        except (Conflict, Invalid) as exc:
            log.warning("trial %s: result refused (%s)", task.id, exc.detail)
            return None
        finally:
            self.state.lease_id = None
        self.state.trials_done += 1
        if result.kind == TrialKind.STEP:
            for v in result.step.variants:
                log.info("trial %s study %s step of %s, %s: %s", task.id, task.study_id, task.step.block.name,
                         v.name, f"{v.speedup:.2f}x the step as written" if v.ok and v.speedup else
                         f"{v.status} {v.message[:200]}")
        else:
            for m in result.measurements:
                log.info("trial %s study %s %s %s: %s", task.id, task.study_id, m.problem.key, m.decomposition.id,
                         _summary(m))
            if result.kind == TrialKind.CONFIRM and result.bounds is not None:
                log.info("trial %s study %s %s bounds: %s", task.id, task.study_id, task.problem.key,
                         _bounds_summary(result.bounds))
        return answer.next


def describe(task: TrialTask) -> str:
    """What a trial runs, for the log: the problem and candidates, or the model's step."""
    if task.kind == TrialKind.STEP:
        variants = task.step.variants
        what = f"{len(variants)} variants of the step search" if variants is not None else "the standard menu"
        return f"the step of {task.step.block.name} on {task.step.mesh}: {what}"
    return f"{task.problem.key}: {', '.join(d.id for d in task.decompositions)}"


def supervise(argv: list[str], *, max_backoff_s: float = 60.0) -> int:
    """Run ``python argv`` and start it again whenever it exits with an error (a crash, a hung trial).

    It ends when the child ends cleanly (exit 0: stopped, idle, or done) or on SIGTERM/SIGINT,
    which it passes on.  Waits 1, 2, 4, ... up to ``max_backoff_s`` seconds between starts,
    back to 1 after a child that lived a minute.
    """
    stopping = threading.Event()
    child: subprocess.Popen | None = None

    def forward(signum, _frame):
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    backoff = 1.0
    while True:
        started = time.monotonic()
        child = subprocess.Popen([sys.executable, *argv], env=os.environ | {"CMTUNE_SUPERVISED": "1"})
        code = child.wait()
        if code == 0 or stopping.is_set():
            return code
        backoff = 1.0 if time.monotonic() - started > 60 else min(backoff * 2, max_backoff_s)
        reason = "its trial hung" if code == EXIT_HUNG else f"exit status {code}"
        log.warning("worker exited (%s); starting it again in %.0f s", reason, backoff)
        if stopping.wait(backoff):
            return code


def _bounds_summary(b: BoundsMeasurement) -> str:
    if not b.ok:
        return f"{b.status}: {b.message[:200]}"
    return (f"compute {b.compute.median_s * 1e3:.3f} ms, communication {b.communication.median_s * 1e3:.3f} ms, "
            f"baseline {b.baseline.median_s * 1e3:.3f} ms")


def _summary(m: Measurement) -> str:
    if not m.ok:
        return f"{m.status}: {m.message[:200]}"
    return (f"{m.candidate.median_s * 1e3:.3f} ms vs baseline {m.baseline.median_s * 1e3:.3f} ms, "
            f"speedup {m.speedup:.2f}x")
