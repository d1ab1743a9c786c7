"""The tally of a scan: the forward problems of each role, the skipped collectives, the backward's evidence."""

from __future__ import annotations

from dataclasses import dataclass, field

from collective_matmul.programs.hlo import Instruction, Module


@dataclass
class Seen:
    """A forward problem of one role: its slots' problems, how often a step runs it, its mesh axis and source."""

    slots: dict
    count: int
    axis: str | None
    source: str


@dataclass
class Tally:
    """What a scan has seen so far, per role."""

    problems: dict[tuple, Seen] = field(default_factory=dict)  # (role, forward problem key) -> what was seen
    skipped: dict[tuple, int] = field(default_factory=dict)
    backward: dict[str, set[str]] = field(default_factory=dict)  # role -> slots its backward computes
    weights: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)  # role -> forward weight shapes
    gathers: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (computation, all-gather) -> roles

    def skip(self, role: str, what: str, reason: str, times: int) -> None:
        """Count a collective not decomposed, ``times`` per step, under its role and reason."""
        key = (role, what, reason)
        self.skipped[key] = self.skipped.get(key, 0) + times

    def found(self, role: str, slots: dict, times: int, axis: str | None, source: str) -> None:
        """Count a forward collective matmul of ``role`` (its slots' problems), ``times`` per step."""
        key = (role, slots["forward"].key)
        if key in self.problems:
            self.problems[key].count += times
        else:
            self.problems[key] = Seen(slots, times, axis, source)

    def read(self, role: str, module: Module, computation: str, gather: Instruction) -> None:
        """``role`` reads the activation ``gather`` gathers (one all-gather, or several of one value before XLA
        merges them): the readers of one are a group."""
        readers = self.gathers.setdefault((computation, gather.operands, gather.ints("dimensions"),
                                           tuple(gather.replica_groups(module.num_partitions) or ())), [])
        if role not in readers:
            readers.append(role)
