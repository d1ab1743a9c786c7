"""`Tuned`: how training code gets tuned configs and runs the ops with them.

Look-ups fall back in a stated order and say which they used: the model's per-role override
(`collective_matmul.client.overrides`), the server's answer (exact, stale or nearest), the bundle's (the
same, its stacks compared with this process's), then the baseline, "not measured on this hardware"
(`collective_matmul.client.sources`): a ring no one measured never runs unless the client asks for the
cost model's choice (``unmeasured="costmodel"``).  Every look-up sends this process's software stack
(`collective_matmul.planning.problem.Software`): a config measured on another stack answers ``stale`` and the
report says which stack measured it; an override of another stack is still applied, and noted so.
Each (problem, hardware, stack) is looked up once per process; a server that is down or errs is
reported by one warning and never breaks the training step, and a served config that does not fit
its problem is skipped and reported, never raised inside the step.

Every call site the process traces is recorded — applied (problem, config, match, origin) or fell
back (why) — and `Tuned.report` lists them (`collective_matmul.client.report`); the first trace of each role
logs one line on the ``collective_matmul`` logger.  The same interface serves the step variants
`cmtune verify` times: `Tuned.variant` edits every call's configs (the baseline everywhere, one role
set back, ...), and `Tuned.pinned` replays what process 0 resolved on the other processes of a group.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from jax.sharding import Mesh

from collective_matmul.client.calls import SourceOps, call_problems
from collective_matmul.client.overrides import Override, Overrides
from collective_matmul.client.report import CallSite, Pins, Record, Report
from collective_matmul.client.sources import BundleSource, Lookup, ServiceSource, Sources, WarnOnce
from collective_matmul.ops.collective import BatchAxis
from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.planning.models import SLOTS, ring_hardware
from collective_matmul.planning.problem import Hardware, Problem
from collective_matmul.programs import roles
from collective_matmul.wire import Pin
from collective_matmul.wire.bundle import Bundle
from collective_matmul.wire.lookup import Unmeasured

__all__ = ["CallSite", "Lookup", "Report", "Tuned", "VariantError", "ring_hardware"]

Edit = Callable[[str, OpConfigs], OpConfigs]


class VariantError(ValueError):
    """A step variant's edit gave a call a config its problem rejects: the variant is not the program
    its name says, so it fails (it never falls back to ``lax.dot_general``)."""


class Tuned(SourceOps):
    """Tuned collective matmuls for training code (a `collective_matmul.client.sources.ConfigSource`), with the ops
    and the Flax drop-in (`SourceOps`: ``allgather_matmul``, ``matmul_reduce_scatter``, ``weight_allgather_matmul``,
    ``dot_general``, ``dot_general_cls``) running them.

    Args:
        server: base URL of a cmtune service (optional).
        token: a reader token for the server.
        bundle: a bundle file (``cmtune tune --out`` or ``GET /v1/bundles``); needs no server.
        model: the name the model was submitted (or verified) under: its roles' overrides answer first.
        timeout_s: per request to the server.
        unmeasured: what answers a problem nothing measured on this hardware: ``baseline`` (the default) or
            ``costmodel`` (the cost model's untimed choice on the kind's profile; match ``model``).

    Raises:
        ValueError: if ``unmeasured`` is neither.
    """

    share = True  # the drop-in's column calls of one activation share one gather (`collective_matmul.ops.share`)

    def __init__(self, server: str | None = None, *, token: str | None = None, bundle: str | Path | None = None,
                 model: str | None = None, timeout_s: float = 2.0, unmeasured: Unmeasured = "baseline"):
        self.server = server.rstrip("/") if server else None
        self.bundle = Bundle.load(bundle) if bundle is not None else None
        self.model = model
        warn = WarnOnce()
        self._sources = Sources(ServiceSource(server, token=token, timeout_s=timeout_s, warn=warn) if server else None,
                                BundleSource(self.bundle) if self.bundle is not None else None, unmeasured)
        self._overrides = Overrides(model, self._sources, warn)
        self._answers: Overrides | Pins = self._overrides  # how a call is answered: looked up, or pinned
        self._record = Record("tuned")
        self._edit: Edit | None = None

    @property
    def name(self) -> str:
        """``tuned``, or the name of the step variant this client is."""
        return self._record.name

    def variant(self, name: str, edit: Edit) -> Tuned:
        """A client whose every call runs ``edit(role, configs)`` of what this one resolves: it shares this one's
        look-ups and keeps its own record; a config ``edit`` changed is reported ``fixed`` from ``variant``."""
        child = copy.copy(self)
        child._edit, child._record = edit, Record(name)
        return child

    @classmethod
    def pinned(cls, pins: Mapping[str, Mapping], *, name: str = "tuned") -> Tuned:
        """A client that answers exactly what another process resolved (`pins` of that client): in a group, process
        0 looks up, the others run what it found (one program); a call process 0 did not see runs the baseline."""
        client = cls()
        client._record, client._answers = Record(name), Pins(pins)
        return client

    def pin(self, pins: Mapping[str, Pin | Mapping]) -> None:
        """Add what another process resolved to this `pinned` client (before its step is traced)."""
        if not isinstance(self._answers, Pins):
            raise ValueError("pin() is for a client made with Tuned.pinned(), which looks nothing up itself")
        self._answers.add(pins)

    def pins(self) -> dict[str, Pin]:
        """What this client's calls resolved, for `pinned` (keyed ``role|forward problem``)."""
        return self._record.pins()

    def lookup(self, problem: Problem, hardware: Hardware) -> Lookup:
        """The config for ``problem`` on ``hardware`` (`collective_matmul.client.sources.Sources.lookup`), kept per
        process."""
        return self._sources.lookup(problem, hardware)

    def override(self, role: str, hardware: Hardware) -> Override | None:
        """This model's override of ``role`` on ``hardware`` (server, then bundle:
        `collective_matmul.client.overrides`)."""
        return self._overrides.match(role, hardware, self._record.matched)

    @property
    def resolved(self) -> list[tuple[Problem, Lookup]]:
        """Every (problem, answer) the ops of this process have used so far (forward and backward)."""
        return list(self._record.calls.values())

    @property
    def resolved_by_role(self) -> dict[str, dict[str, tuple[Problem, Lookup]]]:
        """Per role: ``{"forward" | "grad_input" | "grad_weight": (problem, answer)}``."""
        return {role: dict(slots) for role, slots in self._record.roles.items()}

    def report(self) -> Report:
        """Every call site this process traced: applied (problem, configs, match, origin) or fell back (why), and
        the model's overrides (for the hardware of the calls it applied) that no call matched."""
        return self._record.report(self.model, self._overrides.unmatched)

    def per_role(self) -> dict[str, list[OpConfigs]]:
        """The configs each role's applied calls ran, one entry per distinct problem."""
        return self._record.per_role()

    def fell_back(self, role: str, reason: str, *, site: str = "") -> None:
        """Record a call the drop-in ran as plain ``lax.dot_general`` (``reason``: why; ``site``: its ``file:line``)."""
        self._record.traced(CallSite(role=role, site=site, via="dot_general", reason=reason))

    def configs(self, role: str | None, collective: str, x, w, *, mesh: Mesh, axis: str,
                batch_axis: BatchAxis = None, tensor_axis: str | None = None, site: str = "", via: str = "op",
                gathered_by: str = "", members: Sequence[str] = ()) -> OpConfigs:
        """The forward, ``grad_input`` and ``grad_weight`` configs of one op call (a `ConfigSource`): the problems
        of the forward's shapes (`collective_matmul.client.calls.call_problems`), answered by the model's override of
        ``role``, then `lookup`.

        Args:
            role: the call's role (``qkv``, a Flax module path, ...) or None (not recorded by role).
            collective, x, w, mesh, axis, batch_axis, tensor_axis: as for the op (arrays, tracers or shape
                structs; ``tensor_axis`` for a weight gathered under tensor parallelism).
            site, via: the call's ``file:line`` (default: its call site) and how it came, for `report`.
            gathered_by: the role of the call whose gather this one reuses (`collective_matmul.ops.share`), for
                `report`.
            members: the roles of a group of calls of one gathered activation whose summed input gradient this is
                (``w``: their weights side by side): its ``grad_input`` is what runs, and what `report` shows.

        Raises:
            ValueError: if ``collective`` is not one of the forward collectives or the shapes do not fit.
        """
        problems = call_problems(collective, x, w, mesh=mesh, axis=axis, batch_axis=batch_axis,
                                 tensor_axis=tensor_axis)
        hardware = ring_hardware(mesh, axis)
        if role is not None and not site:
            site = roles.call_site()[1]
        traced = CallSite(role=role or "", site=site, via=via, collective=collective, problems=problems,
                          hardware=hardware.identity(), axis=axis, gathered_by=gathered_by, members=list(members))
        call = (collective, tuple(x.shape), tuple(w.shape), str(x.dtype), id(mesh), axis, batch_axis, tensor_axis)
        found = self._answers.answers(role, call, hardware, problems, traced.notes, self._record)
        traced.found = _edited(self.name, self._edit, role, problems, found) if self._edit is not None else found
        if role is not None:
            self._record.applied(traced)
        return traced.configs


def _edited(name: str, edit: Edit, role: str | None, problems: dict[str, Problem],
            found: dict[str, Lookup]) -> dict[str, Lookup]:
    """``found`` after a step variant's ``edit``: a config it changed answers ``fixed`` from ``variant``.

    Raises:
        VariantError: if the edit gives a slot a config its problem rejects.
    """
    before = OpConfigs(**{slot: f.decomposition for slot, f in found.items()})
    after = edit(role or "", before)
    for slot in SLOTS:
        chosen = getattr(after, slot)
        if chosen != getattr(before, slot):
            if not problems[slot].accepts(chosen):
                raise VariantError(f"variant {name}: {role} {slot} {chosen.id} does not fit {problems[slot].key}")
            found[slot] = Lookup(chosen, "fixed", "variant")
    return found
