"""Where `Tuned` gets configs: a cmtune service over HTTP, a bundle file, and the look-up order over them.

A source answers one problem on one hardware for one software stack with a `Lookup` (or None), and
lists a model's per-role overrides.  `ServiceSource` asks a server through `collective_matmul.client.rest`:
a server that is down or errs is reported by one warning (`WarnOnce`) and answers nothing, so the
training step goes on.  `BundleSource` answers from a bundle file, indexed once per hardware.
`Sources` asks both in the look-up order of `collective_matmul.wire.lookup` (measured answers first, the
server's before the bundle's at the same match; then the baseline, or the cost model where the
client asked for it) and keeps each answer for the process.  `ConfigSource` is what the block and the
drop-ins call on any source of configs.  Nothing here imports JAX.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire.bundle import Bundle, RoleOverride, TunedConfig
from collective_matmul.wire.lookup import (
    MATCHES,
    MEASURED,
    Unmeasured,
    by_problem,
    checked_unmeasured,
    from_tuned,
    stack_note,
    untuned,
    weight_gradient,
)

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from collective_matmul.client.rest import ApiClient
    from collective_matmul.ops.collective import BatchAxis
    from collective_matmul.planning.decomposition import OpConfigs

MAX_LOOKUPS = 1 << 16  # answers kept per client (a bounded in-process cache)


@runtime_checkable
class ConfigSource(Protocol):
    """What the block and the Flax drop-in (`collective_matmul.client.flax`) call on a source of configs, at trace time.

    Implemented by `FixedConfigs`, `AS_WRITTEN` and `collective_matmul.Tuned` (and its step variants).
    """

    def configs(self, role: str | None, collective: str, x, w, *, mesh: Mesh, axis: str,
                batch_axis: BatchAxis = None, tensor_axis: str | None = None, site: str = "",
                via: str = "op") -> OpConfigs:
        """The forward, ``grad_input`` and ``grad_weight`` configs of one op call.

        Args:
            role: the call's role: one of `ROLES` in the block; a Flax module path, named scope or
                source location in the drop-in; None where the call has none.
            collective: ``allgather_matmul``, ``matmul_reduce_scatter`` or a weight-gathered (FSDP) one
                (``weight_allgather_matmul_k`` / ``_n``).
            x, w: the forward's operands (arrays, tracers or `jax.ShapeDtypeStruct`: the shapes matter).
            mesh, axis, batch_axis: as for the op; ``tensor_axis``: the weight's other sharded axis (FSDP x TP).
            site: ``file:line`` of the call (the drop-in gives it), for a report of the calls.
            via: how the call came: ``op`` (the block, `Tuned`'s ops) or ``dot_general`` (the drop-in).

        Raises:
            ValueError: if the call does not fit ``collective`` (a source may check it).
        """
        ...

    def fell_back(self, role: str, reason: str, *, site: str = "") -> None:
        """A call the drop-in ran as plain ``lax.dot_general``: ``reason`` says why, ``site`` is its ``file:line``."""
        ...


@dataclass(frozen=True)
class Lookup:
    """The answer to one look-up: the config, and where it came from (``origin``)."""

    decomposition: Decomposition
    match: str  # override | exact | stale | nearest | model | baseline | fixed
    origin: str  # server | bundle | costmodel | baseline | variant | process 0
    speedup: float | None = None
    software: Software | None = None  # the stack that measured the config it came from
    note: str = ""  # which stack measured it (a stale one), or why nothing measured answered (model, baseline)

    @property
    def source(self) -> str:
        """The old name of `origin`: it resolves for one more release, with a `DeprecationWarning`."""
        warnings.warn("Lookup.source is Lookup.origin (where the answer came from): the old name goes in the next "
                      "release", DeprecationWarning, stacklevel=2)
        return self.origin


class WarnOnce:
    """A `RuntimeWarning` once per subject (``"server"``, an override's role, ...) for the life of a client."""

    def __init__(self):
        self._warned: set[str] = set()

    def __call__(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


class ServiceSource:
    """A cmtune service's answers (``GET /v1/configs``, ``/v1/overrides``); a lost server is warned about once.

    Args:
        server: the service's base URL.
        token: a reader token.
        timeout_s: per request (never retried: a training step does not wait for a server).
        warn: the client's warnings.
    """

    name = "server"

    def __init__(self, server: str, *, token: str | None = None, timeout_s: float = 2.0, warn: WarnOnce):
        self.server, self.token, self.timeout_s, self.warn = server.rstrip("/"), token, timeout_s, warn
        self._api: ApiClient | None = None  # one connection pool for the client's life

    @property
    def api(self) -> ApiClient:
        if self._api is None:
            from collective_matmul.client.rest import ApiClient

            self._api = ApiClient(self.server, self.token, timeout=self.timeout_s)
        return self._api

    def answer(self, problem: Problem, hardware: Hardware, software: Software | None = None) -> Lookup | None:
        """The server's answer for ``problem`` (None where the server cannot be asked)."""
        try:
            body = self.api.config(problem, hardware, software)
        except Exception as exc:  # noqa: BLE001 - the training step must go on
            self._lost(exc)
            return None
        return Lookup(body.decomposition, body.match, self.name, body.speedup, body.software, body.note or "")

    def overrides(self, model: str, hardware: Hardware) -> list[RoleOverride]:
        """The server's overrides of ``model`` on ``hardware``; one that does not check out is skipped and warned of."""
        try:
            return self.api.overrides(model, hardware, on_invalid=self._bad_override)
        except Exception as exc:  # noqa: BLE001 - the training step must go on
            self._lost(exc)
            return []

    def _lost(self, exc: Exception) -> None:
        from collective_matmul.client.rest import ApiError

        why = str(exc) if isinstance(exc, ApiError) else f"{type(exc).__name__}: {exc}"
        self.warn("server", f"cmtune server {self.server} unavailable ({why}); falling back to the bundle, then "
                            "the baseline (or the cost model, where asked for)")

    def _bad_override(self, item, exc: ValueError) -> None:
        self.warn(f"override:{item.get('role') if isinstance(item, dict) else item!r}",
                  f"cmtune server {self.server} served an override that does not check out, skipped: {exc}")


class BundleSource:
    """A bundle file's answers (its stacks compared with the look-up's), indexed once per hardware."""

    name = "bundle"

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        # hardware key -> problem key -> its configs, one per stack (`collective_matmul.wire.lookup.by_problem`)
        self._index: dict[str, dict[str, list[TunedConfig]]] = {}

    def answer(self, problem: Problem, hardware: Hardware, software: Software | None = None) -> Lookup | None:
        """The bundle's ``exact``, ``stale`` or ``nearest`` answer for ``problem``, or None."""
        configs = self._index.get(hardware.key)
        if configs is None:
            configs = self._index[hardware.key] = by_problem(c for c in self.bundle.configs
                                                             if c.hardware.key == hardware.key)
        found = from_tuned(problem, configs, software)
        if found is None:
            return None
        match, config = found
        return Lookup(config.decomposition, match, self.name,
                      config.speedup if match in ("exact", "stale") else None, config.software,
                      stack_note(match, config, software) or "")

    def overrides(self, model: str, hardware: Hardware) -> list[RoleOverride]:
        """The bundle's overrides of ``model`` on ``hardware``."""
        key = hardware.identity().key
        return [o for o in self.bundle.overrides if o.model == model and o.hardware.key == key]


class Sources:
    """A client's sources asked in the look-up order (`collective_matmul.wire.lookup`), each answer kept per process.

    Args:
        service: the server's answers (optional).
        bundle: a bundle's answers (optional).
        unmeasured: what answers where nothing measured does (`collective_matmul.wire.lookup.untuned`): ``baseline``
            or ``costmodel``.

    Raises:
        ValueError: if ``unmeasured`` is neither.
    """

    def __init__(self, service: ServiceSource | None = None, bundle: BundleSource | None = None,
                 unmeasured: Unmeasured = "baseline"):
        self.service, self.bundle, self.unmeasured = service, bundle, checked_unmeasured(unmeasured)
        self._cache: dict[tuple[str, str, str], Lookup] = {}

    def lookup(self, problem: Problem, hardware: Hardware) -> Lookup:
        """The config for ``problem`` on ``hardware``, for the stack ``hardware.software`` (`Hardware.detect`
        fills it; None: no stack, the newest measurement of any answers ``exact``), cached per process."""
        software = hardware.software
        key = (problem.key, hardware.key, software.key if software is not None else "")
        found = self._cache.get(key)
        if found is None:
            found = self._resolve(problem, hardware.identity(), software)
            if len(self._cache) < MAX_LOOKUPS:
                self._cache[key] = found
        return found

    def answer(self, slot: str, problem: Problem, hardware: Hardware) -> Lookup:
        """`lookup`, and for a ``grad_weight`` slot what `collective_matmul.wire.lookup.weight_gradient` makes of it."""
        found = self.lookup(problem, hardware)
        if slot != "grad_weight":
            return found
        return replace(found, decomposition=weight_gradient(found.decomposition, found.match))

    def _resolve(self, problem: Problem, hardware: Hardware, software: Software | None) -> Lookup:
        """The first answer in the look-up order: the measured ones (the server's first at the same match),
        then `collective_matmul.wire.lookup.untuned`'s, which says why."""
        measured = [a for a in (s.answer(problem, hardware, software) for s in (self.service, self.bundle)
                                if s is not None)
                    if a is not None and a.match in MEASURED and problem.accepts(a.decomposition)]
        if measured:
            return min(measured, key=lambda a: MATCHES.index(a.match))  # stable: the server first
        match, decomposition, reason = untuned(problem, hardware, self.unmeasured)
        return Lookup(decomposition, match, "costmodel" if match == "model" else "baseline", note=reason)
