"""`--devices auto` joins the cluster JAX's own detection finds: two local processes with a SLURM environment, and
two with Open MPI's, each joining with nothing but its environment, tune one problem together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cmtune.workers.cluster import free_port
from collective_matmul.wire.bundle import Bundle

ROOT = Path(__file__).resolve().parents[2]


SLURM_PORTS = range(65535 - 2**12 + 1, 65536)  # JAX's SLURM coordinator port: job id mod 4096 above 61439


def free_slurm_port() -> int:
    """A free port where JAX's SLURM detection looks for its coordinator (it derives the port from the job id)."""
    import random
    import socket

    for port in random.sample(SLURM_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port above 61439")


def slurm(process_id: int, port: int) -> dict[str, str]:
    job = str(port - SLURM_PORTS.start)
    return {"SLURM_JOB_ID": job, "SLURM_NTASKS": "2", "SLURM_PROCID": str(process_id),
            "SLURM_LOCALID": str(process_id), "SLURM_STEP_NODELIST": "localhost"}


def open_mpi(process_id: int, port: int) -> dict[str, str]:
    return {"OMPI_MCA_orte_hnp_uri": f"1531576320.0;tcp://127.0.0.1:{port}", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_RANK": str(process_id), "OMPI_COMM_WORLD_LOCAL_RANK": str(process_id)}


def tune_pair(tmp_path: Path, options, environment=lambda pid: {}) -> None:
    """Run ``cmtune tune OPTIONS(pid) --repeats 2 --out tuned{pid}.json`` as processes 0 and 1 at once, each with
    ``environment(pid)`` over a clean one (no SLURM, Open MPI or cmtune variables); both must succeed."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "CMTUNE_"))}
    processes = [subprocess.Popen(
        [sys.executable, "-m", "cmtune", "tune", *options(pid), "--repeats", "2", "--out",
         str(tmp_path / f"tuned{pid}.json")],
        cwd=ROOT, env=base | {"JAX_PLATFORMS": "cpu"} | environment(pid), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("environment", [slurm, open_mpi], ids=["slurm", "open-mpi"])
def test_two_processes_join_by_detection_alone_and_tune_a_problem(environment, tmp_path):
    port = free_port() if environment is open_mpi else free_slurm_port()
    tune_pair(tmp_path, lambda pid: ["--problem", "ag:256x64x128:float32:8", "--trials", "3", "--devices", "auto"],
              lambda pid: environment(pid, port))
    (config,) = Bundle.load(tmp_path / "tuned0.json").configs  # process 0 writes, the other followed
    assert config.hardware.process_count == 2 and config.hardware.device_count == 8
    assert not (tmp_path / "tuned1.json").exists()


@pytest.mark.slow
def test_explicit_flags_join_a_cluster_on_every_jax_command(tmp_path):
    """--coordinator, --num-processes and --process-id on `cmtune tune` (every JAX command takes them)."""
    port = free_port()
    tune_pair(tmp_path, lambda pid: ["--problem", "rs:64x128x32:float32:8", "--trials", "2", "--coordinator",
                                     f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)])
    (config,) = Bundle.load(tmp_path / "tuned0.json").configs
    assert config.hardware.process_count == 2 and config.hardware.device_count == 8
