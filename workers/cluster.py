"""Multi-process JAX clusters: join one (multi-host) or launch one on loopback (development).

A TPU pod slice is several hosts running one SPMD program.  Here the same path runs as N local
processes that join `jax.distributed` over gloo on 127.0.0.1, each with its own CPU devices.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENV_COORDINATOR = "CMTUNE_COORDINATOR"
ENV_NUM_PROCESSES = "CMTUNE_NUM_PROCESSES"
ENV_PROCESS_ID = "CMTUNE_PROCESS_ID"
ENV_LOCAL_DEVICES = "CMTUNE_LOCAL_DEVICES"


@dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits in a `jax.distributed` cluster."""

    coordinator: str
    num_processes: int
    process_id: int
    local_devices: int | None = None

    @classmethod
    def from_env(cls) -> ClusterSpec | None:
        """The spec set by `launch` in a child's environment, or None outside a cluster."""
        if ENV_COORDINATOR not in os.environ:
            return None
        local = os.environ.get(ENV_LOCAL_DEVICES)
        return cls(
            coordinator=os.environ[ENV_COORDINATOR],
            num_processes=int(os.environ[ENV_NUM_PROCESSES]),
            process_id=int(os.environ[ENV_PROCESS_ID]),
            local_devices=int(local) if local else None,
        )


def join(spec: ClusterSpec) -> None:
    """Join the cluster; call before anything touches a JAX device.

    On CPU, collectives across processes use gloo and each process gets ``local_devices``
    virtual devices.
    """
    import jax

    if spec.local_devices:
        jax.config.update("jax_num_cpu_devices", spec.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ProcessResult:
    process_id: int
    returncode: int
    stdout: str
    stderr: str


def launch(
    num_processes: int,
    argv: list[str],
    *,
    local_devices: int = 1,
    timeout_s: float = 600,
    cwd: str | Path | None = None,
    stream: bool = False,
) -> list[ProcessResult]:
    """Run ``python argv...`` as a cluster of ``num_processes`` local processes on loopback.

    Each child finds its place with `ClusterSpec.from_env` and calls `join`.  With ``stream``
    the children's output goes straight to this process's (for daemons); SIGTERM and SIGINT
    received here are passed on to every child.

    Raises:
        RuntimeError: if any process fails or the group exceeds ``timeout_s`` (all are killed).
    """
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for pid in range(num_processes):
        env = os.environ | {
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(pid),
            ENV_LOCAL_DEVICES: str(local_devices),
            "JAX_PLATFORMS": "cpu",
        }
        env.pop("XLA_FLAGS", None)
        pipe = None if stream else subprocess.PIPE
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, text=True, stdout=pipe, stderr=pipe))
    if stream:
        def forward(signum, _frame):
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
    results = []
    deadline = time.monotonic() + timeout_s
    try:
        for pid, proc in enumerate(procs):
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(ProcessResult(pid, proc.returncode, out or "", err or ""))
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"process group timed out after {timeout_s:.0f}s: {argv}") from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [r for r in results if r.returncode != 0]
    if failed and not stream:
        tail = failed[0].stderr[-3000:]
        raise RuntimeError(f"process {failed[0].process_id} exited {failed[0].returncode}:\n{tail}")
    return results
