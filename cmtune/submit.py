"""`cmtune submit | status`: clients of a running service's REST API (neither the service nor JAX)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cmtune.common import SERVER, TOKEN_FILE, console, devices_option, problems_from_options, read_token_file

if TYPE_CHECKING:
    from collective_matmul.client.rest import ApiClient
    from collective_matmul.planning.problem import Hardware
    from collective_matmul.wire import HardwareIn

app = typer.Typer(no_args_is_help=True)


@dataclass(frozen=True, kw_only=True)
class HardwareOptions:
    """`cmtune submit`'s hardware options as given (None: left out)."""

    platform: str | None = None
    device_kind: str | None = None
    device_count: int | None = None
    process_count: int | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.platform, self.device_kind, self.device_count, self.process_count))


def study_hardware(options: HardwareOptions, devices: int, pool: HardwareIn | None = None) -> HardwareIn:
    """The hardware a study of a problem or a model is submitted for.

    Args:
        options: the hardware options given.
        devices: the problem's ring, or the model's mesh's devices: the device count where none is given.
        pool: the hardware of the registered workers (or of the screened devices), used whole where no option is
            given.

    Returns:
        ``pool`` where no option is given and it is known, else the options over CPU's defaults (one process).
    """
    from collective_matmul.wire import HardwareIn

    if pool is not None and not options.given:
        return pool
    return HardwareIn(platform=options.platform or "cpu", device_kind=options.device_kind or "cpu",
                      device_count=options.device_count or devices, process_count=options.process_count or 1)


def step_hardware(options: HardwareOptions, ring: Hardware) -> HardwareIn:
    """The hardware a step's problems are submitted for: the options over the ring the step's mesh has here (its
    ``device_count`` the ring's; ``--device-count`` the slice's devices)."""
    from collective_matmul.wire import HardwareIn

    return HardwareIn(platform=options.platform or ring.platform, device_kind=options.device_kind or ring.device_kind,
                      device_count=ring.device_count, process_count=options.process_count or ring.process_count,
                      slice_devices=options.device_count or ring.slice_devices)


@contextmanager
def _api(server: str, token: str | None, token_file: Path | None = None) -> Iterator[ApiClient]:
    """The service's API; an error it answers is printed in one line (what to fix) and the command exits 1."""
    from collective_matmul.client.rest import ApiClient, ApiError

    with ApiClient(server, token or read_token_file(token_file), timeout=30) as api:
        try:
            yield api
        except ApiError as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(1) from None


