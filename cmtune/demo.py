"""`cmtune demo`: a service, a worker group and a model, end to end, on this machine.

1. The service starts on a fresh SQLite file; tokens come from `cmtune token create`.
2. A worker runs as a 2-process gloo cluster (`--devices processes:2`, 4 virtual CPU devices each):
   the multi-host path of a TPU pod slice.  Its token is in its environment, never on a command line.
3. The demo model is submitted on a ``data=1,model=8`` mesh: one study per collective matmul of its
   training step (forward, input and weight gradients), then the step study, which times the
   whole training step with the tuned configs against the block as written (GSPMD) and the all-baseline step.
4. The demo ends with the op table (what each role picked, and by how much) and the measured step.

It drives both parts only through their public commands and the REST API.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cmtune.launcher import running_server, stop
from collective_matmul.client.rest import ApiClient
from collective_matmul.wire import Budget, HardwareIn, MeshIn, StepOptions, StudyCreate, SubmissionPublic

DEVICES, PROCESSES = 8, 2
app = typer.Typer(no_args_is_help=True)


@app.command()
def demo(
    keep_serving: Annotated[bool, typer.Option(help="leave the service (and worker) up afterwards")] = False,
    model: Annotated[str, typer.Option(help="the preset to tune and measure")] = "demo",
    trials: Annotated[int, typer.Option(min=2, help="trial budget per problem")] = 4,
    repeats: Annotated[int, typer.Option(min=1, help="interleaved runs per trial")] = 5,
    step_rounds: Annotated[int, typer.Option(
        min=0, help="rounds of the step search, the seeds' included, before the grading (0 or 1: one round of the "
                    "standard menu)")] = 2,
    step_repeats: Annotated[int, typer.Option(min=3, help="interleaved rounds of each step measurement")] = 5,
    ablation: Annotated[bool, typer.Option(help="also time each role set back to the baseline (slower)")] = False,
    port: Annotated[int | None, typer.Option(help="service port (default: a free one)")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="where the demo puts its SQLite file (default: temp)")] = None,
) -> None:
    """The end-to-end demo: the service and a 2-process worker tune a model, then time its whole step."""
    import tempfile

    from cmtune.common import console

    directory = Path(data_dir or tempfile.mkdtemp(prefix="cmtune-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    run_demo(directory, model=model, trials=trials, repeats=repeats, step_rounds=step_rounds,
             step_repeats=step_repeats, ablation=ablation, port=port,
             keep_serving=keep_serving, console=console)


def make_tokens(database_url: str) -> dict[str, str]:
    """One token per role, from `cmtune token create` (which also creates the SQLite schema)."""
    env = os.environ | {"CMTUNE_DATABASE_URL": database_url}
    tokens = {}
    for role in ("admin", "worker", "reader"):
        run = subprocess.run([sys.executable, "-m", "cmtune", "token", "create", "--role", role,
                              "--name", f"demo-{role}"], env=env, capture_output=True, text=True, check=True)
        tokens[role] = run.stdout.strip().splitlines()[-1]
    return tokens


def run_demo(directory: Path, *, model: str, trials: int, repeats: int, step_rounds: int, step_repeats: int,
             ablation: bool, port: int | None, keep_serving: bool, console: Console) -> None:
    """Serve, work, submit ``model`` and print its tables.  The step search's budget (``step_rounds`` rounds of
    ``step_repeats`` interleaved runs each, then the grading) is what fits a first run on two cores: the
    seeds' round and one round of changes, about a minute and a half of the demo's four."""
    signal.signal(signal.SIGTERM, _interrupt)
    url = f"sqlite:///{directory / 'cmtune.sqlite'}"
    tokens = make_tokens(url)
    console.print(f"service database: {directory / 'cmtune.sqlite'}")
    started = time.monotonic()
    with running_server(database_url=url, port=port) as server:
        worker = subprocess.Popen(
            [sys.executable, "-m", "cmtune", "worker", "--server", server.url, "--devices",
             f"processes:{PROCESSES}", "--local-devices", str(DEVICES // PROCESSES), "--name", "demo-worker",
             "--restart", "--poll-seconds", "0.5", "--heartbeat-seconds", "5"],
            env=os.environ | {"CMTUNE_TOKEN": tokens["worker"]}, start_new_session=True,
            stdout=open(directory / "worker.log", "w"), stderr=subprocess.STDOUT,
        )
        try:
            with ApiClient(server.url, tokens["admin"], timeout=60) as api:
                body = StudyCreate(
                    model=model, mesh=MeshIn(axes={"data": 1, "model": DEVICES}),
                    hardware=HardwareIn(platform="cpu", device_kind="cpu", device_count=DEVICES,
                                        process_count=PROCESSES),
                    budget=Budget(trials=trials), repeats=repeats, confirm_top=2,
                    step=StepOptions(ablation=ablation, repeats=step_repeats, search_rounds=step_rounds))
                created = api.submit(body)
                console.print(f"submitted {model} on a data=1,model={DEVICES} mesh (submission "
                              f"{created.submission_id}): {len(created.studies) - 1} studies, then the step; the "
                              f"worker is a {PROCESSES}-process gloo cluster; its log: {directory / 'worker.log'}")
                _follow(api, worker, console)
                sub = api.submission(created.submission_id)
                console.print(_ops_table(sub))
                console.print(_step_table(sub))
                spent = _where_the_time_went(api)
            console.print(f"done in {time.monotonic() - started:.0f} s: {spent}")
            console.print(f"dashboard: {server.url}/ui/submissions/{created.submission_id}#token={tokens['reader']}")
            console.print(f"API docs:  {server.url}/docs")
            if keep_serving:
                _serve_until_interrupted(f"serving at {server.url} (admin token {tokens['admin']}); Ctrl-C to stop",
                                         console)
        finally:
            _stop_worker(worker)


def _stop_worker(worker: subprocess.Popen) -> None:
    """SIGTERM to the worker's whole process group (supervisor, launcher, processes), then SIGKILL."""
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            stop(worker)


