"""Devices and multi-process JAX clusters: join one (multi-host) or launch one on loopback.

A TPU pod slice is several hosts running one SPMD program.  Here the same path runs as N local
processes that join `jax.distributed` over gloo on 127.0.0.1, each with its own CPU devices.
In such a group, process 0 takes every decision and hands it to the others with `Group`, so no
decision can depend on one process's timings.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)  # a message: one of collective_matmul.wire's group types
ENV_COORDINATOR = "CMTUNE_COORDINATOR"
ENV_NUM_PROCESSES = "CMTUNE_NUM_PROCESSES"
ENV_PROCESS_ID = "CMTUNE_PROCESS_ID"
ENV_LOCAL_DEVICES = "CMTUNE_LOCAL_DEVICES"
ENV_PLATFORM = "CMTUNE_PLATFORM"
PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}  # what processes:PxD@PLATFORM takes -> JAX_PLATFORMS


@dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits in a `jax.distributed` cluster."""

    coordinator: str
    num_processes: int
    process_id: int
    local_devices: int | None = None
    platform: str = "cpu"

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
            platform=os.environ.get(ENV_PLATFORM, "cpu"),
        )


def join(spec: ClusterSpec) -> None:
    """Join the cluster; call before anything touches a JAX device.

    On CPU, collectives across processes use gloo and each process gets ``local_devices``
    virtual devices; on GPU each process has the GPUs `launch` made visible to it (NCCL between them).
    """
    import jax

    if spec.platform != "cpu":
        jax.distributed.initialize(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                                   process_id=spec.process_id)
        return
    if spec.local_devices:
        jax.config.update("jax_num_cpu_devices", spec.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
    )


DEVICES_HELP = ("virtual:N (N virtual CPU devices in this process), processes:N (N local gloo processes), "
                "processes:PxD[@PLATFORM] (P processes of D devices each: CPU devices over gloo by default, @gpu: D "
                "GPUs each), tpu:TOPOLOGY (a TPU slice such as v5p:2x2x1, compiled for ahead of time: needs "
                "libtpu, nothing runs) or gpu:CARD:D / gpu:CARD:HxD (H hosts of D NVIDIA GPUs such as gpu:h100:8, "
                "compiled for ahead of time: needs cmtune[gpu], nothing runs)")
COMPILE_ONLY_KINDS = ("tpu", "gpu")  # the kinds of devices compiled for ahead of time, never run
_TOPOLOGY = re.compile(r"[a-z][a-z0-9]*:\d+(x\d+)*")
_GPU_NODE = re.compile(r"(?P<card>[a-z0-9][a-z0-9_.-]*):(?:(?P<hosts>\d+)x)?(?P<per_host>\d+)")


