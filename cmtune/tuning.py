"""`cmtune tune | bench | verify | problems`: the tuner's commands (local devices, no service).

JAX is imported only inside a command, and no device is touched before the devices are configured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cmtune.common import (
    COORDINATOR,
    NUM_PROCESSES,
    PROCESS_ID,
    console,
    devices_option,
    join_options,
    problems_from_options,
    set_up_devices,
    show_step,
)
from cmtune.workers.cluster import DEVICES_HELP, is_compile_only
from collective_matmul.wire import STEP_ROUND_VARIANTS, STEP_SEARCH_ROUNDS

app = typer.Typer(no_args_is_help=True)
# verify's option panels: the two ways to give a step, the configs, and the two measured modes' settings
BLOCK, STEP, CONFIGS = "The reference block (--model)", "Your own step (--step)", "Tuned configs"
TIMING, SEARCH = "Timing (not with --compile-only)", "Step search (--decide)"
COMPILE_ONLY_HELP = ("compile each candidate and read its memory and its schedule's overlap verdict, timing nothing "
                     "(what a TPU topology, --devices tpu:v5p:2x2x1, can only do)")


@app.command()
def bench(
    problem: Annotated[str, typer.Option(help="e.g. 'allgather_matmul:512x256x1024:float32:8'")],
    devices: Annotated[str, typer.Option(help=DEVICES_HELP)] = "virtual:8",
    repeats: Annotated[int, typer.Option(min=1, help="interleaved runs per candidate")] = 7,
    warmup: Annotated[int, typer.Option(min=0)] = 2,
    out: Annotated[Path | None, typer.Option(help="write every measurement as JSON lines (the bounds last)")] = None,
    compile_only: Annotated[bool, typer.Option(help=COMPILE_ONLY_HELP)] = False,
    coordinator: Annotated[str | None, COORDINATOR] = None,
    num_processes: Annotated[int | None, NUM_PROCESSES] = None,
    process_id: Annotated[int | None, PROCESS_ID] = None,
) -> None:
    """Time every valid decomposition of one problem against the baseline, then its bounds.

    The bounds: the local matmul alone, the collective alone.  With --compile-only, or on a TPU topology
    (--devices tpu:v5p:2x2x2), compile each instead: its memory and its schedule's overlap verdict, beside the
    product as written with XLA's windowed einsum off and on.
    """
    from collective_matmul import Problem

    join_options(coordinator, num_processes, process_id)
    try:
        parsed = Problem.parse(problem)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--problem") from None
    spec = devices_option(devices)
    if not set_up_devices(spec, local_devices=parsed.axis_size // max(spec.count, 1), auto_virtual=parsed.axis_size):
        return None
    if is_compile_only(devices, compile_only):
        results = _compile_sweep([parsed], spec)
        if out is not None:
            out.write_text("".join(r.model_dump_json() + "\n" for r in results))
            console.print(f"wrote {len(results)} compiled candidates to {out}")
        return
    _run_sweep(parsed, repeats=repeats, warmup=warmup, out=out)


def _compile_sweep(problems, spec, devices=None) -> list:
    """Every candidate of each of ``problems`` compiled (memory per device, overlap verdict) beside the product as
    written, on ``spec``'s devices (a TPU topology's, or ``devices``, else this process's), nothing timed; the
    tables printed by process 0.  Returns the records."""
    import jax
    from rich.progress import Progress

    from cmtune.report import compiled_table
    from cmtune.steps import deviceless
    from cmtune.workers.aot import compile_all_predicted
    from cmtune.workers.measure import ring_mesh_of
    from collective_matmul.planning.space import candidates

    devices = list(devices) if devices is not None else spec.compiled_devices() if spec.compile_only else jax.devices()
    where = spec.label if spec.compile_only else devices[0].platform
    leader, everything = jax.process_index() == 0, []
    if leader:
        deviceless(devices)
    for problem in problems:
        try:
            mesh = ring_mesh_of(devices, problem.axis_size)
        except ValueError as exc:
            raise typer.BadParameter(f"{problem.key}: {exc} of {where}") from None
        configs = candidates(problem, platform=devices[0].platform)
        with Progress(console=console, transient=True, disable=not leader) as progress:
            progress.add_task(f"compiling {len(configs) + 2} programs of {problem.key} for {where}")
            predicted = compile_all_predicted(problem, mesh, configs)
        results = [p.candidate for p in predicted]
        if leader:
            console.print(compiled_table(results, title=f"{problem.key} compiled for {where} ({len(devices)} "
                                                        f"devices, rings of {problem.axis_size})",
                                         predictions=[p.prediction for p in predicted]))
        everything += results
    if leader:
        console.print("compiled only: no tuned config was written (times need the hardware; run `cmtune tune` or a "
                      "worker there)")
    return everything


def _run_sweep(problem, *, repeats: int, warmup: int, out: Path | None) -> None:
    import jax
    from rich.progress import Progress

    from cmtune.report import sweep_table
    from cmtune.workers.measure import OpSession
    from cmtune.workers.sweep import sweep
    from collective_matmul.planning.space import candidates
    from collective_matmul.wire import MeasurementProtocol

    leader = jax.process_index() == 0
    protocol = MeasurementProtocol(repeats=repeats, warmup=warmup)
    session = OpSession(problem, protocol=protocol)
    with Progress(console=console, transient=True, disable=not leader) as progress:
        task = progress.add_task(f"timing {problem.key}", total=len(candidates(problem)) + 1)
        results = sweep(problem, protocol=protocol, on_result=lambda m: progress.advance(task), session=session)
        bounds = session.bounds()  # every process: the bounds rounds are SPMD programs too
        progress.advance(task)
    if not leader:
        return
    console.print(sweep_table(results, title=f"{problem.key} on {results[0].hardware.key}", bounds=bounds))
    if out is not None:
        out.write_text("".join(m.model_dump_json() + "\n" for m in results) + bounds.model_dump_json() + "\n")
        console.print(f"wrote {len(results)} measurements and the bounds to {out}")


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
    timeout: Annotated[float, typer.Option(min=0.1, help="timing budget (s) of one candidate")] = 300.0,
    trial_grace_seconds: Annotated[float, typer.Option(
        min=1, help="a trial may take 2 x its timeout plus this before it counts as hung")] = 120.0,
    out: Annotated[Path | None, typer.Option(help="write the tuned configs as a bundle file")] = None,
    step: Annotated[str | None, typer.Option(
        help="a step spec, path/to/file.py:NAME or package.module:NAME: tune the problems of your own step "
             "(devices: virtual:N or processes:PxD, default virtual:8)")] = None,
    warm_start: Annotated[bool, typer.Option(
        help="time the winners and best rings of the nearest problems tuned before (in this run, and in the "
             "--out bundle if it exists) right after the baseline; a study whose seeds run as their "
             "neighbours did stops early")] = True,
    compile_only: Annotated[bool, typer.Option(help=COMPILE_ONLY_HELP)] = False,
    screen: Annotated[bool | None, typer.Option(
        "--screen/--no-screen", help="compile every candidate for the rings before the search and time the forms "
             "whose schedule overlaps first, the others after them (default: on GPU devices, where XLA's passes "
             "can serialise a ring)")] = None,
    coordinator: Annotated[str | None, COORDINATOR] = None,
    num_processes: Annotated[int | None, NUM_PROCESSES] = None,
    process_id: Annotated[int | None, PROCESS_ID] = None,
) -> None:
    """Tune the decompositions of one or more problems, a model's or your own step's, on local devices.

    With --compile-only, or on a TPU topology: compile every candidate of each and check it, timing nothing.
    """
    join_options(coordinator, num_processes, process_id)
    if sampler not in ("auto", "enumerate", "tpe", "random"):
        raise typer.BadParameter(f"{sampler!r}: expected auto, enumerate, tpe or random", param_hint="--sampler")
    bundled = []
    if warm_start and out is not None and out.exists():  # read before any device is touched: a bad file says so
        from collective_matmul.wire.bundle import Bundle

        try:
            bundled = Bundle.load(out).configs
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--out") from None
    options = dict(trials=trials, minutes=minutes, patience=patience, sampler=sampler, seed=seed,
                   protocol=dict(repeats=repeats, seed=seed, timeout_s=timeout), grace_s=trial_grace_seconds, out=out,
                   warm_start=warm_start, bundled=bundled, screen=screen)
    if step is not None:
        from cmtune import steps

        if problem or model or mesh:
            raise typer.BadParameter("--step tunes your step's own problems: leave out --problem, --model and --mesh")
        if is_compile_only(devices, compile_only):
            return steps.tune(step, devices, lambda found, mesh, axis: _compile_sweep(
                found, devices_option(devices), devices=list(mesh.devices.flat)))
        return steps.tune(step, devices, lambda found, mesh, axis: _tune(found, ring=mesh.shape[axis], mesh=mesh,
                                                                         axis=axis, **options))
    problems = problems_from_options(problem, model, mesh, tensor_axis)
    sizes = {p.axis_size for p in problems}
    if len(sizes) > 1:
        raise typer.BadParameter(f"problems have different ring sizes {sorted(sizes)}: tune them separately")
    ring = sizes.pop()
    spec = devices_option(devices)
    if spec.total is not None and spec.total % ring:
        raise typer.BadParameter(f"rings of {ring} devices do not divide the {spec.total} devices of {devices}: give "
                                 f"a multiple of {ring}", param_hint="--devices")
    if spec.needs_group and not spec.local and ring % spec.count:
        raise typer.BadParameter(f"a ring of {ring} devices does not split over {spec.count} processes")
    if not set_up_devices(spec, local_devices=spec.local or ring // max(spec.count, 1), auto_virtual=ring):
        return None
    if is_compile_only(devices, compile_only):
        _compile_sweep(problems, spec)
        return
    _tune(problems, ring=ring, **options)


def _tune(problems, *, out, **options) -> None:
    """`cmtune.workers.local.tune_problems` with a progress bar a study; process 0 prints the table and adds the
    tuned configs to the ``out`` bundle."""
    import jax
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cmtune.report import tune_table
    from cmtune.workers.local import add_to_bundle, tune_problems

    if options["screen"] is None:
        options["screen"] = jax.devices()[0].platform == "gpu"
    if options["screen"] and jax.process_index() == 0:
        console.print(f"compile screen: every candidate of {len(problems)} problems compiled for the rings first")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=jax.process_index() != 0) as progress:
        def on_study(problem, total):
            bar = progress.add_task(problem.key, total=total)
            return lambda done=False: progress.update(bar, completed=total) if done else progress.advance(bar)

        try:
            tuned = tune_problems(problems, on_study=on_study, **options)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    if tuned is None:  # another process of the group: process 0 reports
        return
    hardware, outcomes = tuned
    console.print(tune_table(outcomes, title=f"tuned on {hardware.key} (jax {hardware.jax_version})"))
    configs = [o.tuned for o in outcomes if o.tuned is not None]
    if out is not None and configs:
        add_to_bundle(out, configs)
        console.print(f"wrote {len(configs)} tuned configs to {out}")
    failed = [o for o in outcomes if o.tuned is None]
    for outcome in failed:
        console.print(f"[red]{outcome.study.problem.key}: {outcome.study.state}: {outcome.study.message}[/red]")
    if failed:
        raise typer.Exit(1)


@app.command()
def problems(
    model: Annotated[str | None, typer.Option(help="preset name or JSON file (default: tiny)")] = None,
    mesh: Annotated[str | None, typer.Option(help="mesh axes, e.g. data=1,model=8 (default)")] = None,
    tensor_axis: Annotated[str | None, typer.Option(help="tensor-parallel axis (default: model)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    step: Annotated[str | None, typer.Option(
        help="a step spec, path/to/file.py:NAME or package.module:NAME: the problems of your own step, "
             "discovered from its compiled module")] = None,
    devices: Annotated[str, typer.Option(help=DEVICES_HELP + " (with --step; default virtual:8)")] = "auto",
    coordinator: Annotated[str | None, COORDINATOR] = None,
    num_processes: Annotated[int | None, NUM_PROCESSES] = None,
    process_id: Annotated[int | None, PROCESS_ID] = None,
) -> None:
    """List the collective-matmul problems of one training step: a model on a mesh, or your own step."""
    from rich.table import Table

    from collective_matmul.planning.models import MeshSpec, TransformerBlock, model_problems

    join_options(coordinator, num_processes, process_id)

    if step is not None:
        from cmtune import steps

        if model or mesh:
            raise typer.BadParameter("--step lists your step's own problems: leave out --model and --mesh")
        return steps.problems(step, devices, as_json)
    model, mesh = model or "tiny", mesh or "data=1,model=8"
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
def verify(
    model: Annotated[str | None, typer.Option(help="model preset or JSON file", rich_help_panel=BLOCK)] = None,
    mesh: Annotated[str | None, typer.Option(
        help="the mesh the configs were tuned for, e.g. data=16,model=8", rich_help_panel=BLOCK)] = None,
    bundle: Annotated[Path | None, typer.Option(
        help="tuned configs from a bundle file", rich_help_panel=CONFIGS)] = None,
    server: Annotated[str | None, typer.Option(
        help="tuned configs from a cmtune service at this URL", rich_help_panel=CONFIGS)] = None,
    token: Annotated[str | None, typer.Option(
        envvar="CMTUNE_TOKEN", help="a reader token for --server (CMTUNE_TOKEN keeps it out of ps)",
        rich_help_panel=CONFIGS)] = None,
    tensor_axis: Annotated[str | None, typer.Option(
        help="tensor-parallel axis (default: model)", rich_help_panel=BLOCK)] = None,
    devices: Annotated[
        str, typer.Option(help=DEVICES_HELP + "; auto = virtual CPU devices, one per ring member")
    ] = "auto",
    repeats: Annotated[int, typer.Option(
        min=1, help="rounds: timed runs of every variant", rich_help_panel=TIMING)] = 7,
    warmup: Annotated[int, typer.Option(min=0, help="untimed runs of every variant first", rich_help_panel=TIMING)] = 2,
    seed: Annotated[int, typer.Option(min=0, help="seed of the parameters and inputs", rich_help_panel=TIMING)] = 0,
    timeout: Annotated[float, typer.Option(
        min=1, help="stop timing after this many seconds", rich_help_panel=TIMING)] = 600.0,
    ablation: Annotated[bool, typer.Option(
        help="also time the tuned step with each tuned role set back", rich_help_panel=BLOCK)] = True,
    json_out: Annotated[Path | None, typer.Option(
        "--json", help="write the step measurement as JSON", rich_help_panel=TIMING)] = None,
    step: Annotated[str | None, typer.Option(
        help="a step spec, path/to/file.py:NAME or package.module:NAME: time your own step as written against "
             "the drop-in (devices: virtual:N or processes:PxD, default virtual:8)", rich_help_panel=STEP)] = None,
    name: Annotated[str | None, typer.Option(
        help="with --step: the name its overrides are stored under (default: NAME; Tuned(model=...) in training)",
        rich_help_panel=STEP)] = None,
    decide: Annotated[bool, typer.Option(
        help="run the step search (the op-level winners, the whole-step alternatives, then role by role over "
             "each role's candidates) and write the per-role overrides of its choice into --bundle",
        rich_help_panel=SEARCH)] = False,
    search_rounds: Annotated[int, typer.Option(
        min=0, max=50, help="with --decide: rounds of the step search, the seeds' included, before the choice is "
                            "graded in fresh rounds (0 or 1: one round of the standard menu)",
        rich_help_panel=SEARCH)] = STEP_SEARCH_ROUNDS,
    round_variants: Annotated[int, typer.Option(
        min=1, max=16, help="with --decide: changes of one role a search round times",
        rich_help_panel=SEARCH)] = STEP_ROUND_VARIANTS,
    compile_only: Annotated[bool, typer.Option(
        help="with --step: compile the step as written (XLA's windowed einsum at its default, off and on, where the "
             "backend has it) and through the drop-in, and check each (memory, collectives, overlap), timing "
             "nothing (what a TPU topology, --devices tpu:v5p:2x2x1, can only do)", rich_help_panel=STEP)] = False,
    share: Annotated[bool, typer.Option(
        help="with --step: column calls of one activation share one gather (q/k/v, gate/up: "
             "collective_matmul.ops.share), and the step is also timed without (tuned-no-share); --no-share: every "
             "call gathers for itself", rich_help_panel=STEP)] = True,
    coordinator: Annotated[str | None, COORDINATOR] = None,
    num_processes: Annotated[int | None, NUM_PROCESSES] = None,
    process_id: Annotated[int | None, PROCESS_ID] = None,
) -> None:
    """Time the whole training step with the tuned configs against the step as written (and the ablations).

    The reference block (--model, --mesh) or your own step (--step).  With --step and --compile-only, or on a TPU
    topology: compile the step as written and through the drop-in, and check each, timing nothing.
    """
    join_options(coordinator, num_processes, process_id)
    from cmtune.workers.overrides import SearchBudget
    from collective_matmul import Bundle
    from collective_matmul.block import check_block
    from collective_matmul.planning.models import MeshSpec, TransformerBlock, model_problems
    from collective_matmul.wire import MeasurementProtocol

    protocol = MeasurementProtocol(repeats=repeats, warmup=warmup, seed=seed, timeout_s=timeout)
    budget = SearchBudget(search_rounds, round_variants) if decide else None  # with --decide: the step search's
    given = (bundle is not None) + (server is not None)  # a step may take neither: the cost model's choices
    if given > 1 or (step is None and given == 0):
        raise typer.BadParameter("give the tuned configs with --bundle FILE or --server URL (one of them)")
    if step is not None:
        from cmtune import steps

        if model or mesh:
            raise typer.BadParameter("--step times your own step: leave out --model and --mesh")
        if is_compile_only(devices, compile_only):
            if decide:
                raise typer.BadParameter("--decide times the step: it needs devices that run (not --compile-only)")
            return steps.verify_compiled(step, devices, bundle=bundle, server=server, token=token, name=name,
                                         share=share)
        return steps.verify(step, devices, bundle=bundle, server=server, token=token, name=name,
                            protocol=protocol, budget=budget, json_out=json_out, share=share)
    if model is None or mesh is None:
        raise typer.BadParameter("give --model and --mesh (or --step SPEC for your own step)")
    if is_compile_only(devices, compile_only):
        raise typer.BadParameter("--compile-only verifies a step spec (--step): the reference block is timed only")
    if name:
        raise typer.BadParameter("--name is for --step (a model's overrides are stored under its name)")
    if decide and bundle is None:
        raise typer.BadParameter("--decide writes the per-role overrides into the bundle: give --bundle FILE")
    try:
        block = TransformerBlock.load(model)
        spec = MeshSpec.parse(mesh, tensor_axis)
        model_problems(block, spec)
        check_block(block, tensor_size=spec.tensor_size, batch_shards=spec.batch_shards)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if bundle is not None:
        try:
            Bundle.load(bundle)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--bundle") from None
    ring = spec.tensor_size
    device_spec = devices_option(devices)
    if device_spec.kind == "virtual" and device_spec.count < ring:
        raise typer.BadParameter(f"{block.name} on {mesh} needs a ring of {ring} devices but --devices {devices} "
                                 f"gives {device_spec.count}; use --devices virtual:{ring}")
    if device_spec.needs_group and ring % device_spec.count:
        raise typer.BadParameter(f"a ring of {ring} devices does not split over {device_spec.count} processes; "
                                 f"use processes:N with N dividing {ring}")
    if not set_up_devices(device_spec, local_devices=ring // max(device_spec.count, 1), auto_virtual=ring):
        return
    _verify(block, spec, bundle=bundle, server=server, token=token, protocol=protocol, budget=budget,
            ablation=ablation, json_out=json_out)


def _verify(block, spec, *, bundle, server, token, protocol, budget, ablation, json_out) -> None:
    """`cmtune.workers.verify.verify_step` of a `BlockVerify`, process 0 printing."""
    import time

    import jax

    from cmtune.steps import show_progress
    from cmtune.workers.step import BlockVerify, step_layout
    from cmtune.workers.verify import verify_step

    started = time.monotonic()
    try:
        layout = step_layout(block, spec, jax.devices())
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    target = BlockVerify(block, spec, layout, bundle=bundle, server=server, token=token, protocol=protocol,
                         ablation=ablation)
    result = verify_step(target, budget=budget, bundle=bundle, say=show_progress)
    if result is None:  # another process of the group: process 0 reports
        return
    mesh_text = ",".join(f"{name}={size}" for name, size in result.mesh.items())
    show_step(result, title=f"training step of {block.name} on {mesh_text}, {result.hardware.key} "
                            f"(jax {result.hardware.jax_version})", started=started, json_out=json_out)


@app.command()
def predict(
    step: Annotated[str, typer.Option(help="a step spec, path/to/file.py:NAME or package.module:NAME")],
    devices: Annotated[str, typer.Option(help="a TPU slice or a GPU node that is not here: tpu:TOPOLOGY or "
                                             "gpu:CARD:D")],
    bundle: Annotated[Path | None, typer.Option(
        help="cmtune's choices from a bundle file (default: the cost model's)")] = None,
    products: Annotated[bool, typer.Option(
        help="also compile and predict each discovered product's candidates (minutes on a large step)")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Predict a step's time on a TPU slice or GPU node from this host: as written, with cmtune's choices, and
    each product's predicted-best ring.  Compiled, never run: every figure is predicted by the cost model it
    names, never measured."""
    from cmtune import steps

    steps.predict(step, devices, bundle=bundle, as_json=as_json, products=products)