def _follow(api: ApiClient, worker: subprocess.Popen, console: Console) -> None:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("tuning", total=None)
        while True:
            if worker.poll() is not None:
                raise RuntimeError(f"the demo worker exited with {worker.returncode}; see worker.log")
            studies = api.studies(limit=500).items
            search = [s for s in studies if s.kind == "search"]
            step = [s for s in studies if s.kind == "step"]
            total = sum(s.trials_budget + 1 for s in search) + len(step)
            done = sum(s.trials_done + (not s.state.active) for s in search) + sum(not s.state.active for s in step)
            finished = sum(not s.state.active for s in search)
            phase = "measuring the whole step" if finished == len(search) else \
                f"tuning: {finished}/{len(search)} studies done"
            progress.update(task, total=total, completed=done, description=phase)
            if not any(s.state.active for s in studies):
                return
            time.sleep(0.5)


def _ops_table(sub: SubmissionPublic) -> Table:
    """Per problem: what its roles picked and by how much, its bounds (compute, communication, the bound, the
    hidden fraction) and, in the caption, why (collective_matmul.wire.bounds)."""
    table = Table(title=f"tuned collective matmuls of {sub.name} on {sub.hardware_key} "
                        "(speedup = baseline / tuned, median of paired runs ± half IQR)", caption_justify="left")
    for col, justify in [("roles", "left"), ("problem", "left"), ("tuned decomposition", "left"),
                         ("time", "right"), ("baseline", "right"), ("speedup", "right"), ("compute", "right"),
                         ("communication", "right"), ("bound", "right"), ("hidden", "right"), ("trials", "right")]:
        table.add_column(col, justify=justify)

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"

    reasons = []
    for e in sub.entries:
        if e.decomposition_id is None:
            table.add_row(", ".join(e.roles), e.problem_key, str(e.study_state), *["-"] * 8)
            continue
        table.add_row(", ".join(e.roles), e.problem_key, e.decomposition_id, ms(e.time_s), ms(e.baseline_s),
                      f"{e.speedup:.2f}x ±{e.speedup_iqr / 2:.2f}", ms(e.compute_s), ms(e.communication_s),
                      ms(e.bound_s), "-" if e.hidden_fraction is None else f"{e.hidden_fraction:.0%}",
                      f"{e.trials}/{e.space_size}")
        if e.reason:
            reasons.append(f"{e.problem_key}: {e.reason}")
    lines = []
    if sub.saved_s_per_step is not None:
        lines.append(f"estimated from the ops: {sub.saved_s_per_step * 1e3:.1f} ms saved per training step "
                     f"({sub.layers} layers)")
    table.caption = "\n".join(lines + reasons) or None
    return table


