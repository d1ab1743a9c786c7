"""What the command lines share: the console they print to, the service's URL and token options,
token handling, and the options more than one command parses; and what the tuner's two command
modules share (re-running a command as a group of processes, printing a step measurement).

Each command module imports from here, downward: `cmtune.tuning`, `cmtune.steps`,
`cmtune.worker`, `cmtune.serving` and the root `cmtune.cli`.  It imports no command module,
and nothing heavy at import (no JAX, nothing of the service): `cmtune --help` runs on every host.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from cmtune.workers.cluster import DeviceSpec, launch

# A terminal keeps its own width.  A pipe or a log file would get rich's 80 columns, and a table cut to
# fit loses the ends of its keys (`allgather_matmul:2048x1024x384:float…`): there the console is wider
# than any table of ours, and a table still takes only the width its cells need.
console = Console(width=None if sys.stdout.isatty() else 1000)

SERVER = typer.Option(envvar="CMTUNE_SERVER", help="service URL")
COORDINATOR = typer.Option(help="HOST:PORT of process 0: join that multi-host cluster (with --num-processes and "
                                "--process-id; without them --devices auto joins the cluster JAX detects)")
NUM_PROCESSES = typer.Option(help="processes in the cluster (with --coordinator)")
PROCESS_ID = typer.Option(help="this process's index in the cluster (with --coordinator)")


def join_options(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """The multi-host options every JAX command takes: with all three, this process joins that cluster when its
    devices are set up (`cmtune.workers.cluster.configure`, which reads them from the environment a local group's
    launcher also sets); explicit flags win over JAX's own detection."""
    import os

    from cmtune.workers.cluster import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PLATFORM, ENV_PROCESS_ID

    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given):
        return
    if not all(given):
        raise typer.BadParameter("--coordinator, --num-processes and --process-id go together (or none of them: "
                                 "--devices auto joins the cluster JAX detects)")
    if not 0 <= process_id < num_processes:
        raise typer.BadParameter(f"--process-id {process_id} is not one of the {num_processes} processes",
                                 param_hint="--process-id")
    os.environ |= {ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes),
                   ENV_PROCESS_ID: str(process_id),
                   ENV_PLATFORM: "cpu" if os.environ.get("JAX_PLATFORMS") == "cpu" else "device"}
TOKEN_FILE = typer.Option(help="read the token from this file (CMTUNE_TOKEN works too; both keep it out of ps)")


def read_token_file(path: Path | None) -> str | None:
    """The token in ``path`` (stripped), or None without a path."""
    if path is None:
        return None
    try:
        return path.read_text().strip() or None
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="--token-file") from None


def without_token(argv: list[str]) -> list[str]:
    """``argv`` without ``--token T`` (the children read CMTUNE_TOKEN): no token in any argv we build."""
    import os

    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word == "--token":
            os.environ["CMTUNE_TOKEN"] = argv[i + 1] if i + 1 < len(argv) else ""
            skip = True
        elif word.startswith("--token="):
            os.environ["CMTUNE_TOKEN"] = word.split("=", 1)[1]
        else:
            out.append(word)
    return out


def devices_option(text: str) -> DeviceSpec:
    """``--devices``, parsed (a bad one is a bad parameter, with the reason)."""
    try:
        spec = DeviceSpec.parse(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--devices") from None
    if spec.kind == "tpu":  # before anything starts JAX's backends
        from collective_matmul.programs.topology import quiet_libtpu

        quiet_libtpu(spec.topology)
    return spec


def set_up_devices(spec: DeviceSpec, *, local_devices: int = 0, auto_virtual: int = 0) -> bool:
    """`cmtune.workers.cluster.set_up` for a command: a group re-runs the command (`relaunch_as_group`, False: this
    process is done), a TPU topology libtpu does not take is a bad ``--devices``."""
    from cmtune.workers.cluster import set_up
    from collective_matmul.programs.topology import TopologyError

    try:
        return set_up(spec, relaunch=relaunch_as_group, local_devices=local_devices, auto_virtual=auto_virtual)
    except TopologyError as exc:
        raise typer.BadParameter(str(exc), param_hint="--devices") from None


def problems_from_options(problem: list[str] | None, model: str | None, mesh: str | None, tensor_axis: str | None):
    """The problems named by ``--problem`` (repeatable) or ``--model`` with ``--mesh``."""
    from collective_matmul import Problem
    from collective_matmul.planning.models import MeshSpec, TransformerBlock, model_problems

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


def relaunch_as_group(count: int, local_devices: int, platform: str = "cpu") -> None:
    """Re-run this very command as ``count`` processes of a gloo cluster; process 0's output shows as it comes.

    Every process runs what it is handed by process 0; if one fails or hangs (its watchdog ends
    it), the others are killed and this command exits non-zero with the failure's output.
    """
    try:
        results = launch(count, without_token(sys.orig_argv[1:]), local_devices=local_devices, timeout_s=24 * 3600,
                         platform=platform,
                         echo_first=True)
    except RuntimeError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    sys.stderr.write(results[0].stderr)


def show_step(result, *, title: str, started: float, json_out: Path | None) -> None:
    """Print a step measurement (and its fresh rounds), write it as JSON; exit 1 if a variant failed."""
    import time

    from cmtune.report import step_table

    console.print(step_table(result, title=title))
    if result.confirmation:
        again = result.model_copy(update={"variants": result.confirmation, "confirmation": []})
        console.print(step_table(again, title="the decision timed again in fresh rounds (what the speedups report)"))
    console.print(f"verify took {time.monotonic() - started:.1f}s")
    if json_out is not None:
        json_out.write_text(result.model_dump_json(indent=2) + "\n")
        console.print(f"wrote the step measurement to {json_out}")
    failed = [v for v in result.variants if not v.ok]
    for v in failed:
        console.print(f"[red]{v.name}: {v.status}: {v.message}[/red]")
    if failed:
        raise typer.Exit(1)