@dataclass(frozen=True)
class DeviceSpec:
    """``auto``, ``virtual:N``, ``processes:N``, ``processes:PxD``, ``tpu:TOPOLOGY`` or ``gpu:CARD:HxD`` as given on
    the command line.

    ``local`` is D of ``processes:PxD`` and ``gpu:CARD:HxD`` (devices per process or host), 0 where the command
    decides; ``count`` is P or H.  ``topology`` is a TPU slice's name as libtpu takes it (``v5p:2x2x1``) or a GPU
    card's (``h100``): their devices are compiled for, never run.
    """

    kind: str
    count: int = 0
    local: int = 0
    topology: str = ""
    platform: str = "cpu"  # of processes:PxD@PLATFORM: what each process's devices are

    @classmethod
    def parse(cls, text: str) -> DeviceSpec:
        if "@" in text and text.startswith("processes:"):
            text, _, platform = text.partition("@")
            if platform not in PLATFORMS:
                raise ValueError(f"{text}@{platform}: a process group runs on {' or '.join(sorted(PLATFORMS))} "
                                 f"devices (processes:PxD@gpu), not {platform!r}")
            spec = cls.parse(text)
            if platform != "cpu" and not spec.local:
                raise ValueError(f"{text}@{platform}: give the devices of each process, processes:PxD@{platform}")
            return dataclasses.replace(spec, platform="gpu" if platform == "cuda" else platform)
        if text.startswith("tpu:"):
            topology = text.removeprefix("tpu:")
            if not _TOPOLOGY.fullmatch(topology):
                raise ValueError(f"{text!r}: expected tpu:TOPOLOGY, a TPU slice as libtpu names it (tpu:v5p:2x2x1, "
                                 "tpu:v5e:2x2, tpu:v4:4x4x4)")
            return cls("tpu", topology=topology)
        if text.startswith("gpu:"):
            node = _GPU_NODE.fullmatch(text.removeprefix("gpu:"))
            if node is None or int(node["per_host"]) < 1 or (node["hosts"] is not None and int(node["hosts"]) < 1):
                raise ValueError(f"{text!r}: expected gpu:CARD:D or gpu:CARD:HxD, D GPUs on each of H hosts "
                                 "(gpu:h100:8, gpu:b200:2x8)")
            return cls("gpu", count=int(node["hosts"] or 1), local=int(node["per_host"]), topology=node["card"],
                       platform="gpu")
        kind, _, count = text.partition(":")
        local = ""
        if kind == "processes" and "x" in count:
            count, _, local = count.partition("x")
            if not local.isdigit() or int(local) < 1:
                raise ValueError(f"{text!r}: expected {DEVICES_HELP}, or auto")
        if kind not in ("virtual", "processes", "auto") or (kind != "auto" and not count.isdigit()) \
                or (kind != "auto" and int(count) < 1) or (kind == "auto" and count):
            raise ValueError(f"{text!r}: expected {DEVICES_HELP}, or auto")
        return cls(kind, int(count) if count else 0, int(local) if local else 0)

    @property
    def compile_only(self) -> bool:
        """True for a TPU slice or a GPU node: programs are compiled for its devices and checked, never timed."""
        return self.kind in COMPILE_ONLY_KINDS

    @property
    def label(self) -> str:
        """What the devices are called in output: the spec for compile-only ones (``gpu:h100:1x8``)."""
        if self.kind == "gpu":
            return f"gpu:{self.topology}:{self.count}x{self.local}"
        return f"tpu:{self.topology}" if self.kind == "tpu" else self.kind

    def compiled_devices(self) -> list:
        """The devices of ``tpu:TOPOLOGY`` or ``gpu:CARD:HxD``, compiled for ahead of time here
        (`collective_matmul.programs.topology.tpu_devices`, `collective_matmul.programs.gpus.gpu_devices`).

        Raises:
            ValueError: the spec is not compile-only; `TopologyError` or `GpuError` (both ValueErrors) when the
                compiler or the card's config is not there (the message says how to get it).
        """
        if self.kind == "gpu":
            from collective_matmul.programs.gpus import gpu_devices

            return gpu_devices(self.topology, self.count, self.local)
        if self.kind != "tpu":
            raise ValueError(f"{self.label}: not a compile-only device spec")
        from collective_matmul.programs.topology import tpu_devices

        return tpu_devices(self.topology)

    @property
    def needs_group(self) -> bool:
        """True when this process must re-run itself as a group (and is not in one already)."""
        return self.kind == "processes" and ClusterSpec.from_env() is None

    @property
    def total(self) -> int | None:
        """The devices this spec sets up in all, where it says (virtual:N, processes:PxD)."""
        if self.kind == "virtual":
            return self.count
        if self.kind in ("processes", "gpu") and self.local:
            return self.count * self.local
        return None


def is_compile_only(devices: str, compile_only: bool = False) -> bool:
    """Whether a command on ``--devices devices`` (with ``--compile-only`` as ``compile_only``) compiles its programs
    and checks them, timing nothing: asked to, or on a TPU topology (``tpu:TOPOLOGY``) or a GPU node
    (``gpu:CARD:HxD``), whose devices are compiled for and never run (`DeviceSpec.compile_only`)."""
    return compile_only or devices.partition(":")[0] in COMPILE_ONLY_KINDS


def set_up(spec: DeviceSpec, *, relaunch: Callable[[int, int, str], None], local_devices: int = 0,
           auto_virtual: int = 0) -> bool:
    """Set this process's devices up for ``spec`` (`configure`), or, where it must run as a group of processes and
    is not in one yet, have ``relaunch(processes, local_devices, platform)`` re-run the command as that group.

    Returns:
        False if the group ran the command instead (this process has nothing left to do).

    Raises:
        collective_matmul.programs.topology.TopologyError: a TPU topology libtpu does not take.
    """
    if spec.needs_group:
        relaunch(spec.count, local_devices, spec.platform)
        return False
    configure(spec, auto_virtual=auto_virtual)
    return True


