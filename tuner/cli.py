"""`cmtune tune | bench | problems`: the tuner's commands (local devices, no service).

Every import of JAX happens inside a command, after the devices are configured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from cmtune.tuner.cluster import DEVICES_HELP, DeviceSpec

app = typer.Typer(no_args_is_help=True)
# A pipe gets rich's 80 columns by default; tables of decompositions need more.
console = Console(width=None if sys.stdout.isatty() else 150)


def devices_option(text: str) -> DeviceSpec:
    try:
        return DeviceSpec.parse(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--devices") from None


def relaunch_as_group(count: int, local_devices: int) -> None:
    """Re-run this very command as ``count`` processes of a gloo cluster; print process 0's output."""
    from cmtune.tuner.cluster import launch

    results = launch(count, ["-m", "cmtune.tuner", *sys.argv[1:]], local_devices=local_devices, timeout_s=3600)
    sys.stdout.write(results[0].stdout)
    sys.stderr.write(results[0].stderr)


def problems_from_options(problem: list[str] | None, model: str | None, mesh: str | None, tensor_axis: str | None):
    """The problems named by ``--problem`` (repeatable) or ``--model`` with ``--mesh``."""
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
    spec = devices_option(devices)
    if spec.needs_group:
        return relaunch_as_group(spec.count, local_devices=parsed.axis_size // spec.count)
    from cmtune.tuner.cluster import configure

    configure(spec, auto_virtual=parsed.axis_size)
    _run_sweep(parsed, repeats=repeats, warmup=warmup, out=out)


def _run_sweep(problem, *, repeats: int, warmup: int, out: Path | None) -> None:
    import jax
    from rich.progress import Progress

    from cmtune.tuner.report import sweep_table
    from cmtune.tuner.sweep import sweep
    from collective_matmul import candidates
    from collective_matmul.wire import Protocol

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
    seed: Annotated[int, typer.Option(min=0)] = 0,
    repeats: Annotated[int, typer.Option(min=1, help="interleaved runs per trial")] = 7,
    out: Annotated[Path | None, typer.Option(help="write the tuned configs as a bundle file")] = None,
) -> None:
    """Tune the decompositions of one or more problems on local devices."""
    problems = problems_from_options(problem, model, mesh, tensor_axis)
    if sampler not in ("auto", "enumerate", "tpe", "random"):
        raise typer.BadParameter(f"{sampler!r}: expected auto, enumerate, tpe or random", param_hint="--sampler")
    sizes = {p.axis_size for p in problems}
    if len(sizes) > 1:
        raise typer.BadParameter(f"problems have different ring sizes {sorted(sizes)}: tune them separately")
    ring = sizes.pop()
    spec = devices_option(devices)
    if spec.needs_group:
        if ring % spec.count:
            raise typer.BadParameter(f"a ring of {ring} devices does not split over {spec.count} processes")
        return relaunch_as_group(spec.count, local_devices=ring // spec.count)
    from cmtune.tuner.cluster import configure

    configure(spec, auto_virtual=ring)
    _tune(problems, ring=ring, trials=trials, minutes=minutes, patience=patience, sampler=sampler,
          seed=seed, repeats=repeats, out=out)


def _tune(problems, *, ring, trials, minutes, patience, sampler, seed, repeats, out) -> None:
    import jax
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cmtune.tuner.cluster import Group
    from cmtune.tuner.engine import study_settings
    from cmtune.tuner.local import LocalRunner, LocalTuner, follow
    from cmtune.tuner.report import tune_table
    from collective_matmul import Hardware
    from collective_matmul.bundle import Bundle
    from collective_matmul.wire import Protocol

    if jax.device_count() != ring:
        raise typer.BadParameter(
            f"the problems need a ring of {ring} devices but {jax.device_count()} are present; "
            f"use --devices virtual:{ring} (or processes:N with N dividing {ring})"
        )
    group, runner = Group(), LocalRunner()
    if not group.leader:
        follow(group, runner)  # process 0 decides; this process runs what it is handed
        return
    hardware = Hardware.detect()
    outcomes = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        tuner = LocalTuner(runner, group=group)
        try:
            for problem in problems:
                settings = study_settings(problem, hardware, trials=trials, minutes=minutes, patience=patience,
                                          sampler=sampler, seed=seed)
                bar = progress.add_task(problem.key, total=min(settings.max_trials, len(candidates_of(problem))) + 1)
                tuner.on_trial = lambda _trial, bar=bar: progress.advance(bar)
                outcomes.append(tuner.tune(problem, hardware, settings, Protocol(repeats=repeats, seed=seed)))
                progress.update(bar, completed=progress.tasks[bar].total)
        finally:
            tuner.stop()
    console.print(tune_table(outcomes, title=f"tuned on {hardware.key} (jax {hardware.jax_version})"))
    tuned = [o.tuned for o in outcomes if o.tuned is not None]
    if out is not None and tuned:
        bundle = Bundle.load(out) if out.exists() else Bundle()
        for config in tuned:
            bundle.add(config)
        bundle.save(out)
        console.print(f"wrote {len(tuned)} tuned configs to {out}")
    failed = [o for o in outcomes if o.tuned is None]
    for outcome in failed:
        console.print(f"[red]{outcome.study.problem.key}: {outcome.study.state}: {outcome.study.message}[/red]")
    if failed:
        raise typer.Exit(1)


def candidates_of(problem):
    from collective_matmul import candidates

    return candidates(problem)


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
