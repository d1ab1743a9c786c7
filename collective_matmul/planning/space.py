"""The decomposition space of a problem: every valid candidate, baseline first."""

from __future__ import annotations

import functools
import itertools

from collective_matmul.planning.decomposition import (
    ALLGATHER_ACCUMULATE,
    CHUNK_CHOICES,
    REDUCE_SCATTER_ACCUMULATE,
    UNROLL_CHOICES,
    Decomposition,
)
from collective_matmul.planning.problem import Collective, Problem


def candidates(problem: Problem, *, include_baseline: bool = True, platform: str | None = None) -> list[Decomposition]:
    """Every valid decomposition of ``problem`` (explicit fields, no duplicates); on a ``platform`` whose XLA has a
    windowed einsum of its own (TPU, GPU: `collective_matmul.planning.xla_options`), XLA's own (``method="xla"``)
    right after the baseline, so that a ring is chosen only where it beats what XLA would do.

    ``fuse=True`` configs are not listed: fusion couples the input- and weight-gradient problems
    of one op, so it is chosen by measuring the training step, not within one problem's study.
    """
    found = list(_candidates(problem, include_baseline))
    if platform is not None:
        from collective_matmul.planning.xla_options import windowed_einsum

        if windowed_einsum(platform, "on") is not None:
            found.insert(1 if include_baseline else 0, Decomposition.xla())
    return found


@functools.lru_cache(maxsize=1024)
def _candidates(problem: Problem, include_baseline: bool) -> tuple[Decomposition, ...]:
    """`candidates`, computed once per problem (a study, its searcher and its settings each ask)."""
    accumulates = (
        ALLGATHER_ACCUMULATE if problem.dual.collective == Collective.ALLGATHER_MATMUL else REDUCE_SCATTER_ACCUMULATE
    )
    found = [Decomposition.baseline()] if include_baseline else []
    for direction, chunks, unroll, accumulate in itertools.product(
        ("unidirectional", "bidirectional"), CHUNK_CHOICES, UNROLL_CHOICES, accumulates
    ):
        config = Decomposition(direction=direction, chunks=chunks, unroll=unroll, accumulate=accumulate)
        try:
            problem.check(config)
        except ValueError:
            continue
        found.append(config)
    return tuple(found)


def has_ring(problem: Problem) -> bool:
    """Whether any ring decomposition fits ``problem`` (if none does, only the baseline can run)."""
    return len(_candidates(problem, False)) > 0


def no_ring_reason(problem: Problem) -> str:
    """Why no ring fits ``problem``: what the simplest ring's check says."""
    try:
        problem.check(Decomposition(direction="unidirectional", chunks=1, unroll="full"))
    except ValueError as exc:
        return str(exc)
    return "no chunking of the ring fits its blocks; use the baseline"
