"""`cmtune worker`: the worker daemon's command (needs JAX and the service's URL, not the service)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from cmtune.common import (
    COORDINATOR,
    NUM_PROCESSES,
    PROCESS_ID,
    SERVER,
    TOKEN_FILE,
    devices_option,
    join_options,
    read_token_file,
    without_token,
)
from cmtune.workers.cluster import DEVICES_HELP, accelerator_present

app = typer.Typer(no_args_is_help=True)


@app.command()
def worker(
    server: Annotated[str, SERVER] = "http://127.0.0.1:8470",
    token: Annotated[str | None, typer.Option(
        envvar="CMTUNE_TOKEN", help="a worker token (CMTUNE_TOKEN or --token-file keep it out of ps)")] = None,
    token_file: Annotated[Path | None, TOKEN_FILE] = None,
    devices: Annotated[str, typer.Option(help=DEVICES_HELP + "; auto = the devices JAX finds")] = "auto",
    name: Annotated[str | None, typer.Option(help="default: the host name")] = None,
    coordinator: Annotated[str | None, COORDINATOR] = None,
    num_processes: Annotated[int | None, NUM_PROCESSES] = None,
    process_id: Annotated[int | None, PROCESS_ID] = None,
    poll_seconds: Annotated[float, typer.Option(min=0.05, help="wait between empty lease requests")] = 2.0,
    heartbeat_seconds: Annotated[float, typer.Option(min=0.05)] = 10.0,
    max_trials: Annotated[int | None, typer.Option(min=1, help="leave after this many trials")] = None,
    local_devices: Annotated[int, typer.Option(
        min=1, help="virtual CPU devices per process (processes:N; processes:PxD says D)")] = 4,
    exit_when_idle: Annotated[bool, typer.Option(help="leave when no trial is offered for 5 s")] = False,
    restart: Annotated[bool, typer.Option(
        help="start the worker again whenever it exits with an error (where no docker or systemd does)")] = False,
    trial_grace_seconds: Annotated[float, typer.Option(
        min=1, help="a trial may take 2 x its candidates' timeout_s plus this before it counts as hung")] = 120.0,
) -> None:
    """Run a worker daemon: lease the trials this host can run, time them, report.

    A trial matches this host's hardware, or a ring whose size divides its devices (all such rings timed at once).
    """
    import logging

    from cmtune.workers.cluster import configure, launch
    from cmtune.workers.daemon import WorkerDaemon, supervise

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = token or read_token_file(token_file)
    if token:
        os.environ["CMTUNE_TOKEN"] = token  # children read it from there, never from an argv we build
    join_options(coordinator, num_processes, process_id)
    spec = devices_option(devices)
    # before JAX starts: the flags a ring needs to overlap on a GPU (not for CPU devices on a host whose CUDA
    # plugin is there for compiles without a GPU)
    if spec.platform == "gpu" or (spec.kind == "auto" and _gpu_host()):
        from collective_matmul.planning.xla_options import with_overlap_flags

        os.environ["XLA_FLAGS"] = with_overlap_flags(os.environ.get("XLA_FLAGS", ""), "gpu")
    if restart and "CMTUNE_SUPERVISED" not in os.environ:
        raise typer.Exit(supervise(without_token([w for w in sys.orig_argv[1:] if w != "--restart"])))
    if spec.needs_group:
        results = launch(spec.count, without_token(sys.orig_argv[1:]), local_devices=spec.local or local_devices,
                         timeout_s=7 * 24 * 3600, stream=True, platform=spec.platform)
        raise typer.Exit(max(r.returncode for r in results))
    configure(spec)  # a cluster of --coordinator (join_options), a local group's, one JAX detects, or none
    daemon = WorkerDaemon(server, token, name=name, poll_s=poll_seconds, heartbeat_s=heartbeat_seconds,
                          max_trials=max_trials, exit_when_idle=exit_when_idle, grace_s=trial_grace_seconds)
    daemon.install_signal_handlers()
    daemon.run()


def _gpu_host() -> bool:
    """Whether --devices auto gives the worker GPUs: JAX's CUDA plugin installed on a machine that shows GPUs (the
    rule `cmtune.workers.cluster.configure` starts JAX by), or JAX_PLATFORMS naming CUDA."""
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms == "cpu":
        return False
    return platforms in ("cuda", "gpu") or accelerator_present() and any(
        importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
