"""A predicted time for a compiled program: its schedule replayed, a cost for every instruction.

A scheduled module (``is_scheduled=true``: ``Compiled.as_text()``) lists each computation's instructions in the
order they run.  The replay walks the entry computation in that order on one clock:

- an instruction that runs in place adds its cost (`collective_matmul.programs.costs.Pricer`);
- an asynchronous start (``all-gather-start``, ``collective-permute-start``, ``async-start`` around a
  reduce-scatter, TPU's ``copy-start`` / ``slice-start`` DMAs, ...) sets its transfer going at the current time;
  its done waits until the transfer's end, so whatever is scheduled between them hides the transfer.  A start XLA
  marks ``"is_sync":true`` runs in place.  Transfers in flight at once do not slow one another (not modelled);
- a ``while`` costs its trip count (`collective_matmul.programs.hlo.Module.trip_count`) times its body and
  condition; a ``call`` its computation; a ``conditional`` its dearest branch;
- a kernel the schedule cannot see into (a custom call that is no GEMM) is said to be unpriced.

The result (`Prediction`) splits the time into communication (all of it, and the part nothing hid) and compute.
Every figure is a prediction of the named cost model, never a measurement.  Pure text and numbers: no JAX.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from collective_matmul.planning.costmodel import HardwareProfile
from collective_matmul.programs.costs import Pricer
from collective_matmul.programs.hlo import Computation, Module, parse_module
from collective_matmul.programs.products import called

MODEL = "cmtune-roofline"


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A compiled program's predicted time on a hardware profile (seconds; predicted, never measured)."""

    seconds: float
    exposed_comm_s: float  # communication nothing hid: the clock waited on it
    comm_s: float  # every transfer's cost, hidden or not
    compute_s: float  # products and memory-bound instructions on the clock
    cost_model: str  # e.g. "cmtune-roofline/h100-nvlink"
    unpriced: tuple[str, ...] = ()  # instructions priced at nothing: kernels the schedule cannot see into

    @property
    def overlapped_share(self) -> float | None:
        """The share of the communication that overlapped other work (None: no communication); not the bounds' hidden
        fraction, which compares a tuned time with its baseline and bound (`collective_matmul.wire.bounds`)."""
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s > 0 else None

    def summary(self) -> str:
        hidden = self.overlapped_share
        text = (f"predicted {self.seconds * 1e6:,.1f} µs ({self.cost_model}): compute {self.compute_s * 1e6:,.1f} µs, "
                f"communication {self.comm_s * 1e6:,.1f} µs")
        if hidden is not None:
            text += f", {hidden:.0%} of it overlapped"
        if self.unpriced:
            text += f"; unpriced: {', '.join(self.unpriced[:4])}" + (" ..." if len(self.unpriced) > 4 else "")
        return text


@dataclass
class _Tally:
    seconds: float = 0.0
    exposed: float = 0.0
    comm: float = 0.0
    compute: float = 0.0
    unpriced: list[str] = field(default_factory=list)

    def wait(self, clock: float, end: float, is_comm: bool) -> float:
        """The clock after waiting for a transfer that ends at ``end``: the wait is exposed communication, or
        compute (a copy's DMA)."""
        wait = max(0.0, end - clock)
        if is_comm:
            self.exposed += wait
        else:
            self.compute += wait
        return clock + wait

    def add(self, other: _Tally, times: float) -> None:
        self.seconds += other.seconds * times
        self.exposed += other.exposed * times
        self.comm += other.comm * times
        self.compute += other.compute * times
        self.unpriced += [u for u in other.unpriced if u not in self.unpriced]


