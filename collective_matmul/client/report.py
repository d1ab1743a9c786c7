"""The call-site report: every call a client traced, applied (problem, configs, match, origin) or fell back (why).

`Record` is what one client's calls resolved and ran: the call sites (`CallSite`, listed by
`Report`), each call's answers, each role's, and the overrides its calls matched; the first call
site of each role logs one line on the ``collective_matmul`` logger.  `Pins` replays what another
process's record resolved (`Tuned.pinned`).  The call sites and the calls' answers kept are bounded
(`MAX_SITES`).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from collective_matmul.client.sources import Lookup
from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.planning.models import SLOTS
from collective_matmul.planning.problem import Hardware, Problem
from collective_matmul.planning.xla_options import missing_overlap_flags, windowed_einsum
from collective_matmul.wire import Pin

logger = logging.getLogger("collective_matmul")

MAX_SITES = 4096  # call sites (and calls) recorded per client (a bounded in-process record)


@dataclass
class CallSite:
    """One call site the process traced: where, what it solved, and what ran there."""

    role: str
    site: str  # file:line of the call
    via: str  # op (tuned.allgather_matmul / matmul_reduce_scatter) | dot_general (the Flax drop-in)
    collective: str | None = None
    problems: dict[str, Problem] = field(default_factory=dict)
    found: dict[str, Lookup] = field(default_factory=dict)
    reason: str = ""  # why it fell back to lax.dot_general; empty when applied
    traces: int = 1
    notes: list[str] = field(default_factory=list)
    hardware: Hardware | None = None  # the ring's (what its configs are keyed by)
    axis: str | None = None  # the mesh axis of the ring
    gathered_by: str = ""  # the role whose gather this call reuses (collective_matmul.ops.share); "" = its own
    members: list[str] = field(default_factory=list)  # a group's summed input gradient: the roles of its calls

    @property
    def source(self) -> str:
        """The old name of `site`: it resolves for one more release, with a `DeprecationWarning`."""
        warnings.warn("CallSite.source is CallSite.site (the call's file:line): the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return self.site

    @property
    def applied(self) -> bool:
        return not self.reason

    @property
    def configs(self) -> OpConfigs | None:
        return OpConfigs(**{slot: f.decomposition for slot, f in self.found.items()}) if self.applied else None

    @property
    def runs(self) -> dict[str, Lookup]:
        """The answers that run: a group's summed input gradient runs its ``grad_input`` alone."""
        return {"grad_input": self.found["grad_input"]} if self.members else self.found

    @property
    def unmeasured(self) -> list[str]:
        """Why slots were answered by nothing measured on this hardware (`collective_matmul.wire.lookup.untuned`)."""
        return list(dict.fromkeys(f.note for f in self.runs.values() if f.match in ("model", "baseline") and f.note))

    def line(self) -> str:
        """One line: the role, where, and what ran (or why not)."""
        where = f"{self.role} ({self.site})" if self.site and self.site != self.role else self.role
        if not self.applied:
            return f"{where}: fell back to lax.dot_general: {self.reason}"
        if self.members:
            found, problem = self.found["grad_input"], self.problems["grad_input"]
            return (f"{where}: the input gradients of {', '.join(self.members)} in one reduce-scatter ring, "
                    f"{problem.key}: grad_input {found.decomposition.id} ({found.match} from {found.origin})"
                    + "".join(f"; {note}" for note in self.unmeasured))
        forward = self.problems["forward"]
        slots = ", ".join(f"{slot} {f.decomposition.id} ({f.match} from {f.origin}"
                          + (f", measured on {f.software}" if f.match == "stale" and f.software else "") + ")"
                          for slot, f in self.found.items())
        if self.gathered_by:
            return (f"{where}: {forward.key}: reuses the gather of {self.gathered_by} (its product local, its input "
                    f"gradient in {self.gathered_by}'s reduce-scatter, its weight gradient from the gathered copy)")
        notes = "".join(f"; {note}" for note in (*self.unmeasured, *self.notes))
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
    def groups(self) -> dict[str, list[str]]:
        """The gathers shared (`collective_matmul.ops.share`): the role of the call that gathered -> the roles of the
        calls that reused its gathered activation, in trace order."""
        groups: dict[str, list[str]] = {}
        for site in self.applied:
            if site.gathered_by and site.role not in groups.setdefault(site.gathered_by, []):
                groups[site.gathered_by].append(site.role)
        return groups

    def groups_line(self) -> str:
        """The shared gathers in one line (empty where none was shared)."""
        if not self.groups:
            return ""
        listed = "; ".join(f"{first} gathers for {', '.join(rest)}" for first, rest in self.groups.items())
        return (f"{len(self.groups)} gather(s) shared: {listed}: one ring (or all-gather) per activation and one "
                "reduce-scatter of the summed input gradients, the memory of the step as written (the gathered "
                "activation, once)")

    @property
    def stale(self) -> list[CallSite]:
        """The applied call sites that run a config measured on another software stack."""
        return [s for s in self.applied if any(f.match == "stale" for f in s.runs.values())]

    @property
    def left_to_xla(self) -> list[CallSite]:
        """The applied call sites whose configs leave the product to XLA's own decomposition (method ``xla``)."""
        return [s for s in self.applied if any(f.decomposition.method == "xla" for f in s.runs.values())]

    def compiler_options(self) -> dict[str, object]:
        """The compile options the training step needs for what its call sites run: XLA's windowed einsum on at
        any size where a role is left to XLA (it was timed so; at XLA's default threshold a smaller product stays
        a plain collective), for ``jax.jit(step).lower(...).compile(compiler_options=...)``; empty otherwise."""
        options: dict[str, object] = {}
        for site in self.left_to_xla:
            if site.hardware is not None:
                options.update(windowed_einsum(site.hardware.platform, "on") or {})
        return options

    def advice(self, xla_flags: str | None = None) -> list[str]:
        """What the training process must set for the configs it runs to do what they were timed doing: the compile
        options of roles left to XLA, and on GPU the overlap flags missing from ``xla_flags`` (the process's
        ``XLA_FLAGS`` when None) without which no ring overlaps."""
        lines = []
        options = self.compiler_options()
        if options:
            roles = ", ".join(dict.fromkeys(s.role for s in self.left_to_xla))
            lines.append(f"{len(self.left_to_xla)} call site(s) leave the product to XLA's windowed einsum "
                         f"({roles}): compile the step with compiler_options={options!r} "
                         "(tuned.report().compiler_options()), as they were timed")
        flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
        platforms = {s.hardware.platform for s in self.applied if s.hardware}
        missing = list(dict.fromkeys(f for p in sorted(platforms) for f in missing_overlap_flags(flags, p)))
        if missing:
            lines.append(f"XLA_FLAGS lacks {' '.join(missing)}: without them XLA does not overlap a ring's permutes "
                         "with its matmuls on GPU; set them before JAX starts "
                         "(collective_matmul.planning.xla_options.with_overlap_flags)")
        return lines

    def __str__(self) -> str:
        head = f"{len(self.applied)} call site(s) run cmtune's ops, {len(self.fell_back)} fell back"
        if self.stale:
            head += f"; {len(self.stale)} run configs measured on another software stack (stale)"
        lines = [head, *(f"  {s.line()}" for s in self)]
        if self.groups:
            lines.append(self.groups_line())
        if self.unmatched:
            lines.append(self.unmatched_line())
        return "\n".join([*lines, *self.advice()])

    def unmatched_line(self) -> str:
        """What `unmatched` means, in one line (empty if every override matched a call)."""
        if not self.unmatched:
            return ""
        return (f"{len(self.unmatched)} override(s) of model {self.model!r} matched no call site, not applied: "
                f"{', '.join(self.unmatched)}: the step's labels changed since its decision (a source-line label "
                "moves when its file is edited: give the layer a jax.named_scope or the drop-in's role=, and "
                "decide again)")


