"""The step search's rounds across a process group: process 0 holds the search (`cmtune.tuner.stepsearch.StepSearch`)
and plans each round, every process times it, process 0 records it, until the grading round.

What a round's variants are timed on is the caller's (`measure`); the reference block's and a user's step alike
run here (`cmtune.workers.overrides.search_and_write_overrides`, bench/step.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from collective_matmul.wire import StepMeasurement


def run_step_search(search, measure: Callable[[dict], StepMeasurement], *, group=None,
                    say: Callable[[str], None] | None = None) -> tuple[StepMeasurement | None, list[StepMeasurement]]:
    """Run a step search (`cmtune.tuner.stepsearch.StepSearch`, held by process 0 alone) to its grading.

    Process 0 plans each round and shares it (`collective_matmul.wire.StepRound`); every process
    then times it with ``measure`` (name -> per-role configs, None for the step as written, to a
    `StepMeasurement`; every process must make the same calls), and process 0 records it.  The
    search's extra wall time is what its rounds after the first took here.

    Args:
        search: the search (on processes other than 0: None, or anything; it is not read there).
        measure: times one round's variants.
        group: the process group (`cmtune.workers.cluster.Group`; default: this process's).
        say: called on process 0 with one line per round.

    Returns:
        ``(grading, rounds)``: the grading round's measurement (None if the search failed; the tuner's choice
        is ``search.decide(grading)`` on process 0) and every search round's.
    """
    from cmtune.workers.cluster import Group
    from collective_matmul.wire import StepRound

    group = group or Group()
    say = say if group.leader and say is not None else (lambda _line: None)
    rounds: list[StepMeasurement] = []
    while True:
        message = None
        if group.leader:
            plan = search.plan()
            message = StepRound(kind="done" if plan.kind == "failed" else plan.kind, round=plan.round,
                                variants=plan.variants)
            if plan.kind != "search":
                say(f"the step search stops: {plan.reason}")
        message = group.share(message, StepRound)
        if message.kind == "done":
            return None, rounds
        started = time.monotonic()
        result = measure(message.variants)
        if message.kind == "grade":
            return result, rounds
        rounds.append(result)
        if group.leader:
            search.record(message.variants, result, wall_s=time.monotonic() - started)
            say(search.summary())
