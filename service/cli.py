"""The `cmtune` command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(help="Tune collective matmul decompositions on real devices.", no_args_is_help=True)
# A pipe gets rich's 80 columns by default; tables of decompositions need more.
console = Console(width=None if sys.stdout.isatty() else 150)

DEVICES_HELP = "virtual:N (N virtual CPU devices in this process) or processes:N (N local gloo processes)"


def parse_devices(spec: str) -> tuple[str, int]:
    kind, _, count = spec.partition(":")
    if kind not in ("virtual", "processes", "auto") or (kind != "auto" and not count.isdigit()):
        raise typer.BadParameter(f"{spec!r}: expected {DEVICES_HELP}, or auto")
    return kind, int(count) if count else 0


def setup_devices(spec: str) -> None:
    """Configure JAX for ``spec`` before any device is touched (join the group in a child of one)."""
    from workers.cluster import ClusterSpec, join

    cluster = ClusterSpec.from_env()
    if cluster is not None:
        join(cluster)
        return
    kind, count = parse_devices(spec)
    if kind == "virtual" and count > 0:
        import jax

        jax.config.update("jax_num_cpu_devices", count)


def relaunch_as_group(count: int, local_devices: int = 4, *, daemon: bool = False) -> None:
    """Re-run this very command as ``count`` processes of a gloo cluster.

    A one-shot command prints process 0's output; a daemon streams every process's output,
    runs until they stop and exits with the worst exit status.
    """
    from workers.cluster import launch

    results = launch(count, ["-m", "service.cli", *sys.argv[1:]], local_devices=local_devices,
                     timeout_s=7 * 24 * 3600 if daemon else 3600, stream=daemon)
    if daemon:
        raise typer.Exit(max(r.returncode for r in results))
    sys.stdout.write(results[0].stdout)
    sys.stderr.write(results[0].stderr)


@app.command()
def bench(
    problem: Annotated[str, typer.Option(help="e.g. 'allgather_matmul:512x256x1024:float32:8'")],
    devices: Annotated[str, typer.Option(help=DEVICES_HELP)] = "virtual:8",
    repeats: Annotated[int, typer.Option(min=1, help="interleaved runs per candidate")] = 7,
    warmup: Annotated[int, typer.Option(min=0)] = 2,
    out: Annotated[Path | None, typer.Option(help="write every measurement as JSON lines")] = None,
) -> None:
    """Time every valid decomposition of one problem against the baseline."""
    from collective_matmul import Problem

    try:
        parsed = Problem.parse(problem)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--problem") from None
    kind, count = parse_devices(devices)
    if kind == "processes" and "CMTUNE_COORDINATOR" not in os.environ:
        return relaunch_as_group(count, local_devices=parsed.axis_size // count)
    setup_devices(devices)
    _run_sweep(parsed, repeats=repeats, warmup=warmup, out=out)


def _run_sweep(problem, *, repeats: int, warmup: int, out: Path | None) -> None:
    import jax
    from rich.progress import Progress

    from collective_matmul import candidates
    from tuner.measure import Protocol
    from tuner.report import sweep_table
    from tuner.sweep import sweep

    leader = jax.process_index() == 0
    protocol = Protocol(repeats=repeats, warmup=warmup)
    with Progress(console=console, transient=True, disable=not leader) as progress:
        task = progress.add_task(f"timing {problem.key}", total=len(candidates(problem)))
        results = sweep(problem, protocol=protocol, on_result=lambda m: progress.advance(task))
    if not leader:
        return
    console.print(sweep_table(results, title=f"{problem.key} on {results[0].hardware.key}"))
    if out is not None:
        out.write_text("".join(m.model_dump_json() + "\n" for m in results))
        console.print(f"wrote {len(results)} measurements to {out}")


def _problems_from_options(problem: list[str] | None, model: str | None, mesh: str | None,
                           tensor_axis: str | None):
    from collective_matmul import MeshSpec, Problem, TransformerBlock, model_problems

    if bool(problem) == bool(model):
        raise typer.BadParameter("give either --problem (one or more) or --model with --mesh")
    try:
        if problem:
            return [Problem.parse(spec) for spec in problem]
        if not mesh:
            raise typer.BadParameter("--model needs --mesh, e.g. --mesh data=1,model=8")
        return [mp.problem for mp in model_problems(TransformerBlock.load(model), MeshSpec.parse(mesh, tensor_axis))]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
def tune(
    problem: Annotated[
        list[str] | None, typer.Option(help="problem spec, e.g. 'ag:1024x256x1024:float32:8' (repeatable)")
    ] = None,
    model: Annotated[str | None, typer.Option(help="model preset or JSON file (with --mesh)")] = None,
    mesh: Annotated[str | None, typer.Option(help="mesh axes, e.g. data=1,model=8")] = None,
    tensor_axis: Annotated[str | None, typer.Option(help="tensor-parallel mesh axis (default: model)")] = None,
    devices: Annotated[
        str, typer.Option(help=DEVICES_HELP + "; auto = virtual CPU devices, one per ring member")
    ] = "auto",
    trials: Annotated[
        int | None, typer.Option(min=1, help="trial budget per problem (default: a quarter of the space)")
    ] = None,
    minutes: Annotated[float | None, typer.Option(min=0.01, help="time budget per problem")] = None,
    patience: Annotated[int | None, typer.Option(min=1, help="stop after this many trials without a new best")] = None,
    sampler: Annotated[str, typer.Option(help="auto, enumerate, tpe or random")] = "auto",
    seed: Annotated[int, typer.Option()] = 0,
    repeats: Annotated[int, typer.Option(min=1, help="interleaved runs per trial")] = 7,
    out: Annotated[Path | None, typer.Option(help="write the tuned configs as a bundle file")] = None,
) -> None:
    """Tune the decompositions of one or more problems on local devices."""
    problems = _problems_from_options(problem, model, mesh, tensor_axis)
    if sampler not in ("auto", "enumerate", "tpe", "random"):
        raise typer.BadParameter(f"{sampler!r}: expected auto, enumerate, tpe or random", param_hint="--sampler")
    sizes = {p.axis_size for p in problems}
    if len(sizes) > 1:
        raise typer.BadParameter(f"problems have different ring sizes {sorted(sizes)}: tune them separately")
    ring = sizes.pop()
    kind, count = parse_devices(devices)
    if kind == "processes" and "CMTUNE_COORDINATOR" not in os.environ:
        if ring % count:
            raise typer.BadParameter(f"a ring of {ring} devices does not split over {count} processes")
        return relaunch_as_group(count, local_devices=ring // count)
    setup_devices(f"virtual:{ring}" if kind == "auto" else devices)
    _tune(problems, ring=ring, trials=trials, minutes=minutes, patience=patience, sampler=sampler,
          seed=seed, repeats=repeats, out=out)


def _tune(problems, *, ring, trials, minutes, patience, sampler, seed, repeats, out) -> None:
    import jax
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from collective_matmul import Hardware, candidates
    from collective_matmul.bundle import Bundle
    from collective_matmul.costmodel import PROFILES, calibrate_cpu, profile_for
    from tuner.local import LocalRunner
    from tuner.measure import Protocol
    from tuner.report import tune_table
    from tuner.search import SearchSettings, tune

    if jax.device_count() != ring:
        raise typer.BadParameter(
            f"the problems need a ring of {ring} devices but {jax.device_count()} are present; "
            f"use --devices virtual:{ring} (or processes:N with N dividing {ring})"
        )
    hardware = Hardware.detect()
    profile = calibrate_cpu() if hardware.platform == "cpu" else (profile_for(hardware) or PROFILES["tpu-v4"])
    leader = jax.process_index() == 0
    runner = LocalRunner()
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not leader) as progress:
        for problem in problems:
            space = len(candidates(problem))
            budget = trials or max(4, -(-space // 4))
            settings = SearchSettings(sampler=sampler, seed=seed, max_trials=budget, patience=patience,
                                      max_seconds=minutes * 60 if minutes else None)
            task = progress.add_task(problem.key, total=min(budget, space))
            result = tune(problem, runner, profile, settings=settings,
                          protocol=Protocol(repeats=repeats, seed=seed),
                          on_trial=lambda m, task=task: progress.advance(task))
            progress.update(task, completed=min(budget, space))
            results.append(result)
    if not leader:
        return
    console.print(tune_table(results, title=f"tuned on {hardware.key} (jax {hardware.jax_version})"))
    if out is not None:
        bundle = Bundle.load(out) if out.exists() else Bundle()
        for r in results:
            bundle.add(r.tuned_config())
        bundle.save(out)
        console.print(f"wrote {len(results)} tuned configs to {out}")


@app.command()
def demo(
    keep_serving: Annotated[bool, typer.Option(help="leave the service (and worker) up afterwards")] = False,
    trials: Annotated[int, typer.Option(min=2, help="trial budget per problem")] = 6,
    port: Annotated[int | None, typer.Option(help="service port (default: a free one)")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="where the demo puts its SQLite file (default: temp)")] = None,
) -> None:
    """The end-to-end demo: service + local worker (8 virtual devices) tune the tiny preset."""
    import tempfile

    from workers.demo import run_demo

    directory = Path(data_dir or tempfile.mkdtemp(prefix="cmtune-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    run_demo(directory, trials=trials, port=port, keep_serving=keep_serving, console=console)


def _api(server: str, token: str | None):
    import httpx

    return httpx.Client(base_url=server.rstrip("/"), timeout=30,
                        headers={"Authorization": f"Bearer {token}"} if token else {})


def _check(response) -> dict:
    if response.status_code >= 400:
        console.print(f"[red]{response.status_code}: {response.json().get('detail', response.text)}[/red]")
        raise typer.Exit(1)
    return response.json()


@app.command()
def submit(
    server: Annotated[str, typer.Option(envvar="CMTUNE_SERVER")] = "http://127.0.0.1:8470",
    token: Annotated[str | None, typer.Option(envvar="CMTUNE_TOKEN", help="an admin token")] = None,
    problem: Annotated[list[str] | None, typer.Option(help="problem spec (repeatable)")] = None,
    model: Annotated[str | None, typer.Option(help="preset name or JSON file (with --mesh)")] = None,
    mesh: Annotated[str | None, typer.Option(help="e.g. data=1,model=8")] = None,
    tensor_axis: Annotated[str | None, typer.Option()] = None,
    platform: Annotated[str, typer.Option(help="hardware to tune on")] = "cpu",
    device_kind: Annotated[str, typer.Option()] = "cpu",
    process_count: Annotated[int, typer.Option(min=1)] = 1,
    trials: Annotated[int | None, typer.Option(min=1, help="trial budget per problem")] = None,
    force: Annotated[bool, typer.Option(help="tune again even if tuned")] = False,
) -> None:
    """Submit problems, or a model + mesh, to a running service."""
    from collective_matmul import MeshSpec

    targets = _problems_from_options(problem, model, mesh, tensor_axis)
    hardware = {"platform": platform, "device_kind": device_kind, "device_count": targets[0].axis_size,
                "process_count": process_count}
    budget = {"trials": trials} if trials else {}
    with _api(server, token) as client:
        bodies = []
        if model:
            spec = MeshSpec.parse(mesh, tensor_axis)
            bodies.append({"model": model, "mesh": {"axes": spec.axes, "tensor_axis": spec.tensor_axis}})
        else:
            bodies.extend({"problem": p.model_dump()} for p in targets)
        for body in bodies:
            created = _check(client.post("/v1/studies", json=body | {"hardware": hardware, "budget": budget,
                                                                     "force": force}))
            for study in created["studies"]:
                console.print(f"study {study['id']}: {study['problem']} ({study['trials_budget']} trials)")
            for skip in created["skipped"]:
                console.print(f"skipped {skip['problem']}: {skip['reason']} (study {skip['study_id']})")
            if created.get("submission_id"):
                console.print(f"submission {created['submission_id']}")


@app.command()
def status(
    server: Annotated[str, typer.Option(envvar="CMTUNE_SERVER")] = "http://127.0.0.1:8470",
    token: Annotated[str | None, typer.Option(envvar="CMTUNE_TOKEN", help="a reader token")] = None,
    state: Annotated[str | None, typer.Option(help="only studies in this state")] = None,
) -> None:
    """Studies and workers of a running service."""
    from rich.table import Table

    from collective_matmul import Decomposition

    with _api(server, token) as client:
        studies = _check(client.get("/v1/studies", params={"state": state} if state else {}))
        workers = _check(client.get("/v1/workers"))
    table = Table(title=f"studies on {server} ({studies['total']})")
    for col in ("id", "state", "problem", "hardware", "trials", "best so far", "tuned"):
        table.add_column(col)
    for s in studies["items"]:
        p = s["problem"]
        best = f"{s['best']['speedup']:.2f}x" if s["best"] else "-"
        tuned = "-"
        if s["tuned"]:
            tuned = f"{Decomposition.model_validate(s['tuned']['decomposition']).id} {s['tuned']['speedup']:.2f}x"
        table.add_row(str(s["id"]), s["state"], f"{p['collective']}:{p['m']}x{p['k']}x{p['n']}:{p['dtype']}",
                      f"{s['hardware']['platform']}:{s['hardware']['device_kind']}:{s['hardware']['device_count']}",
                      f"{s['trials_done']}/{s['trials_budget']} (+{s['trials_running']} running)", best, tuned)
    console.print(table)
    console.print(f"workers online: {sum(w['online'] for w in workers)} of {len(workers)} registered")


@app.command()
def problems(
    model: Annotated[str, typer.Option(help="preset name or JSON file")] = "tiny",
    mesh: Annotated[str, typer.Option(help="mesh axes, e.g. data=1,model=8")] = "data=1,model=8",
    tensor_axis: Annotated[str | None, typer.Option(help="tensor-parallel axis (default: model)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """List the collective-matmul problems of one training step of a model on a mesh."""
    from rich.table import Table

    from collective_matmul import MeshSpec, TransformerBlock, model_problems

    try:
        found = model_problems(TransformerBlock.load(model), MeshSpec.parse(mesh, tensor_axis))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if as_json:
        print(json.dumps([mp.model_dump(mode="json") for mp in found], indent=2))
        return
    table = Table(title=f"{model} on {mesh}")
    for col in ("problem", "per layer", "roles"):
        table.add_column(col)
    for mp in found:
        table.add_row(mp.problem.key, str(mp.count), ", ".join(mp.roles))
    console.print(table)


@app.command()
def worker(
    server: Annotated[str, typer.Option(envvar="CMTUNE_SERVER", help="service URL")] = "http://127.0.0.1:8470",
    token: Annotated[str | None, typer.Option(envvar="CMTUNE_TOKEN", help="a worker token")] = None,
    devices: Annotated[str, typer.Option(help=DEVICES_HELP + "; auto = the devices JAX finds")] = "auto",
    name: Annotated[str | None, typer.Option(help="default: the host name")] = None,
    coordinator: Annotated[str | None, typer.Option(help="HOST:PORT of process 0 (multi-host)")] = None,
    num_processes: Annotated[int | None, typer.Option(help="processes in the group (multi-host)")] = None,
    process_id: Annotated[int | None, typer.Option(help="this process's index (multi-host)")] = None,
    poll_seconds: Annotated[float, typer.Option(min=0.05, help="wait between empty lease requests")] = 2.0,
    heartbeat_seconds: Annotated[float, typer.Option(min=0.05)] = 10.0,
    max_trials: Annotated[int | None, typer.Option(min=1, help="leave after this many trials")] = None,
    local_devices: Annotated[int, typer.Option(min=1, help="virtual CPU devices per process (processes:N)")] = 4,
    exit_when_idle: Annotated[bool, typer.Option(help="leave when no trial is offered for 5 s")] = False,
) -> None:
    """Run a worker daemon: lease trials that match this host's hardware, time them, report."""
    import logging

    from workers.cluster import ClusterSpec, join
    from workers.daemon import WorkerDaemon

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    kind, count = parse_devices(devices)
    in_group = "CMTUNE_COORDINATOR" in os.environ
    if kind == "processes" and not in_group:
        relaunch_as_group(count, local_devices, daemon=True)
    if coordinator is not None:
        if num_processes is None or process_id is None:
            raise typer.BadParameter("--coordinator needs --num-processes and --process-id")
        join(ClusterSpec(coordinator=coordinator, num_processes=num_processes, process_id=process_id))
    else:
        setup_devices(devices if kind != "auto" else "virtual:0")
    daemon = WorkerDaemon(server, token, name=name, poll_s=poll_seconds, heartbeat_s=heartbeat_seconds,
                          max_trials=max_trials, exit_when_idle=exit_when_idle)
    daemon.install_signal_handlers()
    daemon.run()


