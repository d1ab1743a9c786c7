"""`Tuned`: how training code gets tuned configs and runs the ops with them.

Look-ups fall back in a stated order and say which they used: the server's answer
(exact or nearest), the bundle's (exact or nearest), the cost model's choice for the hardware,
the baseline.  Each (problem, hardware) is looked up once per process; a server that is down or
errs is reported by one warning and never breaks the training step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from collective_matmul.bundle import Bundle, nearest
from collective_matmul.decomposition import Decomposition
from collective_matmul.ops import BatchAxis, allgather_matmul, matmul_reduce_scatter, problem_of
from collective_matmul.problem import Hardware, Problem
from collective_matmul.wire import ConfigAnswer


@dataclass(frozen=True)
class Lookup:
    """The answer to one look-up: the config, and where it came from."""

    decomposition: Decomposition
    match: str  # exact | nearest | model | baseline
    source: str  # server | bundle | costmodel | baseline
    speedup: float | None = None


class Tuned:
    """Tuned collective matmuls for training code.

    Args:
        server: base URL of a cmtune service (optional).
        token: a reader token for the server.
        bundle: a bundle file (``cmtune tune --out`` or ``GET /v1/bundles``); needs no server.
        timeout_s: per request to the server.
    """

    def __init__(self, server: str | None = None, *, token: str | None = None, bundle: str | Path | None = None,
                 timeout_s: float = 2.0):
        self.server = server.rstrip("/") if server else None
        self.token = token
        self.bundle = Bundle.load(bundle) if bundle is not None else None
        self.timeout_s = timeout_s
        self._cache: dict[tuple[str, str], Lookup] = {}
        self._calls: dict[tuple, tuple[Problem, Lookup]] = {}
        self._warned: set[str] = set()
        self._client = None

    # -- look-ups ------------------------------------------------------------------------------

    def lookup(self, problem: Problem, hardware: Hardware) -> Lookup:
        """The config for ``problem`` on ``hardware`` (cached per process)."""
        key = (problem.key, hardware.key)
        found = self._cache.get(key)
        if found is None:
            found = self._resolve(problem, hardware.identity())
            self._cache[key] = found
        return found

    def _resolve(self, problem: Problem, hardware: Hardware) -> Lookup:
        answers = [self._from_server(problem, hardware), self._from_bundle(problem, hardware)]
        for match in ("exact", "nearest"):
            for answer in answers:
                if answer is not None and answer.match == match and problem.accepts(answer.decomposition):
                    return answer
        from collective_matmul.costmodel import model_choice

        choice = model_choice(problem, hardware)
        if choice is not None:
            return Lookup(choice, "model", "costmodel")
        return Lookup(Decomposition.baseline(), "baseline", "baseline")

    def _from_server(self, problem: Problem, hardware: Hardware) -> Lookup | None:
        if self.server is None:
            return None
        import httpx

        params = problem.model_dump() | {"platform": hardware.platform, "device_kind": hardware.device_kind,
                                         "device_count": hardware.device_count,
                                         "process_count": hardware.process_count}
        try:
            if self._client is None:
                headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
                self._client = httpx.Client(base_url=self.server, headers=headers, timeout=self.timeout_s)
            response = self._client.get("/v1/configs", params=params)
            response.raise_for_status()
            body = ConfigAnswer.model_validate_json(response.content)
            return Lookup(body.decomposition, body.match, "server", body.speedup)
        except Exception as exc:  # noqa: BLE001 - the training step must go on
            self._warn_once("server", f"cmtune server {self.server} unavailable ({type(exc).__name__}: {exc}); "
                                      "falling back to the bundle, the cost model or the baseline")
            return None

    def _from_bundle(self, problem: Problem, hardware: Hardware) -> Lookup | None:
        if self.bundle is None:
            return None
        exact = self.bundle.lookup(problem, hardware)
        if exact is not None:
            return Lookup(exact.decomposition, "exact", "bundle", exact.speedup)
        best = nearest(problem, (c for c in self.bundle.configs if c.hardware.key == hardware.key))
        return Lookup(best.decomposition, "nearest", "bundle") if best is not None else None

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    @property
    def resolved(self) -> list[tuple[Problem, Lookup]]:
        """Every (problem, answer) the ops of this process have used so far."""
        return list(self._calls.values())

    # -- ops -----------------------------------------------------------------------------------

    def allgather_matmul(self, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None) -> jax.Array:
        """`collective_matmul.allgather_matmul` with the tuned config for these shapes."""
        config = self.config_for("allgather_matmul", x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
        return allgather_matmul(x, w, mesh=mesh, axis=axis, config=config, batch_axis=batch_axis)

    def matmul_reduce_scatter(self, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None) -> jax.Array:
        """`collective_matmul.matmul_reduce_scatter` with the tuned config for these shapes."""
        config = self.config_for("matmul_reduce_scatter", x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
        return matmul_reduce_scatter(x, w, mesh=mesh, axis=axis, config=config, batch_axis=batch_axis)

    def config_for(self, collective: str, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None
                   ) -> Decomposition:
        """The config an op call would use (the problem is derived from the arrays and the mesh)."""
        call = (collective, tuple(x.shape), tuple(w.shape), str(x.dtype), id(mesh), axis, batch_axis)
        hit = self._calls.get(call)
        if hit is None:
            problem = problem_of(collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
            hit = (problem, self.lookup(problem, ring_hardware(mesh, axis)))
            self._calls[call] = hit
        return hit[1].decomposition


def ring_hardware(mesh: Mesh, axis: str) -> Hardware:
    """The hardware of one ring of ``mesh`` along ``axis`` (what configs are tuned for)."""
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0).reshape(mesh.shape[axis], -1)[:, 0]
    return Hardware.detect(devices.tolist())
