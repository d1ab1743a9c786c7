"""`cmtune demo`: a service, a local worker and the tiny preset, end to end, on this machine."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from collective_matmul import Decomposition
from service import migrate
from service import repository as repo
from service.db import Database
from service.launcher import running_server, stop

DEVICES = 8


def make_tokens(url: str) -> dict[str, str]:
    db = Database(url)
    migrate.upgrade(db.engine)
    tokens = {}
    with db.session(write=True) as session:
        for role in ("admin", "worker", "reader"):
            tokens[role] = repo.create_token(session=session, name=f"demo-{role}", role=role)[1]
    db.dispose()
    return tokens


def cpu_hardware() -> dict:
    return {"platform": "cpu", "device_kind": "cpu", "device_count": DEVICES, "process_count": 1}


def run_demo(directory: Path, *, trials: int, port: int | None, keep_serving: bool, console: Console) -> None:
    url = f"sqlite:///{directory / 'cmtune.sqlite'}"
    tokens = make_tokens(url)
    console.print(f"service database: {directory / 'cmtune.sqlite'}")
    with running_server(database_url=url, port=port) as server:
        worker = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "worker", "--server", server.url, "--token", tokens["worker"],
             "--devices", f"virtual:{DEVICES}", "--name", "demo-worker", "--poll-seconds", "0.5",
             "--heartbeat-seconds", "5"],
            stdout=open(directory / "worker.log", "w"), stderr=subprocess.STDOUT,
        )
        try:
            with httpx.Client(base_url=server.url, timeout=60,
                              headers={"Authorization": f"Bearer {tokens['admin']}"}) as api:
                body = {"model": "tiny", "mesh": {"axes": {"data": 1, "model": DEVICES}, "tensor_axis": "model"},
                        "hardware": cpu_hardware(), "budget": {"trials": trials}}
                created = api.post("/v1/studies", json=body)
                created.raise_for_status()
                submission = created.json()["submission_id"]
                console.print(f"submitted the tiny preset on a 1x{DEVICES} mesh: submission {submission}, "
                              f"{len(created.json()['studies'])} studies; worker log: {directory / 'worker.log'}")
                _follow(api, worker, console)
                console.print(_table(api, submission))
            console.print(f"dashboard: {server.url}/ui/submissions/{submission}?token={tokens['reader']}")
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
            studies = api.get("/v1/studies", params={"limit": 500}).json()["items"]
            total = sum(s["trials_budget"] + 1 for s in studies)
            done = sum(s["trials_done"] + (s["state"] == "completed") for s in studies)
            states = [s["state"] for s in studies]
            progress.update(task, total=total, completed=done,
                            description=f"tuning: {states.count('completed')}/{len(states)} studies done")
            if all(state in ("completed", "failed", "cancelled") for state in states):
                return
            time.sleep(0.5)


def _table(api: httpx.Client, submission: int) -> Table:
    sub = api.get(f"/v1/submissions/{submission}").json()
    studies = {s["id"]: s for s in api.get("/v1/studies", params={"limit": 500}).json()["items"]}
    table = Table(title=f"tuned configs for {sub['model']['name']} on cpu x{DEVICES} "
                        f"(speedup = baseline / candidate, median of paired runs ± half IQR)")
    for col, justify in [("roles", "left"), ("problem", "left"), ("tuned decomposition", "left"),
                         ("time", "right"), ("baseline", "right"), ("speedup", "right"), ("trials", "right")]:
        table.add_column(col, justify=justify)
    for entry in sub["entries"]:
        study = studies.get(entry["study_id"]) or {}
        tuned = study.get("tuned")
        p = entry["problem"]
        if tuned is None:
            table.add_row(", ".join(entry["roles"]), f"{p['collective']} {p['m']}x{p['k']}x{p['n']}",
                          study.get("state", "?"), "-", "-", "-", "-")
            continue
        table.add_row(
            ", ".join(entry["roles"]), f"{p['collective']} {p['m']}x{p['k']}x{p['n']}",
            Decomposition.model_validate(tuned["decomposition"]).id, f"{tuned['time_s'] * 1e3:.2f} ms",
            f"{tuned['baseline_s'] * 1e3:.2f} ms", f"{tuned['speedup']:.2f}x ±{tuned['speedup_iqr'] / 2:.2f}",
            f"{tuned['trials']}/{tuned['space_size']}",
        )
    saved = sub.get("saved_s_per_step")
    if saved is not None:
        table.caption = f"estimated time saved per training step ({sub['layers']} layers): {saved * 1e3:.2f} ms"
    return table


def _wait_for_interrupt() -> None:
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
