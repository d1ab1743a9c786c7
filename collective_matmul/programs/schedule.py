"""The overlap a compiled program can have, read from its schedule: does compute sit between each permute's
start and done?

A ring hides each transfer behind a partial matmul only if the compiler schedules that matmul while the
transfer is in flight.  On backends with asynchronous collectives (TPU, GPU), a scheduled module
(``is_scheduled=true``: ``Compiled.as_text()``) lists each computation's instructions in the order they run,
and a ``collective-permute-start`` / ``-done`` pair brackets whatever runs meanwhile: a product (a dot, a
convolution that is a matmul, a fusion around one) there is compute the transfer hides behind; none means
the permute is serialised behind the work around it, a ring that cannot win on that hardware, whatever
the clock says.  A backend that runs a permute in place (``collective-permute`` without start and done, as
XLA's CPU backend does) overlaps nothing.  Pure text: no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

from collective_matmul.programs.hlo import Module, parse_module
from collective_matmul.programs.products import is_product
from collective_matmul.wire.bounds import OverlapVerdict


@dataclass(frozen=True)
class PermuteWindow:
    """One asynchronous permute: its start and done, and the products scheduled between them."""

    computation: str
    start: str
    done: str
    products: tuple[str, ...]

    @property
    def hidden(self) -> bool:
        return bool(self.products)


@dataclass(frozen=True)
class Overlap:
    """The permutes of a compiled program and what runs while each is in flight."""

    windows: tuple[PermuteWindow, ...]
    synchronous: int  # permutes run in place (no start and done): nothing overlaps them

    @property
    def verdict(self) -> OverlapVerdict:
        """``overlaps`` (every asynchronous permute brackets a product), ``partly``, ``serialised`` (none does),
        ``synchronous`` (the backend runs its permutes in place) or ``no permutes``."""
        if not self.windows:
            return "synchronous" if self.synchronous else "no permutes"
        hidden = sum(w.hidden for w in self.windows)
        if hidden == len(self.windows) and not self.synchronous:
            return "overlaps"
        return "partly" if hidden else "serialised"

    @property
    def overlaps(self) -> bool | None:
        """True if every permute can hide behind a product, False if one cannot; None without permutes."""
        verdict = self.verdict
        return None if verdict == "no permutes" else verdict == "overlaps"

    def summary(self) -> str:
        hidden = sum(w.hidden for w in self.windows)
        if self.verdict == "no permutes":
            return "no collective-permute: nothing to overlap"
        if self.verdict == "synchronous":
            return (f"{self.synchronous} collective-permutes run in place (synchronous: the backend has no "
                    "asynchronous permute, or its compiler left nothing to run beside them): nothing overlaps them")
        text = f"{hidden} of {len(self.windows)} permutes have a product scheduled while in flight"
        if self.synchronous:
            text += f"; {self.synchronous} more run in place"
        return text


def overlap(module: Module | str) -> Overlap:
    """Read the permutes of a scheduled module (`Compiled.as_text()`) and what runs while each is in flight."""
    if isinstance(module, str):
        module = parse_module(module)
    windows, synchronous = [], 0
    for comp in module.computations.values():
        order = list(comp.instructions.values())
        position = {inst.name: i for i, inst in enumerate(order)}
        for i, inst in enumerate(order):
            if inst.opcode == "collective-permute":
                synchronous += 1
                continue
            if inst.opcode != "collective-permute-start":
                continue
            done = next((u for u in comp.users.get(inst.name, ()) if u.opcode == "collective-permute-done"), None)
            if done is None:
                continue
            between = order[i + 1:position[done.name]]
            products = tuple(p.name for p in between if is_product(module, p))
            windows.append(PermuteWindow(comp.name, inst.name, done.name, products))
    return Overlap(tuple(windows), synchronous)
