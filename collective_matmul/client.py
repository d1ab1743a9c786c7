"""`Tuned`: how training code gets tuned configs and runs the ops with them.

Look-ups fall back in a stated order and say which they used: the model's per-role override,
the server's answer (exact, stale or nearest), the bundle's (the same, its stacks compared with this
process's), the cost model's choice for the hardware, the baseline.  Every look-up sends this
process's software stack (`collective_matmul.problem.Software`): a config measured on another stack
answers ``stale`` and the report says which stack measured it; an override of another stack is
still applied, and noted so.  Each (problem, hardware, stack) is looked up once per process; a server
that is down or errs is reported by one warning and never breaks the training step, and a served
config that does not fit its problem is skipped and reported, never raised inside the step.

Every call site the process traces is recorded — applied (problem, config, match, source) or fell
back (why) — and `Tuned.report` lists them; the first trace of each role logs one line on the
``collective_matmul`` logger.  The same interface serves the step variants `cmtune verify` times:
`Tuned.variant` edits every call's configs (the baseline everywhere, one role set back, ...), and
`Tuned.pinned` replays what process 0 resolved on the other processes of a group.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import jax
from jax.sharding import Mesh

from collective_matmul import roles
from collective_matmul.bundle import Bundle, RoleOverride, TunedConfig
from collective_matmul.decomposition import Decomposition, OpConfigs
from collective_matmul.lookup import (
    MATCHES,
    MEASURED,
    by_problem,
    from_tuned,
    override_note,
    stack_note,
    untuned,
    weight_gradient,
)
from collective_matmul.models import SLOTS, rings, slot_problems
from collective_matmul.ops import OPS, BatchAxis, problem_of
from collective_matmul.problem import Hardware, Problem, Software
from collective_matmul.wire import ConfigAnswer, Pin

logger = logging.getLogger("collective_matmul")

_COLLECTIVES = ("allgather_matmul", "matmul_reduce_scatter")
MAX_SITES = 4096  # call sites recorded per client (a bounded in-process record)

Edit = Callable[[str, OpConfigs], OpConfigs]


class VariantError(ValueError):
    """A step variant's edit gave a call a config its problem rejects: the variant is not the program
    its name says, so it fails (it never falls back to ``lax.dot_general``)."""


@dataclass(frozen=True)
class Lookup:
    """The answer to one look-up: the config, and where it came from."""

    decomposition: Decomposition
    match: str  # override | exact | stale | nearest | model | baseline | fixed
    source: str  # server | bundle | costmodel | baseline | variant | process 0
    speedup: float | None = None
    software: Software | None = None  # the stack that measured the config it came from
    note: str = ""  # what the answer says of the stacks (a stale one: which stack measured it)


@dataclass
class CallSite:
    """One call site the process traced: where, what it solved, and what ran there."""

    role: str
    source: str  # file:line of the call
    via: str  # op (tuned.allgather_matmul / matmul_reduce_scatter) | dot_general (the Flax drop-in)
    collective: str | None = None
    problems: dict[str, Problem] = field(default_factory=dict)
    found: dict[str, Lookup] = field(default_factory=dict)
    reason: str = ""  # why it fell back to lax.dot_general; empty when applied
    traces: int = 1
    notes: list[str] = field(default_factory=list)
    hardware: Hardware | None = None  # the ring's (what its configs are keyed by)
    axis: str | None = None  # the mesh axis of the ring

    @property
    def applied(self) -> bool:
        return not self.reason

    @property
    def configs(self) -> OpConfigs | None:
        return OpConfigs(**{slot: f.decomposition for slot, f in self.found.items()}) if self.applied else None

    def line(self) -> str:
        """One line: the role, where, and what ran (or why not)."""
        where = f"{self.role} ({self.source})" if self.source and self.source != self.role else self.role
        if not self.applied:
            return f"{where}: fell back to lax.dot_general: {self.reason}"
        forward = self.problems["forward"]
        slots = ", ".join(f"{slot} {f.decomposition.id} ({f.match} from {f.source}"
                          + (f", measured on {f.software}" if f.match == "stale" and f.software else "") + ")"
                          for slot, f in self.found.items())
        notes = f"; {'; '.join(self.notes)}" if self.notes else ""
        return f"{where}: {forward.key}: {slots}{notes}"


class Report(list):
    """`Tuned.report`: every call site traced, applied or fallen back, and the model's overrides no call matched.

    ``unmatched``: the roles of this model's overrides (for the hardware its calls ran on) that no
    traced call's role agrees with: decided for a label the step no longer has.
    """

    def __init__(self, sites=(), *, model: str | None = None, unmatched: Sequence[str] = ()):
        super().__init__(sites)
        self.model, self.unmatched = model, list(unmatched)

    @property
    def applied(self) -> list[CallSite]:
        return [s for s in self if s.applied]

    @property
    def fell_back(self) -> list[CallSite]:
        return [s for s in self if not s.applied]

    @property
    def stale(self) -> list[CallSite]:
        """The applied call sites that run a config measured on another software stack."""
        return [s for s in self.applied if any(f.match == "stale" for f in s.found.values())]

    def __str__(self) -> str:
        head = f"{len(self.applied)} call site(s) run cmtune's ops, {len(self.fell_back)} fell back"
        if self.stale:
            head += f"; {len(self.stale)} run configs measured on another software stack (stale)"
        lines = [head, *(f"  {s.line()}" for s in self)]
        if self.unmatched:
            lines.append(self.unmatched_line())
        return "\n".join(lines)

    def unmatched_line(self) -> str:
        """What `unmatched` means, in one line (empty if every override matched a call)."""
        if not self.unmatched:
            return ""
        return (f"{len(self.unmatched)} override(s) of model {self.model!r} matched no call site, not applied: "
                f"{', '.join(self.unmatched)}: the step's labels changed since its decision (a source-line label "
                "moves when its file is edited: give the layer a jax.named_scope or the drop-in's role=, and "
                "decide again)")


class Tuned:
    """Tuned collective matmuls for training code.

    Args:
        server: base URL of a cmtune service (optional).
        token: a reader token for the server.
        bundle: a bundle file (``cmtune tune --out`` or ``GET /v1/bundles``); needs no server.
        model: the name the model was submitted (or verified) under: its per-role overrides
            (decided by the step measurement) then come first for the calls of those roles.
        timeout_s: per request to the server.
    """

    def __init__(self, server: str | None = None, *, token: str | None = None, bundle: str | Path | None = None,
                 model: str | None = None, timeout_s: float = 2.0):
        self.server = server.rstrip("/") if server else None
        self.token = token
        self.bundle = Bundle.load(bundle) if bundle is not None else None
        self.model = model
        self.timeout_s = timeout_s
        self.name = "tuned"
        self._cache: dict[tuple[str, str, str], Lookup] = {}
        # hardware key -> problem key -> its configs, one per stack (`collective_matmul.lookup.by_problem`)
        self._bundle_configs: dict[str, dict[str, list[TunedConfig]]] = {}
        self._overrides: dict[str, dict[str, RoleOverride]] = {}
        self._warned: set[str] = set()
        self._client = None
        self._edit: Edit | None = None
        self._pins: dict[tuple[str, str], tuple[OpConfigs, dict[str, Lookup]]] | None = None
        self._reset_records()

    def _reset_records(self) -> None:
        self._calls: dict[tuple, tuple[Problem, Lookup]] = {}
        self._roles: dict[str, dict[str, tuple[Problem, Lookup]]] = {}
        self._sites: dict[tuple, CallSite] = {}
        self._logged: set[str] = set()
        self._matched: set[tuple[str, str]] = set()  # (hardware key, override role) some call used

    # -- variants --------------------------------------------------------------------------------

    def variant(self, name: str, edit: Edit) -> Tuned:
        """A client whose every call runs ``edit(role, configs)`` of what this one resolves.

        It shares this client's look-ups (server, bundle, cache) and keeps its own record of call
        sites; its look-ups are reported as ``fixed`` from ``variant`` where ``edit`` changed them.
        """
        child = object.__new__(Tuned)
        child.__dict__.update(self.__dict__)
        child.name, child._edit = name, edit
        child._reset_records()
        return child

    @classmethod
    def pinned(cls, pins: Mapping[str, Mapping], *, name: str = "tuned") -> Tuned:
        """A client that answers exactly what another process resolved (`pins` of that client).

        In a multi-process group, process 0 looks up and the others run what it found: every
        process then compiles the same program.  A call process 0 did not see runs the baseline.
        """
        client = cls()
        client.name = name
        client._pins = {}
        client.pin(pins)
        return client

    def pin(self, pins: Mapping[str, Pin | Mapping]) -> None:
        """Add what another process resolved to this `pinned` client (before its step is traced)."""
        if self._pins is None:
            raise ValueError("pin() is for a client made with Tuned.pinned(), which looks nothing up itself")
        for key, entry in pins.items():
            role, _, forward = key.rpartition("|")  # a problem key has no "|"; a role may
            entry = Pin.model_validate(entry)
            found = {slot: Lookup(getattr(entry.configs, slot), match, "process 0")
                     for slot, match in entry.match.items()}
            self._pins[(role, forward)] = (entry.configs, found)

    def pins(self) -> dict[str, Pin]:
        """What this client's calls resolved, for `pinned` (keyed ``role|forward problem``)."""
        return {f"{site.role}|{site.problems['forward'].key}": Pin(
                    configs=site.configs, match={slot: f.match for slot, f in site.found.items()})
                for site in self._sites.values() if site.applied}

    # -- look-ups ------------------------------------------------------------------------------

    def lookup(self, problem: Problem, hardware: Hardware) -> Lookup:
        """The config for ``problem`` on ``hardware``, for the stack ``hardware.software`` (`Hardware.detect`
        fills it; None: no stack, the newest measurement of any answers ``exact``), cached per process."""
        software = hardware.software
        key = (problem.key, hardware.key, software.key if software is not None else "")
        found = self._cache.get(key)
        if found is None:
            found = self._resolve(problem, hardware.identity(), software)
            if len(self._cache) < 1 << 16:
                self._cache[key] = found
        return found

    def _resolve(self, problem: Problem, hardware: Hardware, software: Software | None = None) -> Lookup:
        """The first answer in the look-up order (`collective_matmul.lookup`): the server's and the
        bundle's measured answers (the server's first at the same match), then the cost model or the baseline."""
        measured = [a for a in (self._from_server(problem, hardware, software),
                                self._from_bundle(problem, hardware, software))
                    if a is not None and a.match in MEASURED and problem.accepts(a.decomposition)]
        if measured:
            return min(measured, key=lambda a: MATCHES.index(a.match))  # stable: the server first
        match, decomposition = untuned(problem, hardware)
        return Lookup(decomposition, match, "costmodel" if match == "model" else "baseline")

    def _from_server(self, problem: Problem, hardware: Hardware, software: Software | None = None) -> Lookup | None:
        if self.server is None:
            return None
        params = problem.model_dump() | {"platform": hardware.platform, "device_kind": hardware.device_kind,
                                         "device_count": hardware.device_count,
                                         "process_count": hardware.process_count}
        if software is not None:
            params |= software.model_dump()
        try:
            response = self._http().get("/v1/configs", params=params)
            response.raise_for_status()
            body = ConfigAnswer.model_validate_json(response.content)
            return Lookup(body.decomposition, body.match, "server", body.speedup, body.software, body.note or "")
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

    def _from_bundle(self, problem: Problem, hardware: Hardware, software: Software | None = None) -> Lookup | None:
        if self.bundle is None:
            return None
        configs = self._bundle_configs.get(hardware.key)
        if configs is None:  # indexed once per hardware, not once per look-up
            configs = self._bundle_configs[hardware.key] = by_problem(c for c in self.bundle.configs
                                                                      if c.hardware.key == hardware.key)
        found = from_tuned(problem, configs, software)
        if found is None:
            return None
        match, config = found
        return Lookup(config.decomposition, match, "bundle", config.speedup if match in ("exact", "stale") else None,
                      config.software, stack_note(match, config, software) or "")

    def override(self, role: str, hardware: Hardware) -> _Override | None:
        """This model's override of ``role`` on ``hardware`` (server first, then the bundle), or None.

        Overrides are decided by measuring the whole step (see docs/tuning.md); they need
        ``model=``.  A call's role matches an override's when the two agree
        (`collective_matmul.roles.agree`).  Fetched once per hardware.
        """
        if self.model is None:
            return None
        key = hardware.identity().key
        if key not in self._overrides:
            found = {o.role: _override_of(o, "bundle") for o in (self.bundle.overrides if self.bundle else ())
                     if o.model == self.model and o.hardware.key == key}
            found |= {o.role: _override_of(o, "server") for o in self._overrides_from_server(hardware)}
            self._overrides[key] = found
        known = self._overrides[key]
        name = roles.match(role, list(known))
        if name is None:
            return None
        self._matched.add((key, name))
        return known[name]

    def _overrides_from_server(self, hardware: Hardware) -> list[RoleOverride]:
        if self.server is None:
            return []
        try:
            client = self._http()
            response = client.get("/v1/overrides", params={
                "model": self.model, "platform": hardware.platform, "device_kind": hardware.device_kind,
                "device_count": hardware.device_count, "process_count": hardware.process_count})
            response.raise_for_status()
            served = list(response.json())
        except Exception as exc:  # noqa: BLE001 - the training step must go on
            self._warn_once("server", f"cmtune server {self.server} unavailable ({type(exc).__name__}: {exc}); "
                                      "falling back to the bundle, the cost model or the baseline")
            return []
        found = []
        for item in served:  # one bad entry costs only itself
            try:
                found.append(RoleOverride.model_validate(item))
            except ValueError as exc:
                self._warn_once(f"override:{item.get('role') if isinstance(item, dict) else item!r}",
                                f"cmtune server {self.server} served an override that does not check out, "
                                f"skipped: {exc}")
        return found

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- what ran ------------------------------------------------------------------------------

    @property
    def resolved(self) -> list[tuple[Problem, Lookup]]:
        """Every (problem, answer) the ops of this process have used so far (forward and backward)."""
        return list(self._calls.values())

    @property
    def resolved_by_role(self) -> dict[str, dict[str, tuple[Problem, Lookup]]]:
        """Per role: ``{"forward" | "grad_input" | "grad_weight": (problem, answer)}``."""
        return {role: dict(slots) for role, slots in self._roles.items()}

    def report(self) -> Report:
        """Every call site this process traced: applied (problem, configs, match, source) or fell back (why), and
        the model's overrides (for the hardware of the calls it applied) that no call matched."""
        traced = {site.hardware.key for site in self._sites.values() if site.applied}
        unmatched = sorted(role for key in traced for role in self._overrides.get(key, {})
                           if (key, role) not in self._matched)
        return Report(self._sites.values(), model=self.model, unmatched=unmatched)

    def per_role(self) -> dict[str, list[OpConfigs]]:
        """The configs each role's applied calls ran, one entry per distinct problem."""
        out: dict[str, list[OpConfigs]] = {}
        for site in self._sites.values():
            if site.applied and site.configs not in out.setdefault(site.role, []):
                out[site.role].append(site.configs)
        return out

    def fell_back(self, role: str, reason: str, *, source: str = "") -> None:
        """Record a call the drop-in ran as plain ``lax.dot_general`` (``reason``: why)."""
        self._site(CallSite(role=role, source=source, via="dot_general", reason=reason))

    def _site(self, site: CallSite) -> CallSite:
        key = (site.role, site.source, site.via, site.collective,
               site.problems["forward"].key if site.problems else None, site.reason)
        known = self._sites.get(key)
        if known is not None:
            known.traces += 1
            return known
        if len(self._sites) < MAX_SITES:
            self._sites[key] = site
        if site.role not in self._logged:
            self._logged.add(site.role)
            logger.info("cmtune %s: %s", self.name, site.line())
        return site

    # -- ops -----------------------------------------------------------------------------------

    def allgather_matmul(self, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
                         role: str | None = None) -> jax.Array:
        """`collective_matmul.allgather_matmul` with the tuned configs (forward and backward) for these shapes.

        ``role`` labels the call (default: the rule of `collective_matmul.roles` at the call site).
        """
        return self._op("allgather_matmul", x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, role=role)

    def matmul_reduce_scatter(self, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None,
                              role: str | None = None) -> jax.Array:
        """`collective_matmul.matmul_reduce_scatter` with the tuned configs (forward and backward) for these shapes.

        ``role`` labels the call (default: the rule of `collective_matmul.roles` at the call site).
        """
        return self._op("matmul_reduce_scatter", x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, role=role)

    def _op(self, collective: str, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis, role: str | None):
        label, source = roles.call_site()
        configs = self.configs(role or label, collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis,
                               source=source)
        return OPS[collective](x, w, mesh=mesh, axis=axis, batch_axis=batch_axis, config=configs.forward,
                               grad_input=configs.grad_input, grad_weight=configs.grad_weight)

    def dot_general(self, *, mesh: Mesh, axis: str = "model", kind: str | None = None,
                    kernel_axes: tuple | None = None, **options):
        """The Flax drop-in: a ``dot_general`` running these configs (see `collective_matmul.flax.dot_general`)."""
        from collective_matmul.flax import dot_general

        return dot_general(self, mesh=mesh, axis=axis, kind=kind, kernel_axes=kernel_axes, **options)

    def dot_general_cls(self, *, mesh: Mesh, axis: str = "model", kind: str | None = None,
                        kernel_axes: tuple | None = None, **options):
        """For linen's ``dot_general_cls=``: a factory of `dot_general` (see `collective_matmul.flax`)."""
        from collective_matmul.flax import dot_general_cls

        return dot_general_cls(self, mesh=mesh, axis=axis, kind=kind, kernel_axes=kernel_axes, **options)

    def config_for(self, collective: str, x, w, *, mesh: Mesh, axis: str, batch_axis: BatchAxis = None
                   ) -> Decomposition:
        """The forward config an op call would use (the problem is derived from the arrays and the mesh)."""
        return self.configs(None, collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis).forward

    def configs(self, role: str | None, collective: str, x, w, *, mesh: Mesh, axis: str,
                batch_axis: BatchAxis = None, source: str = "", via: str = "op") -> OpConfigs:
        """The forward, ``grad_input`` and ``grad_weight`` configs of one op call (a `ConfigSource`).

        The three problems come from the forward's shapes by the rule of
        `collective_matmul.models.slot_problems`.  The model's override of ``role`` comes first
        (each of its configs checked against its problem: one that does not fit is skipped and
        noted, warned about once); then each problem is looked up with `lookup`, and a weight
        gradient runs what `collective_matmul.lookup.weight_gradient` makes of its answer.

        Args:
            role: the call's role (``qkv``, a Flax module path, ...) or None (not recorded by role).
            collective: ``allgather_matmul`` or ``matmul_reduce_scatter``.
            x, w: the forward's operands (arrays, tracers or `jax.ShapeDtypeStruct`).
            mesh, axis, batch_axis: as for the op.
            source: ``file:line`` of the call, for `report` (default: the call site, where ``role`` is given).
            via: how the call came (``op`` or ``dot_general``), for `report`.

        Raises:
            ValueError: if ``collective`` is not one of the two ops or the shapes do not fit.
        """
        if collective not in _COLLECTIVES:
            raise ValueError(f"configs: collective must be one of {sorted(_COLLECTIVES)}, got {collective!r}")
        forward = problem_of(collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis)
        problems = slot_problems(collective, m=forward.m, k=forward.k, n=forward.n, dtype=forward.dtype,
                                 axis_size=forward.axis_size)
        hardware = ring_hardware(mesh, axis)
        if role is not None and not source:
            source = roles.call_site()[1]
        site = CallSite(role=role or "", source=source, via=via, collective=collective, problems=problems,
                        hardware=hardware.identity(), axis=axis)
        if self._pins is not None:
            found = self._pinned_found(role or "", problems)
        else:
            call = (collective, tuple(x.shape), tuple(w.shape), str(x.dtype), id(mesh), axis, batch_axis)
            found = self._found(role, call, hardware, problems=problems, notes=site.notes)
        if self._edit is not None:
            before = OpConfigs(**{slot: f.decomposition for slot, f in found.items()})
            after = self._edit(role or "", before)
            for slot in SLOTS:
                chosen = getattr(after, slot)
                if chosen != getattr(before, slot):
                    if not problems[slot].accepts(chosen):
                        raise VariantError(f"variant {self.name}: {role} {slot} {chosen.id} does not fit "
                                           f"{problems[slot].key}")
                    found[slot] = Lookup(chosen, "fixed", "variant")
        site.found = found
        if role is not None:
            self._roles[role] = {slot: (problems[slot], found[slot]) for slot in SLOTS}
            self._site(site)
        return OpConfigs(**{slot: found[slot].decomposition for slot in SLOTS})

    def _found(self, role, call: tuple, hardware: Hardware, *, problems, notes) -> dict[str, Lookup]:
        override = self.override(role, hardware) if role else None
        found: dict[str, Lookup] = {}
        for slot, problem in problems.items():
            skipped = False
            if override is not None:  # the step measurement decided this role for this model
                chosen = getattr(override.configs, slot)
                if problem.accepts(chosen):
                    stack = override_note(override.software, hardware.software)
                    if stack is not None and stack not in notes:
                        notes.append(stack)  # still applied: a new stack's step measurement replaces it
                    found[slot] = Lookup(chosen, "override", override.source, software=override.software,
                                         note=stack or "")
                    continue
                note = f"override {slot} {chosen.id} does not fit {problem.key}: skipped"
                notes.append(note)
                self._warn_once(f"override:{role}:{slot}", f"{self.model} {role}: {note} (from the {override.source}; "
                                                           "the look-up decides instead)")
                skipped = True
            key = (slot, *call)
            hit = self._calls.get(key)
            if hit is None:
                answer = self.lookup(problem, hardware)
                if slot == "grad_weight":
                    answer = replace(answer, decomposition=weight_gradient(answer.decomposition, answer.match))
                hit = (problem, answer)
                if len(self._calls) < MAX_SITES:
                    self._calls[key] = hit
            found[slot] = replace(hit[1], source=f"{hit[1].source} (the override did not fit)") if skipped else hit[1]
        return found

    def _pinned_found(self, role: str, problems: dict[str, Problem]) -> dict[str, Lookup]:
        pinned = self._pins.get((role, problems["forward"].key))
        if pinned is None:  # what autodiff of the baseline does (OpConfigs' defaults)
            return {slot: Lookup(getattr(OpConfigs(), slot), "baseline", "process 0 did not resolve this call")
                    for slot in SLOTS}
        configs, found = pinned
        return {slot: found.get(slot, Lookup(getattr(configs, slot), "fixed", "process 0")) for slot in SLOTS}


@dataclass(frozen=True)
class _Override:
    configs: OpConfigs
    source: str
    reason: str
    software: Software | None = None  # the stack of the step measurement that decided it


def _override_of(found: RoleOverride, source: str) -> _Override:
    return _Override(found.configs, source, found.reason, found.software)


def ring_hardware(mesh: Mesh, axis: str) -> Hardware:
    """The hardware of one ring of ``mesh`` along ``axis``, the first (what configs are tuned for)."""
    return Hardware.detect(rings(mesh.devices, mesh.axis_names.index(axis))[0].tolist())