class Record:
    """What one client's calls resolved and ran (a step variant keeps its own).

    Args:
        name: the client's name, for the log (``tuned``, a variant's name).
    """

    def __init__(self, name: str):
        self.name = name
        self.calls: dict[tuple, tuple[Problem, Lookup]] = {}  # (slot, the call's shapes, mesh, axis) -> answer
        self.roles: dict[str, dict[str, tuple[Problem, Lookup]]] = {}
        self.sites: dict[tuple, CallSite] = {}
        self.logged: set[str] = set()
        self.matched: set[tuple[str, str]] = set()  # (hardware key, override role) some call used

    def answer(self, key: tuple, problem: Problem, resolve: Callable[[], Lookup]) -> Lookup:
        """The answer of the call ``key`` (``resolve()`` the first time), kept for `resolved`."""
        hit = self.calls.get(key)
        if hit is None:
            hit = (problem, resolve())
            if len(self.calls) < MAX_SITES:
                self.calls[key] = hit
        return hit[1]

    def traced(self, call: CallSite) -> CallSite:
        """Record a traced call (a call traced again counts); the first of its role is logged."""
        key = (call.role, call.site, call.via, call.collective,
               call.problems["forward"].key if call.problems else None, call.reason)
        known = self.sites.get(key)
        if known is not None:
            known.traces += 1
            return known
        if len(self.sites) < MAX_SITES:
            self.sites[key] = call
        if call.role not in self.logged:
            self.logged.add(call.role)
            logger.info("cmtune %s: %s", self.name, call.line())
        return call

    def applied(self, call: CallSite) -> None:
        """Record an applied call of a role: its call site, and the role's problems and answers."""
        self.roles[call.role] = {slot: (call.problems[slot], call.found[slot]) for slot in SLOTS}
        self.traced(call)

    def per_role(self) -> dict[str, list[OpConfigs]]:
        """The configs each role's applied calls ran, one entry per distinct problem."""
        out: dict[str, list[OpConfigs]] = {}
        for site in self.sites.values():
            if site.applied and site.configs not in out.setdefault(site.role, []):
                out[site.role].append(site.configs)
        return out

    def pins(self) -> dict[str, Pin]:
        """What the applied calls resolved, for `Pins` (keyed ``role|forward problem``)."""
        return {f"{site.role}|{site.problems['forward'].key}": Pin(
                    configs=site.configs, match={slot: f.match for slot, f in site.found.items()})
                for site in self.sites.values() if site.applied}

    def report(self, model: str | None, unmatched: Callable[[Iterable[str], set[tuple[str, str]]], list[str]]
               ) -> Report:
        """The `Report` of the call sites; ``unmatched(hardware keys of the applied calls, matched)``: the overrides
        of ``model`` no call matched (`collective_matmul.client.overrides.Overrides.unmatched`)."""
        traced = {site.hardware.key for site in self.sites.values() if site.applied}
        return Report(self.sites.values(), model=model, unmatched=unmatched(traced, self.matched))


