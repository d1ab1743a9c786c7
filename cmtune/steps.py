"""The ``--step SPEC`` halves of `cmtune problems | tune | verify` (and `cmtune submit`): a user's own step.

Each sets the devices up first (``--devices virtual:N``, or ``processes:PxD``: the step's mesh,
not one ring, decides how many), then imports the spec and calls NAME (`cmtune.workers.userstep`).
In a group of processes every process does the same, and process 0 prints and decides.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from cmtune.common import console, devices_option, set_up_devices, show_step
from cmtune.workers.cluster import DeviceSpec
from cmtune.workers.userstep import SpecError, SpecRef

if TYPE_CHECKING:
    from cmtune.workers.overrides import SearchBudget
    from collective_matmul.client.tuned import Tuned
    from collective_matmul.wire import MeasurementProtocol

DEFAULT_DEVICES = "virtual:8"


def prepare(devices: str) -> DeviceSpec | None:
    """Set the devices up for a step (None: this command was re-run as a group and has finished).

    Raises:
        typer.BadParameter: for ``processes:N`` without D, or ``auto``.
    """
    spec = devices_option(devices)
    if spec.kind == "auto":
        spec = DeviceSpec.parse(DEFAULT_DEVICES)
    if spec.kind == "processes" and not spec.local:
        raise typer.BadParameter(f"{devices!r}: a step's mesh decides the device count; give processes:PxD "
                                 f"(e.g. processes:{spec.count}x4)", param_hint="--devices")
    return spec if set_up_devices(spec, local_devices=spec.local) else None


@contextmanager
def spec_errors():
    """A step spec that breaks its contract is a bad ``--step`` (the message says what to fix)."""
    try:
        yield
    except SpecError as exc:
        raise typer.BadParameter(str(exc), param_hint="--step") from None


def load(text: str):
    """Parse and import a step spec: ``(SpecRef, NAME)``."""
    with spec_errors():
        ref = SpecRef.parse(text)
        return ref, ref.load()


def discover_step(ref: SpecRef, fn, spec: DeviceSpec | None = None):
    """NAME's step as written, and its collective matmuls: ``(Built, Discovery)`` (on a TPU topology's devices
    where ``spec`` names one: compiled, never run)."""
    from cmtune.workers.userstep import Built
    from collective_matmul.programs.discovery import discover

    devices = spec.compiled_devices() if spec is not None and spec.compile_only else None
    with spec_errors():
        built = Built.of(fn, None, spec=str(ref), devices=devices)
        return built, discover(built.step, built.args, built.mesh)


def _leader() -> bool:
    import jax

    return jax.process_index() == 0


def show_discovery(ref: SpecRef, built, discovery) -> None:
    from cmtune.report import discovery_tables
    from collective_matmul.programs.roles import group_label

    mesh = ",".join(f"{n}={s}" for n, s in built.mesh.shape.items())
    for table in discovery_tables(discovery, title=f"collective matmuls of {ref} on {mesh}"):
        console.print(table)
    for group in discovery.groups:
        console.print(f"one gather, {len(group)} projections: {group_label(group)} (the drop-in shares it, and runs "
                      "their summed input gradient as one problem, listed under this label: "
                      "collective_matmul.ops.share)")
    for warning in discovery.warnings:
        console.print(f"[yellow]{warning}[/yellow]")
    deviceless(built.mesh.devices.flat)


def deviceless(devices) -> None:
    """Say what a compile for ``devices`` set where they are deviceless GPUs (nothing for other devices)."""
    from collective_matmul.programs.gpus import deviceless_note, deviceless_options

    if note := deviceless_note(deviceless_options(devices)):
        console.print(note)


def no_problems(ref: SpecRef, discovery, *, out: Console | None = None) -> None:
    """Say that the step has nothing to tune (on ``out``: standard error under ``--json``) and exit 1."""
    from cmtune.report import seen_line

    out = out or console
    out.print(f"[red]{ref}: the step has no collective matmul cmtune decomposes"
              + (f" ({len(discovery.skipped)} collective(s) skipped above)" if discovery.skipped else "")
              + ": nothing to tune[/red]")
    out.print(seen_line(discovery))
    raise typer.Exit(1)


def problems(step: str, devices: str, as_json: bool) -> None:
    """`cmtune problems --step`: list what discovery finds."""
    spec = prepare(devices)
    if spec is None:
        return
    ref, fn = load(step)
    built, discovery = discover_step(ref, fn, spec)
    if not _leader():
        return
    if as_json:  # standard output is the JSON object alone; sentences go to standard error
        print(discovery.model_dump_json(indent=2))
    else:
        show_discovery(ref, built, discovery)
    if not discovery.problems:
        no_problems(ref, discovery, out=Console(stderr=True) if as_json else None)


def tune(step: str, devices: str, tune_problems) -> None:
    """`cmtune tune --step`: discover, then tune each unique problem on the rings of its axis in the step's own
    mesh, all at once, as the step runs them (its configs keyed as the drop-in looks them up:
    `collective_matmul.planning.models.ring_hardware`).

    ``tune_problems(problems, mesh, axis)`` runs the tuner (`cmtune.workers.local.tune_problems`).
    """
    spec = prepare(devices)
    if spec is None:
        return
    ref, fn = load(step)
    built, discovery = discover_step(ref, fn, spec)
    if _leader():
        show_discovery(ref, built, discovery)
    if not discovery.problems:
        if _leader():
            no_problems(ref, discovery)
        return
    by_axis: dict[str, list] = {}
    for found in discovery.problems:
        axis = found.axis or next((a for a, s in built.mesh.shape.items() if s == found.problem.axis_size), None)
        if axis is None:
            raise typer.BadParameter(f"{found.problem.key}: no mesh axis of size {found.problem.axis_size}")
        if found.problem not in by_axis.setdefault(axis, []):
            by_axis[axis].append(found.problem)
    for axis, unique in by_axis.items():
        tune_problems(unique, built.mesh, axis)


def verified_client(server: str | None, token: str | None, bundle: Path | None, model: str, *,
                    share: bool = True) -> Tuned:
    """The `Tuned` client verify builds its tuned step with: the configs of a bundle or a server (a problem they
    have not measured runs the baseline, as in training), or with neither the cost model's choices; ``share``:
    whether column calls of one activation share one gather."""
    from collective_matmul.client.tuned import Tuned

    tuned = Tuned(server, token=token, bundle=bundle, model=model,
                  unmeasured="costmodel" if server is None and bundle is None else "baseline")
    tuned.share = share
    return tuned


def verify_compiled(step: str, devices: str, *, bundle: Path | None, server: str | None, token: str | None,
                    name: str | None, share: bool = True) -> None:
    """`cmtune verify --step --compile-only` (what a TPU topology allows): `cmtune.workers.aot.compile_user_step`,
    its call sites and its table printed.  Nothing runs."""
    import jax

    from cmtune.report import compiled_steps_table
    from cmtune.workers.aot import compile_user_step
    from collective_matmul.programs.gpus import deviceless_note

    spec = prepare(devices)
    if spec is None:
        return
    if jax.process_count() > 1:
        raise typer.BadParameter("--compile-only compiles in one process: give virtual:N or tpu:TOPOLOGY",
                                 param_hint="--devices")
    ref, fn = load(step)
    tuned = verified_client(server, token, bundle, name or ref.name, share=share)
    target = spec.compiled_devices() if spec.compile_only else None
    with spec_errors():
        compiled = compile_user_step(fn, str(ref), tuned, devices=target)
    show_sites(ref, compiled.sites)
    where = spec.label if spec.compile_only else compiled.platform
    mesh_text = ",".join(f"{n}={s}" for n, s in compiled.mesh.items())
    console.print(compiled_steps_table(compiled.variants, title=f"{ref} compiled for {where} on {mesh_text}"))
    if note := deviceless_note(compiled.device_options):
        console.print(note)


def show_sites(ref: SpecRef, sites) -> None:
    """The call sites a `Tuned` client traced (`Tuned.report`), the gathers they shared, and what to fix."""
    from cmtune.report import sites_table

    console.print(sites_table(sites, title=f"call sites of {ref} through the drop-in ({len(sites.applied)} applied, "
                                           f"{len(sites.fell_back)} fell back)"))
    if sites.groups:
        console.print(sites.groups_line())
    for line in filter(None, (sites.unmatched_line(), *sites.advice())):
        console.print(f"[yellow]{line}[/yellow]")


def verify(step: str, devices: str, *, bundle: Path | None, server: str | None, token: str | None,
           name: str | None, protocol: MeasurementProtocol, budget: SearchBudget | None, json_out: Path | None,
           share: bool = True) -> None:
    """`cmtune verify --step`: `cmtune.workers.verify.verify_step` of a `UserVerify`, process 0 printing
    (``budget``: with ``--decide``, the step search's)."""
    import jax

    from cmtune.workers.userstep import NoDropInCall, UserVerify
    from cmtune.workers.verify import verify_step

    if budget is not None and bundle is None:
        raise typer.BadParameter("--decide writes the per-role overrides into the bundle: give --bundle FILE")
    if prepare(devices) is None:
        return
    started = time.monotonic()
    ref, fn = load(step)
    model = name or ref.name
    say = console.print if jax.process_index() == 0 else (lambda *_: None)
    target = UserVerify(fn, str(ref), lambda: verified_client(server, token, bundle, model), model=model,
                        protocol=protocol, share=share)
    try:
        with spec_errors():
            result = verify_step(target, budget=budget, bundle=bundle, say=lambda event: show_progress(event, ref=ref))
    except NoDropInCall as exc:
        say(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    if result is None:  # another process of the group: process 0 reports
        return
    mesh_text = ",".join(f"{n}={s}" for n, s in result.mesh.items())
    show_step(result, title=f"training step of {ref} on {mesh_text}, {result.hardware.key} (jax "
                            f"{result.hardware.jax_version}); reference: the step as written",
              started=started, json_out=json_out)


def show_progress(event, *, ref: SpecRef | None = None) -> None:
    """Print one event of a measured verify (`cmtune.workers.progress`): a line in its level's style, the reference
    block's configs per role, or the call sites of ``ref``'s step."""
    from cmtune.report import roles_table
    from cmtune.workers.progress import Level, ProgressLine, RolesResolved, SitesTraced

    if isinstance(event, ProgressLine):  # each level's Rich style; none: plain
        style = {Level.DETAIL: "dim", Level.ROUND: "bold", Level.WARNING: "yellow", Level.FAILURE: "red"}.get(
            event.level)
        console.print(f"[{style}]{event.text}[/{style}]" if style else event.text)
    elif isinstance(event, RolesResolved):
        console.print(roles_table(event.resolved, title="configs per role"))
    elif isinstance(event, SitesTraced):
        show_sites(ref, event.sites)


def discovered_body(step: str, name: str | None):
    """For `cmtune submit --step`: the spec's problems as a `DiscoveredStep`, and the ring's hardware
    (None on the processes other than 0)."""
    from collective_matmul.client.tuned import ring_hardware
    from collective_matmul.wire import DiscoveredStep

    ref, fn = load(step)
    built, discovery = discover_step(ref, fn)
    if not _leader():
        return None, None
    show_discovery(ref, built, discovery)
    if not discovery.problems:
        no_problems(ref, discovery)
    axis = next((p.axis for p in discovery.problems if p.axis), built.mesh.axis_names[-1])
    body = DiscoveredStep(name=name or ref.name, mesh={str(n): int(s) for n, s in built.mesh.shape.items()},
                          problems=discovery.problems)
    return body, ring_hardware(built.mesh, axis)




def predict(step: str, devices: str, *, bundle: Path | None, as_json: bool, products: bool) -> None:
    """`cmtune predict --step`: the step compiled for ``devices`` and predicted, as written and with cmtune's choices
    (the bundle's configs, else the cost model's), and each discovered product's programs predicted.  Nothing
    runs: every figure is the cost model's prediction."""
    import json

    import jax

    from cmtune.report import compiled_steps_table, predicted_products_table
    from cmtune.tuner.variants import REFERENCE
    from cmtune.workers.aot import compile_user_step, predict_problem
    from cmtune.workers.measure import ring_mesh_of
    from collective_matmul.programs.gpus import deviceless_note

    spec = prepare(devices)
    if spec is None:
        return
    if jax.process_count() > 1 or not spec.compile_only:
        raise typer.BadParameter("a prediction compiles for devices that are not here: give tpu:TOPOLOGY or "
                                 "gpu:CARD:D", param_hint="--devices")
    ref, fn = load(step)
    tuned = verified_client(None, None, bundle, ref.name)
    with spec_errors():
        compiled = compile_user_step(fn, str(ref), tuned, devices=spec.compiled_devices())
    by_label = {(v.label, v.windowed_einsum): v for v in compiled.variants}
    written = by_label.get((REFERENCE, "default")) or by_label.get((REFERENCE, None))
    if written is None or written.prediction is None:
        raise typer.BadParameter(f"no prediction for {spec.label}: the step as written did not compile, or cmtune "
                                 "has no figures for its device kind", param_hint="--devices")
    on = by_label.get((REFERENCE, "on"))
    choices = by_label.get(("tuned", None))
    found = []
    if products:
        built, discovery = discover_step(ref, fn, spec)
        roles: dict[str, list[str]] = {}
        for p in discovery.problems:
            roles.setdefault(p.problem.key, [])
            if f"{p.role} ({p.slot})" not in roles[p.problem.key]:
                roles[p.problem.key].append(f"{p.role} ({p.slot})")
        problems = {p.problem.key: p.problem for p in discovery.problems}
        for key, problem in problems.items():
            with spec_errors():
                got = predict_problem(problem, ring_mesh_of(list(built.mesh.devices.flat), problem.axis_size))
            if got is not None:
                found.append((", ".join(roles[key]), got))

    def seconds(variant):
        return variant.prediction.seconds if variant is not None and variant.prediction is not None else None

    models = sorted({v.prediction.cost_model for v in compiled.variants if v.prediction is not None})
    note = deviceless_note(compiled.device_options)
    if as_json:
        print(json.dumps({
            "devices": spec.label, "cost_model": ", ".join(models), "predicted": True, "note": note,
            "step": {"as_written_s": seconds(written), "cmtune_s": seconds(choices), "windowed_einsum_s": seconds(on),
                     "cmtune_configs": "bundle" if bundle is not None else "costmodel"},
            "products": [{"role": role, "key": got.problem.key, "as_written_s": got.as_written_s,
                          "best": got.best.id if got.best else None, "best_s": got.best_s,
                          "windowed_einsum_s": got.windowed_einsum_s} for role, got in found],
        }, indent=2))
        return
    mesh_text = ",".join(f"{n}={s}" for n, s in compiled.mesh.items())
    console.print(compiled_steps_table(compiled.variants, title=f"{ref} compiled for {spec.label} on {mesh_text}"))
    if found:
        console.print(predicted_products_table(found, title=f"the products of {ref}, each compiled and predicted"))
    if note:
        console.print(note)
