"""The look-up order, in one place: what answers a problem on one hardware, and how it says so.

1. ``override``: the model's per-role decision from its step measurement (`Tuned`, for a call
   with a role);
2. ``exact``: the tuned config of this problem and hardware;
3. ``nearest``: the tuned problem of the same collective, dtype and ring size closest in
   log-distance over (m, k, n) whose decomposition is valid here (`collective_matmul.bundle.nearest`);
4. ``model``: the cost model's favourite on the hardware's published profile;
5. ``baseline``: no profile for the platform.

The service answers 2-5 from its tuned configs (`cmtune.service.lookup`); `Tuned` answers 1, then
2-3 from the server and its bundle, then 4-5, with the same functions.  A weight gradient runs
what `weight_gradient` makes of its answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from collective_matmul.bundle import TunedConfig, nearest
from collective_matmul.decomposition import DEFAULT_GRAD_WEIGHT, Decomposition
from collective_matmul.problem import Hardware, Problem

Match = Literal["exact", "nearest", "model", "baseline"]  # what a config look-up answers with (2-5)
MATCHES: tuple[str, ...] = ("override", "exact", "nearest", "model", "baseline")  # the order, first wins
MEASURED = ("override", "exact", "nearest")  # answers that come from a measurement


def from_tuned(problem: Problem, configs: Mapping[str, TunedConfig]) -> tuple[Match, TunedConfig] | None:
    """The ``exact`` config of ``problem`` among ``configs`` (of one hardware, by problem key), else the
    ``nearest``; None if neither."""
    exact = configs.get(problem.key)
    if exact is not None:
        return "exact", exact
    close = nearest(problem, configs.values())
    return ("nearest", close) if close is not None else None


def untuned(problem: Problem, hardware: Hardware) -> tuple[Match, Decomposition]:
    """What answers when nothing tuned does: the cost model's choice, else the baseline."""
    from collective_matmul.costmodel import model_choice

    choice = model_choice(problem, hardware)
    return ("model", choice) if choice is not None else ("baseline", Decomposition.baseline())


def weight_gradient(decomposition: Decomposition | None, match: str | None = "exact") -> Decomposition:
    """The config a weight gradient runs, from its look-up's answer: a ring only where one was measured
    to win (``decomposition`` from a measured ``match``); otherwise, and where the measured winner is the
    baseline, the fused baseline (what autodiff of the baseline does: no second gather).  The cost model
    does not know `fuse`, so its choice is not taken here."""
    if decomposition is None or match not in MEASURED or decomposition == Decomposition.baseline():
        return DEFAULT_GRAD_WEIGHT
    return decomposition
