"""`Tuned`: how training code gets tuned configs and runs the ops with them.

Look-ups fall back in a stated order and say which they used: the server's answer
(exact or nearest), the bundle's (exact or nearest), the cost model's choice for the hardware,
the baseline.  Each (problem, hardware) is looked up once per process; a server that is down or
errs is reported by one warning and never breaks the training step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from collective_matmul.bundle import Bundle, RoleOverride, nearest
from collective_matmul.decomposition import DEFAULT_GRAD_WEIGHT, Decomposition, OpConfigs
from collective_matmul.ops import BatchAxis, allgather_matmul, matmul_reduce_scatter, problem_of
from collective_matmul.problem import Hardware, Problem
from collective_matmul.wire import ConfigAnswer

_DUAL = {"allgather_matmul": "matmul_reduce_scatter", "matmul_reduce_scatter": "allgather_matmul"}


@dataclass(frozen=True)
class Lookup:
    """The answer to one look-up: the config, and where it came from."""

    decomposition: Decomposition
    match: str  # exact | nearest | model | baseline | override
    source: str  # server | bundle | costmodel | baseline
    speedup: float | None = None


class Tuned:
    """Tuned collective matmuls for training code.

    Args:
        server: base URL of a cmtune service (optional).
        token: a reader token for the server.
        bundle: a bundle file (``cmtune tune --out`` or ``GET /v1/bundles``); needs no server.
        model: the name the model was submitted under: its per-role overrides (decided by the
            step measurement) then come first for the calls that name their role.
        timeout_s: per request to the server.
    """

    def __init__(self, server: str | None = None, *, token: str | None = None, bundle: str | Path | None = None,
                 model: str | None = None, timeout_s: float = 2.0):
        self.server = server.rstrip("/") if server else None
        self.token = token
        self.bundle = Bundle.load(bundle) if bundle is not None else None
        self.model = model
        self.timeout_s = timeout_s
        self._cache: dict[tuple[str, str], Lookup] = {}
        self._overrides: dict[str, dict[str, RoleOverride]] = {}
        self._calls: dict[tuple, tuple[Problem, Lookup]] = {}
        self._roles: dict[str, dict[str, tuple[Problem, Lookup]]] = {}
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
        params = problem.model_dump() | {"platform": hardware.platform, "device_kind": hardware.device_kind,
                                         "device_count": hardware.device_count,
                                         "process_count": hardware.process_count}
        try:
            response = self._http().get("/v1/configs", params=params)
            response.raise_for_status()
            body = ConfigAnswer.model_validate_json(response.content)
            return Lookup(body.decomposition, body.match, "server", body.speedup)
        except Exception as exc:  # noqa: BLE001 - the training step must go on
            self._warn_once("server", f"cmtune server {self.server} unavailable ({type(exc).__name__}: {exc}); "
                                      "falling back to the bundle, the cost model or the baseline")
            return None

    def _http(self):
        import httpx

        if self._client is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._client = httpx.Client(base_url=self.server, headers=headers, timeout=self.timeout_s)
        return self._client

    def _from_bundle(self, problem: Problem, hardware: Hardware) -> Lookup | None:
        if self.bundle is None:
            return None
        exact = self.bundle.lookup(problem, hardware)
        if exact is not None:
            return Lookup(exact.decomposition, "exact", "bundle", exact.speedup)
        best = nearest(problem, (c for c in self.bundle.configs if c.hardware.key == hardware.key))
        return Lookup(best.decomposition, "nearest", "bundle") if best is not None else None

    def override(self, role: str, hardware: Hardware) -> _Override | None:
        """This model's override of ``role`` on ``hardware`` (server first, then the bundle), or None.

        Overrides are decided by measuring the whole step of a submitted model (see docs/tuning.md);
        they need ``model=`` (the name it was submitted under).  Fetched once per hardware.
        """
        if self.model is None:
            return None
        key = hardware.identity().key
        if key not in self._overrides:
            found = {o.role: _override_of(o, "bundle") for o in (self.bundle.overrides if self.bundle else ())
                     if o.model == self.model and o.hardware.key == key}
            found |= {o.role: _override_of(o, "server") for o in self._overrides_from_server(hardware)}
            self._overrides[key] = found
        return self._overrides[key].get(role)

    def _overrides_from_server(self, hardware: Hardware) -> list[RoleOverride]:
        if self.server is None:
            return []
        try:
            client = self._http()
            response = client.get("/v1/overrides", params={
                "model": self.model, "platform": hardware.platform, "device_kind": hardware.device_kind,
                "device_count": hardware.device_count, "process_count": hardware.process_count})
            response.raise_for_status()
            return [RoleOverride.model_validate(o) for o in response.json()]
        except Exception as exc:  # noqa: BLE001 - the training step must go on
            self._warn_once("server", f"cmtune server {self.server} unavailable ({type(exc).__name__}: {exc}); "
                                      "falling back to the bundle, the cost model or the baseline")
            return []

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    @property
    def resolved(self) -> list[tuple[Problem, Lookup]]:
        """Every (problem, answer) the ops of this process have used so far (forward and backward)."""
        return list(self._calls.values())

    @property
    def resolved_by_role(self) -> dict[str, dict[str, tuple[Problem, Lookup]]]:
        """Per role given to `configs`: ``{"forward" | "grad_input" | "grad_weight": (problem, answer)}``."""
        return {role: dict(slots) for role, slots in self._roles.items()}

    # -- ops -----------------------------------------------------------------------------------

    def allgather_matmul(self, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
                         role: str | None = None) -> jax.Array:
        """`collective_matmul.allgather_matmul` with the tuned configs (forward and backward) for these shapes.

        ``role`` (e.g. ``"qkv"``) only labels the look-ups in `resolved_by_role`.
        """
        configs = self.configs(role, "allgather_matmul", x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
        return allgather_matmul(x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, config=configs.forward,
                                grad_input=configs.grad_input, grad_weight=configs.grad_weight)

    def matmul_reduce_scatter(self, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
                              role: str | None = None) -> jax.Array:
        """`collective_matmul.matmul_reduce_scatter` with the tuned configs (forward and backward) for these shapes.

        ``role`` (e.g. ``"mlp_down"``) only labels the look-ups in `resolved_by_role`.
        """
        configs = self.configs(role, "matmul_reduce_scatter", x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
        return matmul_reduce_scatter(x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, config=configs.forward,
                                     grad_input=configs.grad_input, grad_weight=configs.grad_weight)

    def config_for(self, collective: str, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None
                   ) -> Decomposition:
        """The forward config an op call would use (the problem is derived from the arrays and the mesh)."""
        return self.configs(None, collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis).forward

    def configs(self, role: str | None, collective: str, x, w, *, mesh: Mesh, axis: str,
                batch_axis: BatchAxis = None) -> OpConfigs:
        """The forward, ``grad_input`` and ``grad_weight`` configs of one op call (a `ConfigSource`).

        The three problems come from the forward's shapes (`problem_of`): the input gradient is
        the dual collective with k and n swapped; the weight gradient is
        ``allgather_grad_weight`` with k, n = K, N (all-gather matmul) or N, K (matmul
        reduce-scatter).  Each is looked up with `lookup`.  A weight gradient runs a ring only
        where one was tuned (exact or nearest); otherwise, and when the tuned one is the
        baseline, it runs ``Decomposition.baseline(fuse=True)``, what autodiff of the baseline
        does (no second gather), recorded as such.

        Args:
            role: the block's role (``qkv``, ``attn_out``, ``mlp_up``, ``mlp_down``) for
                `resolved_by_role`, or None.
            collective: ``allgather_matmul`` or ``matmul_reduce_scatter``.
            x, w: the forward's operands (arrays, tracers or `jax.ShapeDtypeStruct`).
            mesh, axis, batch_axis: as for the op.

        Raises:
            ValueError: if ``collective`` is not one of the two ops or the shapes do not fit.
        """
        if collective not in _DUAL:
            raise ValueError(f"configs: collective must be one of {sorted(_DUAL)}, got {collective!r}")
        call = (collective, tuple(x.shape), tuple(w.shape), str(x.dtype), id(mesh), axis, batch_axis)
        forward = problem_of(collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
        m, k, n = forward.m, forward.k, forward.n
        common = dict(m=m, dtype=forward.dtype, axis_size=forward.axis_size)
        problems = {
            "forward": forward,
            "grad_input": Problem(collective=_DUAL[collective], k=n, n=k, **common),
            "grad_weight": Problem(collective="allgather_grad_weight",
                                   **(dict(k=k, n=n) if collective == "allgather_matmul" else dict(k=n, n=k)),
                                   **common),
        }
        hardware = ring_hardware(mesh, axis)
        override = self.override(role, hardware) if role is not None else None
        chosen = {}
        for slot, problem in problems.items():
            if override is not None:  # the step measurement decided this role for this model
                hit = (problem, Lookup(getattr(override.configs, slot), "override", override.source))
                self._roles.setdefault(role, {})[slot] = hit
                chosen[slot] = hit[1].decomposition
                continue
            key = (slot, *call)
            hit = self._calls.get(key)
            if hit is None:
                found = self.lookup(problem, hardware)
                # a weight gradient runs a ring only where one was measured to win: the cost model does not
                # know `fuse`, and the fused baseline (no second gather) is what autodiff does
                if slot == "grad_weight" and (found.decomposition == Decomposition.baseline()
                                              or found.match in ("model", "baseline")):
                    found = replace(found, decomposition=DEFAULT_GRAD_WEIGHT)
                hit = self._calls[key] = (problem, found)
            if role is not None:
                self._roles.setdefault(role, {})[slot] = hit
            chosen[slot] = hit[1].decomposition
        return OpConfigs(**chosen)


@dataclass(frozen=True)
class _Override:
    configs: OpConfigs
    source: str
    reason: str


def _override_of(found: RoleOverride, source: str) -> _Override:
    return _Override(found.configs, source, found.reason)


def ring_hardware(mesh: Mesh, axis: str) -> Hardware:
    """The hardware of one ring of ``mesh`` along ``axis`` (what configs are tuned for)."""
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0).reshape(mesh.shape[axis], -1)[:, 0]
    return Hardware.detect(devices.tolist())
