"""Config look-up with the fallback order of DESIGN.md: exact, nearest, model, baseline.

Tuned configs of a hardware are cached per replica for ``config_cache_seconds`` (writes from
this replica clear the cache at once; other replicas see them within that time).
"""

from __future__ import annotations

import math
import threading
import time

from collective_matmul import Decomposition, Hardware, Problem, candidates
from collective_matmul.bundle import TunedConfig
from collective_matmul.costmodel import profile_for, rank
from service import repository as repo
from service.db import Database
from service.schemas import ConfigAnswer


def _distance(a: Problem, b: Problem) -> float:
    return sum(abs(math.log(getattr(a, f) / getattr(b, f))) for f in ("m", "k", "n"))


def model_choice(problem: Problem, hardware: Hardware) -> Decomposition | None:
    """The cost model's favourite for ``problem`` on ``hardware``'s published profile (None if unknown)."""
    profile = profile_for(hardware)
    return rank(problem, candidates(problem), profile)[0] if profile is not None else None


def answer(problem: Problem, hardware: Hardware, tuned: dict[str, TunedConfig]) -> ConfigAnswer:
    """Pick from ``tuned`` (problem key -> config, one hardware) in the fallback order."""
    exact = tuned.get(problem.key)
    if exact is not None:
        return _from_tuned(problem, hardware, exact, "exact")
    near = [
        c for c in tuned.values()
        if (c.problem.collective, c.problem.dtype, c.problem.axis_size)
        == (problem.collective, problem.dtype, problem.axis_size) and _valid(problem, c.decomposition)
    ]
    if near:
        best = min(near, key=lambda c: (_distance(problem, c.problem), c.problem.key))
        return _from_tuned(problem, hardware, best, "nearest")
    choice = model_choice(problem, hardware)
    if choice is not None:
        return ConfigAnswer(problem=problem, hardware=hardware, decomposition=choice, match="model")
    return ConfigAnswer(problem=problem, hardware=hardware, decomposition=Decomposition.baseline(), match="baseline")


def _valid(problem: Problem, config: Decomposition) -> bool:
    try:
        problem.check(config)
    except ValueError:
        return False
    return True


def _from_tuned(problem: Problem, hardware: Hardware, config: TunedConfig, match: str) -> ConfigAnswer:
    return ConfigAnswer(
        problem=problem, hardware=hardware, decomposition=config.decomposition, match=match,
        time_s=config.time_s if match == "exact" else None,
        baseline_s=config.baseline_s if match == "exact" else None,
        speedup=config.speedup if match == "exact" else None,
        source_problem=config.problem if match == "nearest" else None,
        software={"jax": config.jax_version, "jaxlib": config.jaxlib_version},
    )


class ConfigCache:
    """Tuned configs per hardware key, reloaded after ``ttl_s``."""

    def __init__(self, db: Database, ttl_s: float):
        self.db, self.ttl_s = db, ttl_s
        self._entries: dict[str, tuple[float, dict[str, TunedConfig]]] = {}
        self._lock = threading.Lock()

    def tuned_for(self, hardware: Hardware) -> dict[str, TunedConfig]:
        key = hardware.identity().key
        now = time.monotonic()
        entry = self._entries.get(key)
        if entry is not None and now - entry[0] < self.ttl_s:
            return entry[1]
        with self.db.session() as session:
            rows = repo.list_tuned(session=session, hardware_key=key)
            configs = {row.problem.key: repo.to_tuned_config(row) for row in rows}
        with self._lock:
            self._entries[key] = (now, configs)
        return configs

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def lookup(self, problem: Problem, hardware: Hardware) -> ConfigAnswer:
        return answer(problem, hardware.identity(), self.tuned_for(hardware))
