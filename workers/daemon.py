"""The worker daemon: register, heartbeat in the side, lease, measure, report, repeat.

Like procrastinate's worker loop: one main loop that claims and runs, a side thread that keeps
the worker (and its current lease) alive, a stop event set by SIGTERM/Ctrl-C, and a graceful
finish: the trial in hand is finished and reported (a second signal gives it back at once),
then the worker unregisters.  A hard crash is recovered by lease expiry on the service.

On a multi-host group (`jax.distributed`), process 0 alone talks to the service and hands every
trial to the others with a broadcast; all of them run it (an SPMD program), and process 0
reports the slowest process's time (the measurement protocol takes the max across processes).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
from tenacity import retry, retry_if_exception, stop_after_delay, wait_exponential

from cmtune.tuner.cluster import Group
from cmtune.tuner.local import LocalRunner, follow
from collective_matmul.problem import Hardware
from collective_matmul.wire import HardwareIn, LeaseGranted, Measurement, ResultIn, WorkerCreate, WorkerPublic

log = logging.getLogger("cmtune.worker")


def _transient(exc: BaseException) -> bool:
    """Worth retrying: the service is away, restarting or overloaded."""
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (502, 503, 504)


class ServiceClient:
    """The worker's HTTP calls; transient failures are retried with exponential backoff."""

    def __init__(self, server: str, token: str | None, *, patience_s: float = 600):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=30)
        self.patience_s = patience_s

    def call(self, method: str, path: str, **kwargs) -> httpx.Response:
        @retry(retry=retry_if_exception(_transient), wait=wait_exponential(multiplier=0.5, max=15),
               stop=stop_after_delay(self.patience_s), reraise=True,
               before_sleep=lambda state: log.warning("service unreachable (%s); retrying",
                                                      state.outcome.exception()))
        def once() -> httpx.Response:
            response = self.http.request(method, path, **kwargs)
            if response.status_code >= 500:
                response.raise_for_status()
            return response

        return once()


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
                 heartbeat_s: float = 10.0, max_trials: int | None = None, exit_when_idle: bool = False):
        self.client = ServiceClient(server, token)
        self.name = name or socket.gethostname()
        self.poll_s, self.heartbeat_s = poll_s, heartbeat_s
        self.max_trials, self.exit_when_idle = max_trials, exit_when_idle
        self.state = WorkerState()
        self._runner = LocalRunner()
        self._group = Group()

    # -- lifecycle -----------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        def on_signal(signum, _frame):
            if self.state.stop.is_set():
                log.warning("second %s: giving the current trial back now", signal.Signals(signum).name)
                self.state.abort.set()
                raise KeyboardInterrupt
            log.info("%s: finishing the current trial, then leaving", signal.Signals(signum).name)
            self.state.stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run(self) -> int:
        """Serve until stopped; returns the number of trials done."""
        hardware = Hardware.detect()
        if not self._group.leader:
            return follow(self._group, self._runner)
        idle_since = time.monotonic()
        try:
            self.register(hardware)
            threading.Thread(target=self._heartbeats, name="cmtune-heartbeat", daemon=True).start()
            while not self.state.stop.is_set():
                if self.max_trials is not None and self.state.trials_done >= self.max_trials:
                    break
                grant = self.lease()
                if grant is None:
                    if self.exit_when_idle and time.monotonic() - idle_since > max(self.poll_s * 3, 5.0):
                        break
                    self._group.send({"kind": "idle"})
                    self.state.stop.wait(self.poll_s)
                    continue
                idle_since = time.monotonic()
                self.run_trial(grant)
        except KeyboardInterrupt:
            log.warning("interrupted; the current trial goes back to the queue")
        finally:
            self._group.send({"kind": "stop"})
            self.unregister()
        return self.state.trials_done

    def register(self, hardware: Hardware) -> None:
        body = WorkerCreate(name=self.name, hardware=HardwareIn.of(hardware),
                            software={"jax": hardware.jax_version, "jaxlib": hardware.jaxlib_version})
        response = self.client.call("POST", "/v1/workers", json=body.model_dump(mode="json"))
        response.raise_for_status()
        self.state.worker_id = WorkerPublic.model_validate(response.json()).id
        log.info("registered as worker %s on %s", self.state.worker_id, hardware.key)

    def unregister(self) -> None:
        if self.state.worker_id is None:
            return
        try:
            self.client.http.delete(f"/v1/workers/{self.state.worker_id}")
            log.info("unregistered worker %s after %d trials", self.state.worker_id, self.state.trials_done)
        except httpx.HTTPError as exc:
            log.warning("could not unregister (%s); the service will expire the lease", exc)

    def _heartbeats(self) -> None:
        while not self.state.stop.wait(self.heartbeat_s):
            try:
                self.client.http.post(f"/v1/workers/{self.state.worker_id}/heartbeat",
                                      json={"lease_id": self.state.lease_id})
            except httpx.HTTPError as exc:
                log.warning("heartbeat failed: %s", exc)

    # -- trials --------------------------------------------------------------------------------

    def lease(self) -> LeaseGranted | None:
        response = self.client.call("POST", f"/v1/workers/{self.state.worker_id}/lease")
        if response.status_code == 404:  # the service forgot us (e.g. a fresh database): join again
            self.register(Hardware.detect())
            return None
        if response.status_code == 204:
            return None
        response.raise_for_status()
        return LeaseGranted.model_validate(response.json())

    def run_trial(self, grant: LeaseGranted) -> None:
        task = grant.trial
        self.state.lease_id = grant.lease.id
        self._group.send({"kind": "trial", "task": task.model_dump(mode="json")})
        results = self._runner.run(task)
        body = ResultIn.of(grant.lease.id, task.kind, results)
        response = self.client.call("POST", f"/v1/trials/{task.id}/result", json=body.model_dump(mode="json"))
        self.state.lease_id = None
        if response.status_code == 409:
            log.warning("trial %s: result refused (%s)", task.id, response.json().get("detail"))
            return
        response.raise_for_status()
        self.state.trials_done += 1
        for m in results:
            log.info("trial %s study %s %s %s: %s", task.id, task.study_id, m.problem.key, m.decomposition.id,
                     _summary(m))


def _summary(m: Measurement) -> str:
    if not m.ok:
        return f"{m.status}: {m.message[:200]}"
    return (f"{m.candidate.median_s * 1e3:.3f} ms vs baseline {m.baseline.median_s * 1e3:.3f} ms, "
            f"speedup {m.speedup:.2f}x")