def predict(module: Module | str, profile: HardwareProfile, *, serial: bool = False) -> Prediction:
    """The predicted time of one execution of the scheduled ``module`` on ``profile`` (``serial``: every
    asynchronous start run in place, the same schedule with nothing overlapped)."""
    if isinstance(module, str):
        module = parse_module(module)
    replay = _Replay(module, Pricer(module, profile), serial)
    tally = replay.computation(module.entry)
    return Prediction(seconds=tally.seconds, exposed_comm_s=tally.exposed, comm_s=tally.comm,
                      compute_s=tally.compute, cost_model=f"{MODEL}/{profile.name}", unpriced=tuple(tally.unpriced))


class _Replay:
    def __init__(self, module: Module, pricer: Pricer, serial: bool):
        self.module, self.pricer, self.serial = module, pricer, serial
        self.memo: dict[str, _Tally] = {}

    def computation(self, comp: Computation, depth: int = 0) -> _Tally:
        if comp.name in self.memo:
            return self.memo[comp.name]
        tally = _Tally()
        clock = 0.0
        pending: dict[str, tuple[float, bool]] = {}  # start -> (when its transfer ends, is it communication)
        for inst in comp.instructions.values():
            op = inst.opcode
            if op == "while" or op == "call" or op == "conditional":
                inner = self._called(inst, depth)
                tally.add(inner, 1)
                clock += inner.seconds
                continue
            if op.endswith("-done"):
                start = inst.operands[0] if inst.operands else ""
                if start in pending:
                    clock = tally.wait(clock, *pending.pop(start))
                continue
            cost = self.pricer.instruction(comp, inst)
            if cost.kind == "unpriced":
                tally.unpriced.append(f"{op} {inst.name}" + _target(inst.attributes))
                continue
            is_comm = cost.kind == "comm"
            tally.comm += cost.seconds if is_comm else 0.0
            if op.endswith("-start") and not self.serial and not _is_sync(inst.attributes):
                pending[inst.name] = (clock + cost.seconds, is_comm)
                continue
            clock += cost.seconds
            if is_comm:
                tally.exposed += cost.seconds
            else:
                tally.compute += cost.seconds
        for end, is_comm in pending.values():  # a transfer never waited for here: the computation ends after it
            clock = tally.wait(clock, end, is_comm)
        tally.seconds = clock
        self.memo[comp.name] = tally
        return tally

    def _called(self, inst, depth: int) -> _Tally:
        module, out = self.module, _Tally()
        if depth > 32:
            return out
        if inst.opcode == "while":
            body = module.computations.get(inst.attribute("body") or "")
            cond = module.computations.get(inst.attribute("condition") or "")
            trips = module.trip_count(inst)
            if trips is None:
                out.unpriced.append(f"while {inst.name} (trip count unknown: one trip priced)")
            runs = trips if trips is not None else 1
            for comp, times in ((body, runs), (cond, runs + 1)):
                if comp is not None:
                    out.add(self.computation(comp, depth + 1), times)
            return out
        if inst.opcode == "call":
            target = inst.attribute("to_apply") or next(iter(called(inst)), "")
            comp = module.computations.get(target)
            return self.computation(comp, depth + 1) if comp is not None else out
        branches = [module.computations[n] for n in _branches(inst) if n in module.computations]
        tallies = [self.computation(b, depth + 1) for b in branches]
        return max(tallies, key=lambda t: t.seconds, default=out)


def _is_sync(attributes: str) -> bool:
    """A start XLA's GPU compiler runs on the compute stream (``"is_sync":true``): nothing hides it."""
    return '"is_sync":true' in attributes.replace(" ", "")


def _target(attributes: str) -> str:
    match = re.search(r'custom_call_target="([^"]*)"', attributes)
    return f" ({match.group(1)})" if match else ""


def _branches(inst) -> list[str]:
    """A conditional's branches: ``branch_computations={...}``, or its true and false computations."""
    found = re.search(r"branch_computations=\{([^}]*)\}", inst.attributes)
    if found:
        return [n.strip().lstrip("%") for n in found.group(1).split(",") if n.strip()]
    return [n for n in (inst.attribute("true_computation"), inst.attribute("false_computation")) if n]
