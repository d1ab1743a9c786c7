"""Applying stored overrides: a model's per-role decisions (from its step measurement) to the calls of those roles.

The overrides of a model on one hardware are fetched once, from the bundle and then the server (the
server's win).  A call's role matches an override's when the two agree (`collective_matmul.programs.roles.agree`);
each of the override's configs is checked against its problem: one that does not fit is skipped, noted
on the call and warned about once, and the look-up answers that slot instead.  An override decided
on another software stack is still applied, and noted so.  Nothing here decides: the step decision is the
tuner's; the client only applies what it stored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from collective_matmul.client.sources import Lookup, Sources, WarnOnce
from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.programs import roles
from collective_matmul.wire.bundle import RoleOverride
from collective_matmul.wire.lookup import override_note, whole_op

if TYPE_CHECKING:
    from collective_matmul.client.report import Record


@dataclass(frozen=True)
class Override:
    """One role's override: its configs, where it came from (``origin``), why, and the stack that decided it."""

    configs: OpConfigs
    origin: str  # server | bundle
    reason: str
    software: Software | None = None  # the stack of the step measurement that decided it

    @classmethod
    def of(cls, found: RoleOverride, origin: str) -> Override:
        return cls(found.configs, origin, found.reason, found.software)


class Overrides:
    """The per-role overrides of ``model`` (None: none) from ``sources``, fetched once per hardware."""

    def __init__(self, model: str | None, sources: Sources, warn: WarnOnce):
        self.model, self.sources, self.warn = model, sources, warn
        self._known: dict[str, dict[str, Override]] = {}  # hardware key -> role -> its override

    def match(self, role: str, hardware: Hardware, matched: set[tuple[str, str]]) -> Override | None:
        """The override whose role agrees with ``role`` on ``hardware``, or None; adds (hardware key, its role)
        to ``matched``."""
        if self.model is None:
            return None
        key = hardware.identity().key
        if key not in self._known:
            found: dict[str, Override] = {}
            for source in (self.sources.bundle, self.sources.service):  # the server's come last: they win
                if source is not None:
                    found |= {o.role: Override.of(o, source.name) for o in source.overrides(self.model, hardware)}
            self._known[key] = found
        known = self._known[key]
        name = roles.match(role, list(known))
        if name is None:
            return None
        matched.add((key, name))
        return known[name]

    def apply(self, role: str, hardware: Hardware, problems: dict[str, Problem], notes: list[str],
              matched: set[tuple[str, str]]) -> tuple[dict[str, Lookup], set[str]]:
        """``role``'s override applied to ``problems`` (slot -> problem): the answers of the slots whose config
        fits, and the slots whose config does not (skipped, added to ``notes``, warned about once)."""
        override = self.match(role, hardware, matched)
        if override is None:
            return {}, set()
        found, skipped = {}, set()
        for slot, problem in problems.items():
            chosen = getattr(override.configs, slot)
            if problem.accepts(chosen):
                stack = override_note(override.software, hardware.software)
                if stack is not None and stack not in notes:
                    notes.append(stack)  # still applied: a new stack's step measurement replaces it
                found[slot] = Lookup(chosen, "override", override.origin, software=override.software, note=stack or "")
                continue
            note = f"override {slot} {chosen.id} does not fit {problem.key}: skipped"
            notes.append(note)
            self.warn(f"override:{role}:{slot}", f"{self.model} {role}: {note} (from the {override.origin}; the "
                                                 "look-up answers instead)")
            skipped.add(slot)
        return found, skipped

    def answers(self, role: str | None, call: tuple, hardware: Hardware, problems: dict[str, Problem],
                notes: list[str], record: Record) -> dict[str, Lookup]:
        """Each slot's answer to one call: ``role``'s override where its config fits (`apply`), else the look-up
        (`collective_matmul.client.sources.Sources.answer`), once per ``call`` and slot of ``record``."""
        applied, skipped = self.apply(role, hardware, problems, notes, record.matched) if role else ({}, set())
        found = {}
        for slot, problem in problems.items():
            if slot in applied:
                found[slot] = applied[slot]
                continue
            answer = record.answer((slot, *call), problem, partial(self.sources.answer, slot, problem, hardware))
            found[slot] = replace(answer, origin=f"{answer.origin} (the override did not fit)") if slot in skipped \
                else answer
        for slot, (decomposition, why) in whole_op({s: f.decomposition for s, f in found.items()}).items():
            found[slot] = replace(found[slot], decomposition=decomposition,
                                  note=f"{found[slot].note}; {why}" if found[slot].note else why)
        return found

    def unmatched(self, hardware_keys: Iterable[str], matched: set[tuple[str, str]]) -> list[str]:
        """The roles of the overrides fetched for ``hardware_keys`` that are not in ``matched``."""
        return sorted(role for key in hardware_keys for role in self._known.get(key, {}) if (key, role) not in matched)
