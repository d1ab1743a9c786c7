"""Which block of a gathering ring each device uses at each step, as records: pure Python, no JAX.

`collective_matmul.ops.ring` runs this schedule for the rings that move the blocks of a gathered operand (the
all-gather matmul, the weight gradient); the records say only where blocks are, never what is computed with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from collective_matmul.planning.problem import ring_hops


@dataclass(frozen=True, kw_only=True)
class Stream:
    """One stream of blocks round the ring, making ``hops`` hops.

    ``sign=+1``: every device sends to ``i-1`` (receives from ``i+1``), so at step ``t`` device ``i`` holds block
    ``i+t``; ``sign=-1``: every device sends to ``i+1`` and holds block ``i-t``.
    """

    sign: int
    hops: int


@dataclass(frozen=True, kw_only=True)
class Arrival:
    """Device ``i`` uses block ``i + offset`` at ``step``, the block stream ``stream`` holds then."""

    step: int
    stream: int
    offset: int


@dataclass(frozen=True, kw_only=True)
class RingSchedule:
    """The steps of one gathering ring of ``size`` devices.

    1. Every stream starts at step 0 holding the device's own block (block ``i``), used once, at step 0.
    2. At each step, first the streams that make another hop send the block they hold (it is used at the next
       step), then the blocks held are used, stream by stream.
    3. Stream ``j`` uses block ``i + sign * t`` at every step ``t`` in ``1..hops``; the streams' blocks together
       are every block once.
    4. Over `loop`'s steps every stream sends and uses its block, so one loop body serves them all.
    """

    size: int
    streams: tuple[Stream, ...]

    @classmethod
    def of(cls, direction: str, size: int) -> RingSchedule:
        """The schedule of a ring of ``size`` devices going ``direction`` (``unidirectional``: one stream)."""
        first, second = ring_hops(direction, size)
        streams = (Stream(sign=1, hops=first),)
        if direction != "unidirectional":
            streams += (Stream(sign=-1, hops=second),)
        return cls(size=size, streams=streams)

    @property
    def steps(self) -> int:
        """Steps from the first use to the last (step 0 included)."""
        return 1 + max(stream.hops for stream in self.streams)

    @property
    def loop(self) -> tuple[int, int]:
        """The steps ``[lower, upper)`` at which every stream sends and uses a block of its own."""
        lower = 0 if len(self.streams) == 1 else 1
        return lower, min(stream.hops for stream in self.streams)

    @property
    def first(self) -> int:
        """The offset of the first block in row order (``-hops`` of the stream going down the blocks)."""
        return min(min(0, stream.sign * stream.hops) for stream in self.streams)

    def sends(self, step: int) -> tuple[int, ...]:
        """The streams that pass their block on at ``step``, before the blocks held are used."""
        return tuple(j for j, stream in enumerate(self.streams) if step < stream.hops)

    def arrivals(self, step: int) -> tuple[Arrival, ...]:
        """The blocks used at ``step``, stream by stream (the own block, at step 0, once)."""
        if step == 0:
            return (Arrival(step=0, stream=0, offset=0),)
        return tuple(
            Arrival(step=step, stream=j, offset=stream.sign * step)
            for j, stream in enumerate(self.streams)
            if step <= stream.hops
        )
