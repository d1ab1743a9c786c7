"""Config look-up in the stated order (`collective_matmul.wire.lookup`): exact, stale, nearest, then the baseline (or
the cost model's choice, where the caller asks for it).

Tuned configs of a hardware (every stack's) are cached per replica for ``config_cache_seconds`` (writes
from this replica clear the cache at once; other replicas see them within that time).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fastapi.concurrency import run_in_threadpool

from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import ConfigAnswer
from collective_matmul.wire.bundle import TunedConfig
from collective_matmul.wire.lookup import Unmeasured, by_problem, from_tuned, stack_note, untuned

if TYPE_CHECKING:
    from cmtune.service.store import SqlStore


def answer(problem: Problem, hardware: Hardware, tuned: Mapping[str, Sequence[TunedConfig]],
           software: Software | None = None, unmeasured: Unmeasured = "baseline") -> ConfigAnswer:
    """Pick from ``tuned`` (one hardware's configs, `collective_matmul.wire.lookup.by_problem`) in the look-up order
    (`collective_matmul.wire.lookup`) for a caller on ``software`` (None: it named no stack); where nothing measured
    answers, what ``unmeasured`` says (`collective_matmul.wire.lookup.untuned`), its ``reason`` saying why."""
    found = from_tuned(problem, tuned, software)
    if found is not None:
        return _from_tuned(problem, hardware, found[1], found[0], software)
    match, decomposition, reason = untuned(problem, hardware, unmeasured)
    return _answer(problem, hardware, decomposition, match, reason=reason)


def _answer(problem: Problem, hardware: Hardware, decomposition: Decomposition, match: str, **extra) -> ConfigAnswer:
    return ConfigAnswer(problem=problem, problem_key=problem.key, hardware=hardware, decomposition=decomposition,
                        decomposition_id=decomposition.id, match=match, **extra)


def _from_tuned(problem: Problem, hardware: Hardware, config: TunedConfig, match: str,
                software: Software | None) -> ConfigAnswer:
    measured = match in ("exact", "stale")  # this problem's own times (a stale one's on the stack that measured it)
    return _answer(
        problem, hardware, config.decomposition, match,
        time_s=config.time_s if measured else None,
        baseline_s=config.baseline_s if measured else None,
        speedup=config.speedup if measured else None,
        source_problem=config.problem if match == "nearest" else None,
        software=config.software, note=stack_note(match, config, software),
        **(bounds_fields(config) if measured else {}),
    )


def bounds_fields(config: TunedConfig) -> dict:
    """A tuned config's bounds as the public bodies spell them (`ConfigAnswer`, `SubmissionEntry`)."""
    return dict(compute_s=config.compute_s, communication_s=config.communication_s,
                bounds_baseline_s=config.bounds_baseline_s, bound_s=config.bound_s,
                hidden_fraction=config.hidden_fraction, reason=config.reason)


MAX_HARDWARE = 1_000  # hardware keys whose configs a replica keeps
MAX_ANSWERS = 10_000  # memoised answers: unique look-ups must not grow memory without bound


class ConfigCache:
    """Tuned configs per hardware key, reloaded after ``ttl_s``; serialised answers memoised with them.

    Both maps are bounded (`MAX_HARDWARE`, `MAX_ANSWERS`): past the bound the oldest entries go; a
    key's loading lock lives only while its first load is in progress.
    """

    def __init__(self, store: SqlStore, ttl_s: float):
        self.store, self.ttl_s = store, ttl_s
        self._entries: dict[str, tuple[float, dict[str, list[TunedConfig]]]] = {}
        self._answers: dict[tuple[str, str, str, str], tuple[float, bytes]] = {}
        self._lock = threading.Lock()
        self._refreshing: set[str] = set()
        self._loading: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()

    async def ensure(self, hardware: Hardware) -> None:
        """Have the hardware's configs cached, reading the database off the event loop.

        Stale entries are served while one background task reloads them (no stampede when many
        requests see the same entry expire); a missing entry is loaded once while its requests wait.
        """
        key = hardware.identity().key
        if self.is_fresh(hardware):
            return
        if key in self._entries:
            if key not in self._refreshing:
                self._refreshing.add(key)
                task = asyncio.get_running_loop().create_task(self._reload(hardware, key))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return
        lock = self._loading.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                if key not in self._entries:
                    await run_in_threadpool(self.tuned_for, hardware)
        finally:  # loaded (or failed): the next miss of this key takes a new lock, so the map stays small
            if self._loading.get(key) is lock and not lock.locked():
                del self._loading[key]

    async def _reload(self, hardware: Hardware, key: str) -> None:
        try:
            await run_in_threadpool(self.tuned_for, hardware)
        finally:
            self._refreshing.discard(key)

    def is_fresh(self, hardware: Hardware) -> bool:
        entry = self._entries.get(hardware.identity().key)
        return entry is not None and time.monotonic() - entry[0] < self.ttl_s

    def tuned_for(self, hardware: Hardware) -> dict[str, list[TunedConfig]]:
        key = hardware.identity().key
        now = time.monotonic()
        entry = self._entries.get(key)
        if entry is not None and now - entry[0] < self.ttl_s:
            return entry[1]
        with self.store.read() as tx:
            configs = by_problem(tx.catalog.list_tuned(hardware=key))
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = (now, configs)
            while len(self._entries) > MAX_HARDWARE:
                self._entries.pop(next(iter(self._entries)))
        return configs

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._answers.clear()

    def lookup_json(self, problem: Problem, hardware: Hardware, software: Software | None = None,
                    unmeasured: Unmeasured = "baseline") -> bytes:
        """`lookup` as JSON bytes, memoised as long as the hardware's configs are cached."""
        key = (problem.key, hardware.identity().key, software.key if software is not None else "", unmeasured)
        loaded_at = self._entries.get(key[1], (None,))[0]
        hit = self._answers.get(key)
        if hit is not None and hit[0] == loaded_at:
            return hit[1]
        body = self.lookup(problem, hardware, software, unmeasured).model_dump_json().encode()
        loaded_at = self._entries.get(key[1], (None,))[0]
        if loaded_at is not None:
            with self._lock:
                self._answers[key] = (loaded_at, body)
                while len(self._answers) > MAX_ANSWERS:
                    self._answers.pop(next(iter(self._answers)))
        return body

    def lookup(self, problem: Problem, hardware: Hardware, software: Software | None = None,
               unmeasured: Unmeasured = "baseline") -> ConfigAnswer:
        """Answer a caller on ``software`` from the cached configs (loading them if absent; an entry past its time
        is used as it is), as `answer` does."""
        entry = self._entries.get(hardware.identity().key)
        configs = entry[1] if entry is not None else self.tuned_for(hardware)
        return answer(problem, hardware.identity(), configs, software, unmeasured)