class Pins:
    """What another process's client resolved (`Record.pins`), answered call by call."""

    def __init__(self, pins: Mapping[str, Pin | Mapping] | None = None):
        self._pins: dict[tuple[str, str], tuple[OpConfigs, dict[str, Lookup]]] = {}
        self.add(pins or {})

    def add(self, pins: Mapping[str, Pin | Mapping]) -> None:
        """Add pins (keyed ``role|forward problem``); a pin of the same call replaces the one before."""
        for key, entry in pins.items():
            role, _, forward = key.rpartition("|")  # a problem key has no "|"; a role may
            entry = Pin.model_validate(entry)
            found = {slot: Lookup(getattr(entry.configs, slot), match, "process 0")
                     for slot, match in entry.match.items()}
            self._pins[(role, forward)] = (entry.configs, found)

    def answers(self, role: str | None, call: tuple, hardware: Hardware, problems: Mapping[str, Problem],
                notes: list[str], record: Record) -> dict[str, Lookup]:
        """The pinned answers of the call of ``role`` with these problems (the baselines where none was pinned);
        the other arguments are those of `collective_matmul.client.overrides.Overrides.answers`, unused here."""
        pinned = self._pins.get((role or "", problems["forward"].key))
        if pinned is None:  # what autodiff of the baseline does (OpConfigs' defaults)
            return {slot: Lookup(getattr(OpConfigs(), slot), "baseline", "process 0 did not resolve this call")
                    for slot in SLOTS}
        configs, found = pinned
        return {slot: found.get(slot, Lookup(getattr(configs, slot), "fixed", "process 0")) for slot in SLOTS}
