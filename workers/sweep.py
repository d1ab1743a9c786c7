"""Exhaustive sweep: measure every valid candidate of a problem against the baseline."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from cmtune.workers.measure import OpSession
from collective_matmul import Decomposition, Problem
from collective_matmul.planning.space import candidates
from collective_matmul.wire import Measurement, MeasurementProtocol


def sweep(
    problem: Problem,
    *,
    protocol: MeasurementProtocol = MeasurementProtocol(),
    configs: Iterable[Decomposition] | None = None,
    on_result: Callable[[Measurement], None] | None = None,
    session: OpSession | None = None,
) -> list[Measurement]:
    """Measure ``configs`` (default: the whole space) of ``problem`` in one `OpSession` (``session``: this one,
    whose `OpSession.bounds` the caller may time too)."""
    session = session or OpSession(problem, protocol=protocol)
    results = []
    for config in configs if configs is not None else candidates(problem):
        result = session.measure(config)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
