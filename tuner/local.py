"""The local runner: times candidates on this process's devices (or its cluster's)."""

from __future__ import annotations

from collections.abc import Sequence

from collective_matmul import Decomposition, Problem
from tuner.measure import Measurement, Protocol, Session, any_process


class LocalRunner:
    """Keeps one `Session` (inputs, compiled baseline) per problem and seed."""

    def __init__(self, **session_kwargs):
        self._sessions: dict[tuple[str, int], Session] = {}
        self._session_kwargs = session_kwargs

    def session(self, problem: Problem, protocol: Protocol) -> Session:
        key = (problem.key, protocol.seed)
        if key not in self._sessions:
            self._sessions.clear()  # one problem's inputs at a time
            self._sessions[key] = Session(problem, protocol=protocol, **self._session_kwargs)
        return self._sessions[key]

    def run(self, problem: Problem, configs: Sequence[Decomposition], protocol: Protocol) -> list[Measurement]:
        session = self.session(problem, protocol)
        return [session.measure(config, protocol) for config in configs]

    def agree(self, flag: bool) -> bool:
        return any_process(flag)
