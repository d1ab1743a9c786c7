"""Typed dependencies: the app's state, its store (the one way to the database) and the caller's role."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool

from cmtune.service.errors import ForbiddenError, UnauthorizedError
from cmtune.service.lookup import ConfigCache
from cmtune.service.models import Role
from cmtune.service.settings import Settings
from cmtune.service.store import SqlStore, TokenInfo
from cmtune.tuner.engine import Engine


@dataclass
class AppState:
    settings: Settings
    store: SqlStore
    engine: Engine
    cache: ConfigCache
    tokens: dict[str, tuple[float, TokenInfo | None]] = field(default_factory=dict)


async def get_state(request: Request) -> AppState:
    return request.app.state.cmtune


async def get_store(request: Request) -> SqlStore:
    return request.app.state.cmtune.store


StateDep = Annotated[AppState, Depends(get_state)]
StoreDep = Annotated[SqlStore, Depends(get_store)]


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's role and id (None when auth is off)."""

    role: Role
    token_id: int | None


def require(*roles: Role):
    """A dependency admitting bearer tokens of ``roles`` (anyone when auth is off)."""

    async def check(request: Request) -> Principal:
        """Async so that a cached token costs no thread hop; a new token is looked up off the loop."""
        state: AppState = request.app.state.cmtune
        if state.settings.auth == "off":
            return Principal(role=Role.ADMIN, token_id=None)
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise UnauthorizedError("missing bearer token: send 'Authorization: Bearer <token>' "
                                    "(create one with 'cmtune token create --role reader')")
        found = await _token(state, token)
        if found is None or found.revoked:
            raise UnauthorizedError("unknown or revoked token")
        if found.role not in roles:
            raise ForbiddenError(f"a {found.role} token cannot do this; it needs one of: {', '.join(roles)}")
        return Principal(role=found.role, token_id=found.id)

    return check


async def _token(state: AppState, token: str) -> TokenInfo | None:
    """The token's record, cached for ``token_cache_seconds`` (so a revocation is seen that soon)."""
    now = time.monotonic()
    hit = state.tokens.get(token)
    if hit is not None and now - hit[0] < state.settings.token_cache_seconds:
        return hit[1]
    found = await run_in_threadpool(_read_token, state.store, token)
    if len(state.tokens) >= 10_000:  # bounded: unknown tokens must not grow it without limit
        state.tokens.clear()
    state.tokens[token] = (now, found)
    return found


def _read_token(store: SqlStore, token: str) -> TokenInfo | None:
    with store.read() as tx:
        return tx.token(token)


ReaderDep = Annotated[Principal, Depends(require(Role.ADMIN, Role.WORKER, Role.READER))]
WorkerRoleDep = Annotated[Principal, Depends(require(Role.ADMIN, Role.WORKER))]
AdminDep = Annotated[Principal, Depends(require(Role.ADMIN))]
