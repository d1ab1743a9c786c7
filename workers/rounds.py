"""Timed rounds: the one timing loop of every measurement session (an op's candidate and baseline, a problem's
bounds, the variants of a whole step), and the agreement of a group of processes it rests on.

`time_rounds` warms the runs up, then times them round by round: a barrier before each sample (with several
processes), K calls back to back synchronised with `block_until_ready` after the last, the slowest process's
time counting.  Every process takes the same decisions in the same order (SPMD): K from the slowest process's
warm-up, the stop over the timeout agreed through `any_process`, each round's order a function of the seed and
the round alone (`round_order`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from collective_matmul.wire import MeasurementProtocol


@dataclass(frozen=True, kw_only=True)
class Rounds:
    """What `time_rounds` timed: per run, the per-call samples of the slowest process, one per round it ran."""

    samples: dict[str, list[float]]
    calls: int  # K, the calls of one sample
    done: int  # the rounds done
    repeats: int  # the rounds asked for
    timeout_s: float
    timed_out: bool  # the timeout stopped the rounds before the last
    failures: dict[str, Exception]  # the runs that raised and left the rotation (``keep_going``)

    @property
    def message(self) -> str:
        """What a record of these rounds says: why they stopped early ("" when they ran to the end)."""
        if not self.timed_out:
            return ""
        return f"stopped after {self.done} of {self.repeats} rounds: over {self.timeout_s:g}s"


def time_rounds(runs: Mapping[str, Callable[[], object]], *, started: float, protocol: MeasurementProtocol,
                calls: int | Callable[[float], int] = 1, shuffled: bool = False, keep_going: bool = False,
                say: Callable[[str], None] | None = None) -> Rounds:
    """Warm up (``protocol.warmup`` calls of each run), then ``protocol.repeats`` rounds, each run once a round.

    Every process of a group must call this together, with the same runs.

    Args:
        runs: name -> one call of a program (what it returns is waited for with `block_until_ready`).
        started: when the measurement began (`time.monotonic`): the rounds stop once every process has
            finished a round and one is over ``protocol.timeout_s`` since then (never after the last round: a run
            that completed every round is not a timeout).
        protocol: the warm-up, repeats, seed and timeout.
        calls: K, the calls of one sample; or a function choosing K from the slowest process's time of one call
            at the last warm-up (the slowest run's; K is 1 when nothing was warmed up): one K for every run, so
            that they pair.
        shuffled: each round in its own seeded order (`round_order`), not the order of ``runs``.
        keep_going: a run that raises leaves the rotation (its exception in ``failures``); otherwise it raises.
        say: called with a line before the warm-up and before the timed rounds.
    """
    import jax

    say = say or (lambda _line: None)
    running = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in running}
    failures: dict[str, Exception] = {}

    def sample(name: str, k: int, timed: bool) -> float | None:
        """K calls of one run back to back, from a barrier (timed) to `block_until_ready` of the last: seconds a
        call (None if it raised and ``keep_going``)."""
        run = runs[name]
        try:
            if timed:
                barrier()
            start = time.perf_counter()
            for _ in range(k - 1):
                run()
            jax.block_until_ready(run())
            return (time.perf_counter() - start) / k
        except Exception as exc:  # noqa: BLE001 - with keep_going, a failing run leaves the rotation
            if not keep_going:
                raise
            failures[name] = exc
            running.remove(name)
            return None

    say(f"warming up {len(running)} variants ({protocol.warmup} runs each)")
    warm: list[float] = []
    for i in range(protocol.warmup):
        for name in list(running):
            seconds = sample(name, 1, timed=False)
            if seconds is not None and i == protocol.warmup - 1:
                warm.append(seconds)
    if callable(calls):
        single = max(slowest_process(warm)) if warm else 0.0
        calls = calls(single) if single else 1
    say(f"timing {len(running)} variants, {protocol.repeats} rounds" + (", each in its own order" if shuffled else ""))
    done, timed_out = 0, False
    for number in range(protocol.repeats):
        for name in round_order(list(running), protocol.seed, number) if shuffled else list(running):
            seconds = sample(name, calls, timed=True)
            if seconds is not None:
                samples[name].append(seconds)
        done += 1
        # every process must agree to stop, or the SPMD programs would diverge
        if done < protocol.repeats and any_process(time.monotonic() - started > protocol.timeout_s):
            timed_out = True
            break
    return Rounds(samples={name: slowest_process(samples[name]) for name in runs}, calls=calls, done=done,
                  repeats=protocol.repeats, timeout_s=protocol.timeout_s, timed_out=timed_out, failures=failures)


def round_order(names: list[str], seed: int, number: int) -> list[str]:
    """``names`` in round ``number``'s order: a shuffle seeded by ``seed`` and ``number`` alone (the same on every
    process of a group, SPMD)."""
    order = list(names)
    random.Random(f"{seed}:{number}").shuffle(order)
    return order


# ---- the agreement of a group of processes -------------------------------------------------


def barrier() -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("cmtune-run")


def any_process(flag: bool) -> bool:
    """True if ``flag`` is true on any process (every process must call this together)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def slowest_process(samples: list[float]) -> list[float]:
    """Per run, the time of the slowest process (the run is done when all are)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return samples
    from jax.experimental import multihost_utils

    every = np.asarray(multihost_utils.process_allgather(np.asarray(samples)))
    return [float(v) for v in every.reshape(jax.process_count(), -1).max(axis=0)]