@app.command()
def submit(
    server: Annotated[str, SERVER] = "http://127.0.0.1:8470",
    token: Annotated[str | None, typer.Option(
        envvar="CMTUNE_TOKEN", help="an admin token (CMTUNE_TOKEN keeps it out of ps)")] = None,
    token_file: Annotated[Path | None, TOKEN_FILE] = None,
    problem: Annotated[list[str] | None, typer.Option(help="problem spec (repeatable)")] = None,
    model: Annotated[str | None, typer.Option(help="preset name or JSON file (with --mesh)")] = None,
    mesh: Annotated[str | None, typer.Option(help="e.g. data=1,model=8")] = None,
    tensor_axis: Annotated[str | None, typer.Option()] = None,
    platform: Annotated[str | None, typer.Option(
        help="hardware to tune on (default: the registered workers' hardware, where they are of one kind; with "
             "--step, the platform of the step's ring here)")] = None,
    device_kind: Annotated[str | None, typer.Option(help="(default: the workers'; cpu with --platform cpu; with "
                                                         "--step, the ring's)")] = None,
    device_count: Annotated[int | None, typer.Option(
        min=1, help="the devices of the hardware to tune on: its workers tune every ring whose size divides them, "
                    "all at once (default: the workers'; with --platform, the mesh's devices with --model, the "
                    "ring's with --problem; with --step, the step's mesh's)")] = None,
    process_count: Annotated[int | None, typer.Option(
        min=1, help="the processes of the hardware (default: the workers'; 1 with --platform; with --step, the "
                    "ring's)")] = None,
    trials: Annotated[int | None, typer.Option(min=1, help="trial budget per problem")] = None,
    force: Annotated[bool, typer.Option(help="tune again even if tuned")] = False,
    warm_start: Annotated[bool, typer.Option(
        help="seed each new study with the winners and best rings of the nearest problems tuned on the "
             "hardware")] = True,
    step: Annotated[str | None, typer.Option(
        help="a step spec, path/to/file.py:NAME or package.module:NAME: discover your step's problems here "
             "(needs JAX) and send them with their roles; the service never runs your code")] = None,
    name: Annotated[str | None, typer.Option(help="with --step: the name to submit it under (default: NAME)")] = None,
    devices: Annotated[str, typer.Option(
        help="with --step or --screen: virtual:N, gpu:CARD:D or tpu:TOPOLOGY (compiled on any host), or with --step "
             "processes:PxD (default virtual:8)")] = "auto",
    screen: Annotated[bool, typer.Option(
        "--screen/--no-screen", help="compile every candidate of each problem here for --devices (e.g. gpu:h100:8, "
                                     "with cmtune[gpu]) and send the verdicts: each study times the forms that "
                                     "overlap first (default hardware: those devices)")] = False,
) -> None:
    """Submit problems, a model + mesh, or your own step's problems, to a running service."""
    from collective_matmul.planning.models import MeshSpec, TransformerBlock
    from collective_matmul.wire import Budget, MeshIn, StudyCreate

    if screen and devices_option(devices).needs_group:
        raise typer.BadParameter(f"{devices!r}: the screen compiles on this host: give virtual:N, gpu:CARD:D or "
                                 "tpu:TOPOLOGY", param_hint="--devices")
    options = HardwareOptions(platform=platform, device_kind=device_kind, device_count=device_count,
                              process_count=process_count)
    study = dict(budget=Budget(trials=trials), force=force, warm_start=warm_start)

    if step is not None:
        if problem or model or mesh:
            raise typer.BadParameter("--step sends your step's own problems: leave out --problem, --model, --mesh")
        from cmtune import steps

        spec = steps.prepare(devices)
        if spec is None:
            return
        found, ring = steps.discovered_body(step, name)
        if found is None:  # a process other than 0 of a group
            return
        screens = _screens([p.problem for p in found.problems], spec) if screen else []
        bodies = [StudyCreate(discovered=found, hardware=step_hardware(options, ring), screens=screens, **study)]
        return _post(server, token, token_file, bodies)
    screens, pool = [], None
    if screen:  # the problems are derived here too (the service derives a model's again, and checks the screens)
        from cmtune import steps

        spec = steps.prepare(devices)
        if spec is None:
            return
        screens = _screens(problems_from_options(problem, model, mesh, tensor_axis), spec)
        screened_on = _screened_hardware(spec)
    if not options.given:
        pool = screened_on if screen else _pool_hardware(server, token, token_file)

    if model and not problem:  # the service derives the model's problems (and says what does not fit)
        if not mesh:
            raise typer.BadParameter("--model needs --mesh, e.g. --mesh data=1,model=8")
        try:
            spec = MeshSpec.parse(mesh, tensor_axis)
            # a file is read here, on the client: the API takes a preset name or an inline shape
            shape = model if model in _presets() else TransformerBlock.load(model)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        bodies = [StudyCreate(model=shape, mesh=MeshIn(axes=spec.axes, tensor_axis=spec.tensor_axis),
                              hardware=study_hardware(options, spec.device_count, pool), screens=screens, **study)]
    else:
        by_key = {s.problem: s for s in screens}
        bodies = [StudyCreate(problem=p, hardware=study_hardware(options, p.axis_size, pool),
                              screens=[by_key[p.key]] if p.key in by_key else [], **study)
                  for p in problems_from_options(problem, model, mesh, tensor_axis)]
    _post(server, token, token_file, bodies)