def detected_cluster() -> tuple[str, int] | None:
    """The cluster environment JAX's own detection finds here (Cloud TPU, SLURM, Open MPI, Kubernetes, ...) and its
    process count, where it spans more than one process; None outside one."""
    try:
        from jax._src.clusters import ClusterEnv  # JAX's detection, as jax.distributed.initialize() runs it
    except ImportError:  # a JAX that moved it: only explicit flags join
        return None
    for env in ClusterEnv._cluster_types:
        try:
            if env.opt_in_only_method or not env.is_env_present():
                continue
            count = env.get_process_count()
        except Exception:  # noqa: BLE001 - an environment that half describes a cluster is not one
            continue
        return (env.name, count) if count > 1 else None
    return None


def join_detected(*, cpu_devices: int = 0) -> None:
    """Join the cluster JAX detects (`detected_cluster`) with a bare ``jax.distributed.initialize()``: its coordinator,
    process count and id come from the environment.  On CPU (``JAX_PLATFORMS=cpu``) the processes talk over gloo,
    each with ``cpu_devices`` devices (0: JAX's default)."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        if cpu_devices:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize()


def configure(spec: DeviceSpec, *, auto_virtual: int = 0) -> None:
    """Set JAX up for ``spec`` before any device is touched; a group member joins its group, and ``auto`` in a
    cluster JAX detects (SLURM, Open MPI, Cloud TPU, Kubernetes) joins it.

    ``auto_virtual``: how many virtual CPU devices ``auto`` means in all (0: whatever JAX finds); in a detected
    cluster of CPU processes each gets its share.
    """
    cluster = ClusterSpec.from_env()
    if cluster is not None:
        if cluster.local_devices is None and auto_virtual:  # --coordinator on CPU: each its share of the ring
            cluster = dataclasses.replace(cluster, local_devices=max(auto_virtual // cluster.num_processes, 1))
        join(cluster)
        return
    if spec.kind == "auto" and (detected := detected_cluster()) is not None:
        join_detected(cpu_devices=auto_virtual // detected[1] if auto_virtual else 0)
        return
    import jax

    cpu_only = spec.kind == "virtual" or spec.compile_only or (spec.kind == "auto" and not accelerator_present())
    if cpu_only and not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")  # a TPU or GPU plugin installed for compiles must not start up
    if spec.compile_only:
        spec.compiled_devices()  # the compiler is there and takes the name, or the command says what to do
        return
    count = spec.count if spec.kind == "virtual" else auto_virtual if spec.kind == "auto" else 0
    if count > 0:
        jax.config.update("jax_num_cpu_devices", count)


def accelerator_present() -> bool:
    """Whether this machine shows an accelerator's device files (NVIDIA GPUs, TPU chips): where it shows none, a
    CUDA plugin or libtpu installed for compiles ahead of time is not started (it would only fail, loudly)."""
    dev = Path("/dev")
    return any(any(dev.glob(pattern)) for pattern in ("nvidia[0-9]*", "accel[0-9]*", "vfio/[0-9]*"))


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


# A process that a watchdog ended because its trial overran (see `cmtune.workers.runner.Watchdog`).
EXIT_HUNG = 75


def launch(
    num_processes: int,
    argv: list[str],
    *,
    local_devices: int = 1,
    timeout_s: float = 600,
    cwd: str | Path | None = None,
    stream: bool = False,
    echo_first: bool = False,
    platform: str = "cpu",
) -> list[ProcessResult]:
    """Run ``python argv...`` as a cluster of ``num_processes`` local processes on loopback, each with
    ``local_devices`` devices of ``platform`` (`child_env`).

    The group lives and dies together: as soon as one process exits with an error (a crash, or a
    watchdog ending a hung trial), every other one is killed with SIGKILL, since a process
    blocked inside a collective ignores SIGTERM.  SIGTERM and SIGINT received here are passed on.

    Args:
        stream: every process's output goes straight to this process's (daemons).
        echo_first: process 0's stdout is echoed as it comes (progress bars); all output is
            also kept in the results.

    Raises:
        RuntimeError: without ``stream``, if any process fails or the group exceeds ``timeout_s``.
    """
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for pid in range(num_processes):
        env = child_env(os.environ, coordinator=coordinator, num_processes=num_processes, process_id=pid,
                        local_devices=local_devices, platform=platform)
        pipe = None if stream else subprocess.PIPE
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, text=True, stdout=pipe, stderr=pipe))
    outputs = [[[], []] for _ in procs]
    readers = [] if stream else [
        threading.Thread(target=_drain, args=(stream_, outputs[pid][i], echo_first and pid == 0 and i == 0),
                         daemon=True)
        for pid, proc in enumerate(procs) for i, stream_ in enumerate((proc.stdout, proc.stderr))]
    for reader in readers:
        reader.start()

    def forward(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        while any(proc.poll() is None for proc in procs):
            if any(proc.poll() not in (None, 0) for proc in procs):
                break  # one failed: the others would wait for it forever in their next collective
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=5)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    results = [ProcessResult(pid, proc.returncode, "".join(outputs[pid][0]), "".join(outputs[pid][1]))
               for pid, proc in enumerate(procs)]
    if stream:
        return results
    if timed_out:
        raise RuntimeError(f"process group timed out after {timeout_s:.0f}s: {argv}")
    failed = sorted((r for r in results if r.returncode != 0), key=lambda r: r.returncode == -signal.SIGKILL)
    if failed:
        tail = (failed[0].stderr or failed[0].stdout)[-3000:]
        raise RuntimeError(f"process {failed[0].process_id} exited {failed[0].returncode}:\n{tail}")
    return results


def child_env(parent, *, coordinator: str, num_processes: int, process_id: int, local_devices: int,
              platform: str = "cpu") -> dict[str, str]:
    """The environment of process ``process_id`` of a local group: where the group meets, its platform
    (``JAX_PLATFORMS``), on GPU the process's own ``local_devices`` GPUs (``CUDA_VISIBLE_DEVICES``), and the
    parent's ``XLA_FLAGS`` (the flags a measurement is taken with) without a CPU device count, which the group
    sets itself."""
    env = dict(parent) | {ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes),
                          ENV_PROCESS_ID: str(process_id), ENV_LOCAL_DEVICES: str(local_devices),
                          ENV_PLATFORM: platform, "JAX_PLATFORMS": PLATFORMS[platform]}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    if not flags:
        env.pop("XLA_FLAGS")
    if platform != "cpu":
        first = process_id * local_devices
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(local_devices))
    return env


def _drain(pipe, into: list[str], echo: bool) -> None:
    for line in pipe:
        into.append(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


class Group:
    """Messages from process 0 to the others of a `jax.distributed` group (no-op alone).

    Every process must call `send` (process 0) or `receive` (the others) together: a broadcast
    is a collective.  A message goes in two broadcasts, its length and then its bytes (in a
    buffer rounded up to a power of two, so few buffer shapes are ever compiled); one over
    `MAX_BYTES` raises `ValueError` on every process, none left waiting.
    """

    MAX_BYTES = 1 << 26
    MIN_BUFFER = 1 << 12

    def __init__(self):
        import jax

        self.size = jax.process_count()
        self.index = jax.process_index()
        self.leader = self.index == 0

    def send(self, message: BaseModel) -> None:
        """Process 0: ``message`` (a `collective_matmul.wire` type) to the others."""
        if self.size > 1:
            self._broadcast(message.model_dump_json().encode())

    def receive(self, kind: type[M]) -> M:
        """The others: process 0's next message, a ``kind``."""
        return kind.model_validate_json(self._broadcast(b""))

    def share(self, message: M | None, kind: type[M]) -> M:
        """Process 0's ``message`` on every process (the others pass None)."""
        if self.leader:
            self.send(message)
            return message
        return self.receive(kind)

    def _broadcast(self, payload: bytes) -> bytes:
        import numpy as np
        from jax.experimental import multihost_utils

        length = np.array([len(payload) if len(payload) <= self.MAX_BYTES else -1], np.int32)
        length = int(np.asarray(multihost_utils.broadcast_one_to_all(length))[0])
        if length < 0:
            raise ValueError(f"a message from process 0 is over {self.MAX_BYTES} bytes")
        size = max(self.MIN_BUFFER, 1 << max(length - 1, 0).bit_length())
        buffer = np.zeros(size, np.uint8)
        buffer[:len(payload)] = np.frombuffer(payload, np.uint8)
        out = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
        return out[:length].tobytes()
