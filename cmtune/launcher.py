"""Start a real `cmtune serve` process (for the demo, tests and benchmarks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from cmtune.workers.cluster import free_port


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    env: dict[str, str]


@contextmanager
def running_server(*, database_url: str, auth: str = "token", port: int | None = None,
                   extra_env: dict[str, str] | None = None, timeout_s: float = 60,
                   workers: int = 1) -> Iterator[Server]:
    """A `cmtune serve` subprocess on 127.0.0.1, ready when this yields; stopped after.

    Raises:
        RuntimeError: if the server exits or does not answer /healthz within ``timeout_s``.
    """
    port = port or free_port()
    env = os.environ | {"CMTUNE_DATABASE_URL": database_url, "CMTUNE_AUTH": auth} | (extra_env or {})
    process = subprocess.Popen(
        [sys.executable, "-m", "cmtune", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(workers)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, timeout_s)
        yield Server(url=url, process=process, env=env)
    finally:
        stop(process)


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            raise RuntimeError(f"cmtune serve exited with {process.returncode}:\n{output[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"cmtune serve did not answer {url}/healthz within {timeout_s:.0f}s")


def stop(process: subprocess.Popen, timeout_s: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
