"""Warm start: a new study's first candidates, from the problems already tuned on the same hardware.

A study of a new problem times the baseline, then its *seeds*: the winners and best rings of its
nearest tuned neighbours (same collective, dtype and ring size on the same hardware, nearest in
log-distance over (m, k, n) as `collective_matmul.wire.bundle.nearest`), then searches as before
(`cmtune.tuner.search`).  The seeds are computed once, where the study is created (the service's
submission from its stored configs, `cmtune tune` from its own run and its bundle), and stored
with the study's settings: every replica and every process reads the same seeds in the same order.
The stop rule that lets a seeded study stop early is `cmtune.tuner.search.neighbours_agree`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from cmtune.tuner.store import TrialRecord
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Hardware, Problem, log_distance, resolved_accumulate
from collective_matmul.planning.space import candidates
from collective_matmul.wire import Seed, Status, TrialKind, TrialState
from collective_matmul.wire.bundle import TunedConfig

NEIGHBOURS = 3  # tuned problems a new study is seeded from
_SOURCES = ("local", "study", "bundle")  # for the same neighbour: this run's measurement first


@dataclass(frozen=True)
class Known:
    """A tuned problem as a warm start reads it: its config, the fastest ring of its search (None where
    its trials are not known, as in a bundle), and where it came from."""

    config: TunedConfig
    best_ring: Decomposition | None = None
    best_ring_ratio: float | None = None
    source: Literal["study", "bundle", "local"] = "study"
    study_id: int | None = None


def neighbour_order(problem: Problem, known: Known) -> tuple:
    """How the tuned neighbours of ``problem`` rank: nearest first, then by key and source, so that any
    order of ``known`` gives the same seeds.  This is the one place a neighbour measured on the same
    software stack would go first: put that test in front of the distance once a config carries its
    stack."""
    return (log_distance(problem, known.config.problem), known.config.problem.key,
            _SOURCES.index(known.source), known.study_id or 0)


def nearest_keys(problem: Problem, shapes: Iterable[tuple[str, int, int, int]]) -> list[str]:
    """The keys of ``shapes`` ((key, m, k, n) of tuned problems of ``problem``'s family), nearest first as
    `neighbour_order` ranks them: `seeds` over the configs of a prefix of them is `seeds` over them all once
    the prefix holds ``neighbours`` that fit, so a store reads only as many configs as it needs."""
    def distance(shape: tuple[str, int, int, int]) -> tuple[float, str]:
        key, *mkn = shape
        return sum(abs(math.log(a / b)) for a, b in zip((problem.m, problem.k, problem.n), mkn, strict=True)), key

    return [shape[0] for shape in sorted(shapes, key=distance)]


def seeds(problem: Problem, hardware: Hardware, known: Iterable[Known], *, neighbours: int = NEIGHBOURS,
          ) -> tuple[Seed, ...]:
    """The seeds of a new study of ``problem`` on ``hardware``.

    Args:
        known: tuned problems, of any hardware and collective (the others are left out); ``problem`` itself,
            tuned before (a forced new study), is its own nearest neighbour.
        neighbours: how many of the nearest tuned problems seed it; one tuned on several sources or
            stacks counts once (the first in `neighbour_order`), and one none of whose configs fits
            ``problem`` does not count.

    Returns:
        per neighbour, nearest first: its winner, then its best ring if that differs; each a candidate of
        ``problem`` (a decomposition that does not fit it, such as a chunking that does not divide its
        blocks, is left out), each decomposition once (where the nearest neighbour put it).  A baseline
        winner is kept, to say so; the search times the baseline first in any case.
    """
    return _seeds(problem, hardware, known, neighbours)[0]


def nearest_seeds(problem: Problem, hardware: Hardware, shapes: Iterable[tuple[str, int, int, int]],
                  configs: Callable[[Sequence[str]], list[Known]], *, neighbours: int = NEIGHBOURS,
                  batch: int = 2 * NEIGHBOURS) -> tuple[Seed, ...]:
    """`seeds` from a store that holds many tuned problems: ``shapes`` are their (key, m, k, n), and
    ``configs(keys)`` reads the configs of those problems; they are read nearest first, ``batch`` problems at
    a time, until ``neighbours`` of them fit (the same seeds as `seeds` over every config)."""
    order, known, found = nearest_keys(problem, shapes), [], ()
    for start in range(0, len(order), batch):
        known += configs(order[start:start + batch])
        found, counted = _seeds(problem, hardware, known, neighbours)
        if counted >= neighbours:
            break
    return found


def _seeds(problem: Problem, hardware: Hardware, known: Iterable[Known], neighbours: int,
           ) -> tuple[tuple[Seed, ...], int]:
    """`seeds`, and how many neighbours gave them."""
    family = (problem.collective, problem.dtype, problem.axis_size)
    space, hardware_key = set(candidates(problem)), hardware.identity().key
    near = sorted((k for k in known if k.config.hardware.identity().key == hardware_key
                   and (k.config.problem.collective, k.config.problem.dtype, k.config.problem.axis_size) == family),
                  key=lambda k: neighbour_order(problem, k))
    found: dict[Decomposition, Seed] = {}
    counted: set[str] = set()
    for k in near:
        key = k.config.problem.key
        if key in counted:
            continue
        winner = _explicit(k.config.decomposition, problem)
        offered = [(winner, "winner", 1 / k.config.speedup)]
        if k.best_ring is not None and k.best_ring_ratio is not None and _explicit(k.best_ring, problem) != winner:
            offered.append((_explicit(k.best_ring, problem), "best ring", k.best_ring_ratio))
        fitting = [o for o in offered if o[0] in space]
        if not fitting:
            continue
        counted.add(key)
        distance = log_distance(problem, k.config.problem)
        for decomposition, kind, ratio in fitting:
            found.setdefault(decomposition, Seed(
                decomposition=decomposition, kind=kind, neighbour=key, source=k.source,
                study_id=k.study_id if k.source == "study" else None, ratio=ratio, distance=distance))
        if len(counted) >= neighbours:
            break
    return tuple(found.values()), len(counted)


def _explicit(config: Decomposition, problem: Problem) -> Decomposition:
    """``config`` with its accumulate mode spelt out, as the candidates of ``problem`` are (a bundle's may
    leave it to the collective's default)."""
    if config.method != "ring" or config.accumulate is not None:
        return config
    return config.model_copy(update={"accumulate": resolved_accumulate(config, collective=problem.collective,
                                                                       dtype=problem.dtype)})


def best_ring(trials: Sequence[TrialRecord]) -> tuple[Decomposition, float] | None:
    """The fastest ring among a study's finished search trials, and its ratio (the first of equals)."""
    ok = [t for t in trials if t.kind == TrialKind.SEARCH and t.state == TrialState.COMPLETED
          and t.status == Status.OK and t.ratio is not None and t.decomposition.method == "ring"]
    if not ok:
        return None
    top = min(ok, key=lambda t: (t.ratio, t.number))
    return top.decomposition, top.ratio