def _step_table(sub: SubmissionPublic) -> Table:
    step = sub.step
    title = (f"the whole training step of {sub.name}, measured "
             "(speedup = reference / variant, median of paired rounds, IQR in brackets)")
    # one line for the title where the terminal allows; the decision's reasons read best left-aligned
    table = Table(title=title, min_width=len(title), caption_justify="left")
    for col, justify in [("variant", "left"), ("step time", "right"), ("vs the step as written", "right"),
                         ("compile", "right")]:
        table.add_column(col, justify=justify)
    if step is None or not step.variants:
        table.caption = f"no step measurement: {step.message if step else 'not requested'}"
        return table
    reference = next(v for v in step.variants if v.name == step.reference)
    for v in step.variants:
        name = v.name + ("  (runs)" if v.name == step.variant else "")
        if not v.ok:
            table.add_row(name, f"[red]{v.status}[/red]", v.message[:60], "-")
            continue
        paired = _paired(v, reference)
        table.add_row(name, f"{v.timing.median_s * 1e3:.0f} ms", paired,
                      f"{v.compile_s:.1f} s" if v.compile_s is not None else "-")
    lines = []
    if step.vs_reference is not None:
        timed = "timed again after the decision" if step.confirmation else "from the rounds that decided"
        lines.append(f"measured step speedup ({timed}): {step.vs_reference} over the step as written (GSPMD)")
    if step.vs_baseline is not None:
        lines.append(f"{step.vs_baseline} over the all-baseline custom VJP")
    if step.measured_saved_s_per_step is not None and sub.saved_s_per_step is not None:
        lines.append(f"saved per step: {step.measured_saved_s_per_step * 1e3:.0f} ms measured, "
                     f"{sub.saved_s_per_step * 1e3:.0f} ms estimated from the ops")
    lines += [f"{o.role}: {o.reason}" for o in sub.overrides]
    table.caption = "; ".join(lines[:2]) + ("\n" + "\n".join(lines[2:]) if lines[2:] else "")
    return table


def _where_the_time_went(api: ApiClient) -> str:
    """The demo's wall time by phase, from the service's own timestamps: the op-level studies (from the
    submission to the last one's end), each round of the step search, and the grading."""
    studies = api.studies(limit=500).items
    search = [s for s in studies if s.kind == "search"]
    step = next((s for s in studies if s.kind == "step"), None)
    if not search or step is None:
        return "nothing measured"
    submitted = min(s.created_at for s in studies)
    ops_end = max(s.finished_at or submitted for s in search)
    trials = sum(s.trials_done for s in search)
    parts = [f"op studies {(ops_end - submitted).total_seconds():.0f} s ({len(search)} studies, {trials} trials)"]
    rounds = api.trials(step.id)
    previous = ops_end
    spans = []
    for trial in rounds:
        if trial.finished_at is None:
            continue
        spans.append((trial.finished_at - max(previous, trial.created_at)).total_seconds())
        previous = trial.finished_at
    if len(spans) > 1:  # the last trial of a search is its grading
        parts.append(f"step search {sum(spans[:-1]):.0f} s ({len(spans) - 1} rounds: "
                     f"{', '.join(f'{t:.0f}' for t in spans[:-1])} s)")
        parts.append(f"grading {spans[-1]:.0f} s")
    elif spans:
        parts.append(f"step measurement {spans[0]:.0f} s")
    return ", ".join(parts)


def _paired(variant, reference) -> str:
    """The variant's speedup over the reference, paired by round: median (IQR)."""
    from collective_matmul.wire.stats import paired_quartiles

    q1, median, q3 = paired_quartiles(reference.timing.samples_s, variant.timing.samples_s)
    return f"{median:.2f}x ({q1:.2f}-{q3:.2f})"


def _interrupt(signum, frame) -> None:
    """SIGTERM ends the demo like Ctrl-C: the server and the worker it started stop on the way out."""
    raise KeyboardInterrupt


def _serve_until_interrupted(message: str, console: Console) -> None:
    """Print ``message`` and wait for Ctrl-C or SIGTERM: a signal right after the message is a normal stop too."""
    try:
        console.print(message)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