db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")


def _database():
    from service.db import Database
    from service.settings import get_settings

    return Database(get_settings().database_url)


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Upgrade the schema of CMTUNE_DATABASE_URL (default: the embedded SQLite file)."""
    from service import migrate

    db = _database()
    migrate.upgrade(db.engine, revision)
    console.print(f"schema at {migrate.current_revision(db.engine)} ({db.engine.url.render_as_string()})")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="target revision, e.g. base")]) -> None:
    """Downgrade the schema (``base`` drops every table)."""
    from service import migrate

    db = _database()
    migrate.downgrade(db.engine, revision)
    console.print(f"schema at {migrate.current_revision(db.engine) or 'base'}")


@db_app.command("current")
def db_current() -> None:
    """Print the schema revision and whether it is current."""
    from service import migrate

    db = _database()
    current, head = migrate.current_revision(db.engine), migrate.head_revision(db.engine)
    console.print(f"{current or 'empty'} (head {head}){'' if current == head else ': run cmtune db upgrade'}")


@db_app.command("wait")
def db_wait(timeout: Annotated[float, typer.Option(help="seconds to keep trying")] = 60.0) -> None:
    """Wait until the database accepts connections (for containers that start together)."""
    import time

    from sqlalchemy import text

    db = _database()
    deadline = time.monotonic() + timeout
    while True:
        try:
            with db.engine.connect() as connection:
                connection.execute(text("SELECT 1"))
            console.print("database is up")
            return
        except Exception as exc:  # noqa: BLE001 - any failure means: not yet
            if time.monotonic() > deadline:
                console.print(f"[red]database not reachable after {timeout:.0f}s: {exc}[/red]")
                raise typer.Exit(1) from None
            time.sleep(1)


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="admin, worker or reader")],
    name: Annotated[str, typer.Option(help="what the token is for")] = "cli",
    value: Annotated[str | None, typer.Option(
        envvar="CMTUNE_NEW_TOKEN", help="store this token (e.g. from a secret) instead of a random one")] = None,
) -> None:
    """Create a token and print it (only its hash is stored); an existing ``--value`` is kept."""
    from service import migrate
    from service import repository as repo

    if role not in ("admin", "worker", "reader"):
        raise typer.BadParameter(f"{role!r}: expected admin, worker or reader", param_hint="--role")
    if value is not None and len(value) < 24:
        raise typer.BadParameter("a token must have at least 24 characters", param_hint="--value")
    db = _database()
    if db.engine.dialect.name == "sqlite":
        migrate.upgrade(db.engine)
    with db.session(write=True) as session:
        if value is not None and repo.find_token(session=session, token=value) is not None:
            console.print(f"token {name!r} already exists", style="dim")
            return
        _, plain = repo.create_token(session=session, name=name, role=role, value=value)
    print(plain)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="listen address (default CMTUNE_HOST or 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default CMTUNE_PORT or 8470)")] = None,
    workers: Annotated[int, typer.Option(min=1, help="server processes (uvicorn workers)")] = 1,
) -> None:
    """Run the service (uvicorn).  Upgrades an embedded SQLite schema; checks a PostgreSQL one."""
    import uvicorn

    from service.db import Database
    from service.main import SchemaOutOfDate, prepare_database
    from service.settings import get_settings

    settings = get_settings()
    host = host or settings.host
    port = port or settings.port
    if settings.auth == "off" and host not in LOOPBACK:
        raise typer.BadParameter(f"refusing to listen on {host} with CMTUNE_AUTH=off: "
                                 "turn auth on or listen on 127.0.0.1", param_hint="--host")
    db = Database(settings.database_url)
    try:
        prepare_database(db)  # once, before any server process starts
    except SchemaOutOfDate as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    finally:
        db.dispose()
    uvicorn.run("service.main:serve_app", factory=True, host=host, port=port, workers=workers,
                log_level="info", access_log=False)


if __name__ == "__main__":
    app()