def _screens(problems, spec) -> list:
    """The compile screen of each unique problem with a ring (`cmtune.workers.aot.screen_problems`), compiled for the
    devices set up here, a line each: what the studies will time first."""
    from cmtune.report import screen_summary
    from cmtune.steps import deviceless
    from cmtune.workers.aot import screen_problems

    devices = _screen_devices(spec)
    deviceless(devices)
    try:
        screens = screen_problems(problems, devices)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--devices") from None
    for screened in screens:
        console.print(f"{screened.problem} on {screened.device_kind}: {screen_summary(screened.screen)}")
    return screens


def _screen_devices(spec) -> list:
    """The devices a screen compiles for: a compile-only target's (a GPU node's, a TPU slice's), else JAX's."""
    import jax

    return spec.compiled_devices() if spec.compile_only else jax.devices()


def _screened_hardware(spec):
    """The hardware of the devices the screen compiles for (`HardwareIn`): what the studies are on by default."""
    from collective_matmul.planning.problem import Hardware
    from collective_matmul.wire import HardwareIn

    return HardwareIn.of(Hardware.detect(_screen_devices(spec)))


def _pool_hardware(server: str, token: str | None, token_file: Path | None):
    """The hardware of the registered workers (`HardwareIn`), where they are all of one machine; else exit 1
    saying which options to give (no worker: the hardware is unknown; several kinds: which one is meant)."""
    from collective_matmul.wire import HardwareIn

    with _api(server, token, token_file) as api:
        workers = api.workers()
    kinds = {w.hardware_key: w.hardware for w in workers}
    if len(kinds) == 1:
        (key, hardware), = kinds.items()
        console.print(f"hardware: {key}, the registered workers' ({len(workers)})")
        return HardwareIn.of(hardware)
    known = f"the workers are of {len(kinds)} kinds: {', '.join(sorted(kinds))}" if kinds else \
        "no worker is registered to say what it runs on"
    console.print(f"[red]{known}: give the hardware to tune on, e.g. --platform cpu (with --device-kind, "
                  "--device-count and --process-count where they are not cpu's defaults)[/red]")
    raise typer.Exit(1)


def _post(server: str, token: str | None, token_file: Path | None, bodies) -> None:
    with _api(server, token, token_file) as api:
        for body in bodies:
            created = api.submit(body)
            for study in created.studies:
                seeded = f", {len(study.seeds)} seeds from {_neighbours(study)}" if study.seeds else ""
                screen = study.settings.get("screen") or ()
                if screen:
                    overlapping = sum(s["overlap"] == "overlaps" for s in screen)
                    seeded += f", screened: {overlapping} of {len(screen)} forms overlap, timed first"
                console.print(f"study {study.id}: {study.problem_key} ({study.trials_budget} trials{seeded})")
            for skip in created.skipped:
                console.print(f"skipped {skip.problem}: {skip.reason} (study {skip.study_id})")
            if created.joined:
                console.print(f"joined submission {created.submission_id}: the same model, mesh and hardware is "
                              "being measured already")
            elif created.submission_id:
                console.print(f"submission {created.submission_id}")


def _presets() -> set[str]:
    from collective_matmul.planning.models import PRESETS

    return set(PRESETS)


