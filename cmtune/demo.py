"""`cmtune demo`: a service, a local worker and the tiny preset, end to end, on this machine.

The demo drives both parts only through their public commands and the REST API: tokens from
`cmtune token create`, the service from `cmtune serve`, the worker from `cmtune worker` (its
token in the environment, never on a command line).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cmtune.service.launcher import running_server, stop
from collective_matmul.wire import (
    Budget,
    HardwareIn,
    MeshIn,
    StudyCreate,
    StudyCreated,
    StudyPage,
    SubmissionPublic,
)

DEVICES = 8


def make_tokens(database_url: str) -> dict[str, str]:
    """One token per role, from `cmtune token create` (which also creates the SQLite schema)."""
    env = os.environ | {"CMTUNE_DATABASE_URL": database_url}
    tokens = {}
    for role in ("admin", "worker", "reader"):
        run = subprocess.run([sys.executable, "-m", "cmtune.service", "token", "create", "--role", role,
                              "--name", f"demo-{role}"], env=env, capture_output=True, text=True, check=True)
        tokens[role] = run.stdout.strip().splitlines()[-1]
    return tokens


def run_demo(directory: Path, *, trials: int, port: int | None, keep_serving: bool, console: Console) -> None:
    url = f"sqlite:///{directory / 'cmtune.sqlite'}"
    tokens = make_tokens(url)
    console.print(f"service database: {directory / 'cmtune.sqlite'}")
    with running_server(database_url=url, port=port) as server:
        worker = subprocess.Popen(
            [sys.executable, "-m", "cmtune.workers", "worker", "--server", server.url, "--devices",
             f"virtual:{DEVICES}", "--name", "demo-worker", "--poll-seconds", "0.5", "--heartbeat-seconds", "5"],
            env=os.environ | {"CMTUNE_TOKEN": tokens["worker"]},
            stdout=open(directory / "worker.log", "w"), stderr=subprocess.STDOUT,
        )
        try:
            with httpx.Client(base_url=server.url, timeout=60,
                              headers={"Authorization": f"Bearer {tokens['admin']}"}) as api:
                body = StudyCreate(model="tiny", mesh=MeshIn(axes={"data": 1, "model": DEVICES}),
                                   hardware=HardwareIn(platform="cpu", device_kind="cpu", device_count=DEVICES),
                                   budget=Budget(trials=trials))
                response = api.post("/v1/studies", json=body.model_dump(mode="json", exclude_none=True))
                response.raise_for_status()
                created = StudyCreated.model_validate(response.json())
                console.print(f"submitted the tiny preset on a 1x{DEVICES} mesh: submission {created.submission_id}, "
                              f"{len(created.studies)} studies; worker log: {directory / 'worker.log'}")
                _follow(api, worker, console)
                console.print(_table(api, created.submission_id))
            console.print(f"dashboard: {server.url}/ui/submissions/{created.submission_id}?token={tokens['reader']}")
            console.print(f"API docs:  {server.url}/docs")
            if keep_serving:
                console.print(f"serving at {server.url} (admin token {tokens['admin']}); Ctrl-C to stop")
                _wait_for_interrupt()
        finally:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    stop(worker)


def _follow(api: httpx.Client, worker: subprocess.Popen, console: Console) -> None:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("tuning", total=None)
        while True:
            if worker.poll() is not None:
                raise RuntimeError(f"the demo worker exited with {worker.returncode}; see worker.log")
            studies = StudyPage.model_validate(api.get("/v1/studies", params={"limit": 500}).json()).items
            total = sum(s.trials_budget + 1 for s in studies)
            done = sum(s.trials_done + (s.state == "completed") for s in studies)
            progress.update(task, total=total, completed=done,
                            description=f"tuning: {sum(s.state == 'completed' for s in studies)}/{len(studies)} "
                                        "studies done")
            if not any(s.state.active for s in studies):
                return
            time.sleep(0.5)


def _table(api: httpx.Client, submission: int) -> Table:
    sub = SubmissionPublic.model_validate(api.get(f"/v1/submissions/{submission}").json())
    table = Table(title=f"tuned configs for {sub.name} on {sub.hardware_key} "
                        f"(speedup = baseline / candidate, median of paired runs ± half IQR)")
    for col, justify in [("roles", "left"), ("problem", "left"), ("tuned decomposition", "left"),
                         ("time", "right"), ("baseline", "right"), ("speedup", "right"), ("trials", "right")]:
        table.add_column(col, justify=justify)
    for e in sub.entries:
        if e.decomposition_id is None:
            table.add_row(", ".join(e.roles), e.problem_key, str(e.study_state), "-", "-", "-", "-")
            continue
        table.add_row(", ".join(e.roles), e.problem_key, e.decomposition_id, f"{e.time_s * 1e3:.2f} ms",
                      f"{e.baseline_s * 1e3:.2f} ms", f"{e.speedup:.2f}x ±{e.speedup_iqr / 2:.2f}",
                      f"{e.trials}/{e.space_size}")
    if sub.saved_s_per_step is not None:
        table.caption = (f"estimated time saved per training step ({sub.layers} layers): "
                         f"{sub.saved_s_per_step * 1e3:.2f} ms")
    return table


def _wait_for_interrupt() -> None:
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