@app.command()
def status(
    server: Annotated[str, SERVER] = "http://127.0.0.1:8470",
    token: Annotated[str | None, typer.Option(
        envvar="CMTUNE_TOKEN", help="a reader token (CMTUNE_TOKEN keeps it out of ps)")] = None,
    token_file: Annotated[Path | None, TOKEN_FILE] = None,
    state: Annotated[str | None, typer.Option(help="only studies in this state")] = None,
) -> None:
    """Studies and workers of a running service."""
    from rich.table import Table

    with _api(server, token, token_file) as api:
        studies = api.studies(state=state)
        workers = api.workers()
        models = [api.submission(s.id) for s in api.submissions()[:10]]
    table = Table(title=f"studies on {server} ({studies.total})")
    for col in ("id", "state", "problem", "hardware", "trials", "best so far", "tuned", "compute", "communication",
                "bound", "hidden", "why", "seeded from"):
        table.add_column(col)
    for s in studies.items:
        best = f"{s.best.speedup:.2f}x" if s.best else "-"
        t = s.tuned
        tuned = f"{s.tuned_decomposition_id} {t.speedup:.2f}x" if t else "-"
        table.add_row(str(s.id), s.state, s.problem_key, s.hardware_key,
                      f"{s.trials_done}/{s.trials_budget} (+{s.trials_running} running)", best, tuned,
                      *_bounds_cells(t), _neighbours(s) or "-")
    console.print(table)
    reconfirming = [s for s in studies.items if s.reconfirm is not None]
    if reconfirming:
        console.print(_reconfirm_table(reconfirming))
    if models:
        console.print(_models_table(models))
    console.print(f"workers online: {sum(w.online for w in workers)} of {len(workers)} registered")
    rings = {w.hardware_key: w.ring_keys[1:] for w in workers if w.online and len(w.ring_keys) > 1}
    for hardware, keys in sorted(rings.items()):
        console.print(f"workers of {hardware} also tune its rings: {', '.join(keys)}")
    stacks = sorted({str(w.software) for w in workers if w.online})
    if stacks:
        console.print(f"software stacks online: {'; '.join(stacks)}")


def _reconfirm_table(studies):
    """Configs re-confirmed on a new software stack: waiting for a worker of it, re-confirmed, or replaced."""
    from rich.table import Table

    table = Table(title="re-confirmations on a new software stack")
    for col in ("study", "problem", "hardware", "measured on", "re-confirmed on", "stored", "outcome", "now"):
        table.add_column(col)
    for s in studies:
        stored = s.reconfirm.config
        style = {"re-confirmed": "green", "replaced": "yellow", "waiting": "dim"}.get(s.outcome, "red")
        table.add_row(str(s.id), s.problem_key, s.hardware_key, str(stored.software), str(s.software),
                      f"{stored.decomposition.id} {stored.speedup:.2f}x", f"[{style}]{s.outcome}[/{style}]",
                      f"{s.tuned_decomposition_id} {s.tuned.speedup:.2f}x" if s.tuned else "-")
    return table


def _neighbours(study) -> str:
    """Where a study's seeds came from: each neighbour's shape, with its study where it has one."""
    found = {}
    for seed in study.seeds:
        where = f"#{seed.study_id}" if seed.study_id is not None else seed.source
        found.setdefault(seed.neighbour, f"{seed.neighbour.split(':')[1]} ({where})")
    return ", ".join(found.values())


def _bounds_cells(tuned) -> list[str]:
    """A tuned config's compute, communication, bound, hidden fraction and reason, as table cells."""
    from cmtune.report import fmt_fraction, fmt_seconds

    if tuned is None:
        return ["-"] * 5
    return [fmt_seconds(tuned.compute_s), fmt_seconds(tuned.communication_s), fmt_seconds(tuned.bound_s),
            fmt_fraction(tuned.hidden_fraction), tuned.reason]


def _models_table(models):
    """Per submitted model: the time saved per step estimated from the ops against the step as measured."""
    from rich.table import Table

    table = Table(title="submitted models: estimated from the ops against the step as measured")
    for col in ("submission", "model", "mesh", "hardware", "saved/step estimated", "saved/step measured",
                "step vs as written", "step vs all-baseline", "runs"):
        table.add_column(col)

    def speed(s):
        return f"{s.median:.2f}x ({s.low:.2f}-{s.high:.2f})" if s else "-"

    for sub in models:
        step = sub.step
        table.add_row(
            str(sub.id), sub.name, ",".join(f"{k}={v}" for k, v in sub.mesh["axes"].items()), sub.hardware_key,
            f"{sub.saved_s_per_step * 1e3:.0f} ms" if sub.saved_s_per_step is not None else "-",
            f"{step.measured_saved_s_per_step * 1e3:.0f} ms" if step and step.measured_saved_s_per_step is not None
            else "-",
            speed(step.vs_reference) if step else "-", speed(step.vs_baseline) if step else "-",
            (step.variant or step.state) if step else "-")
    return table
