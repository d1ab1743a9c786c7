"""Typed dependencies: the app's state, its store (the one way to the database) and who is calling.

Two credentials: a bearer token carries a role (admin, worker, reader); a worker's own
credential, returned once when it registers and sent as ``X-Cmtune-Worker``, says which worker
it is, so one worker token shared by a fleet cannot lease, heartbeat, report or leave as another
worker.  Both are checked against the database once and then cached for
``token_cache_seconds``, so a revocation reaches every server process within that time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from cmtune.service.errors import ForbiddenError, UnauthorizedError
from cmtune.service.lookup import ConfigCache
from cmtune.service.models import TokenRole
from cmtune.service.settings import Settings
from cmtune.service.store import SqlStore, TokenInfo
from cmtune.tuner.engine import Engine
from collective_matmul.wire import WORKER_HEADER

MAX_CACHED = 10_000
Id = Annotated[int, Path(ge=1, le=2**63 - 1, description="a positive 64-bit id")]


@dataclass
class AppState:
    settings: Settings
    store: SqlStore
    engine: Engine
    cache: ConfigCache
    tokens: dict[str, tuple[float, TokenInfo | None]] = field(default_factory=dict)
    credentials: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    batch_turn: asyncio.Lock = field(default_factory=asyncio.Lock)  # one batch look-up at a time


async def get_state(request: Request) -> AppState:
    return request.app.state.cmtune


async def get_store(request: Request) -> SqlStore:
    return request.app.state.cmtune.store


StateDep = Annotated[AppState, Depends(get_state)]
StoreDep = Annotated[SqlStore, Depends(get_store)]

bearer = HTTPBearer(auto_error=False, description="a token from 'cmtune token create --role ...'")
worker_credential = APIKeyHeader(name=WORKER_HEADER, auto_error=False,
                                 description="the worker's own credential, returned once by POST /v1/workers")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's role and id (None when auth is off)."""

    role: TokenRole
    token_id: int | None


def _cached(cache: dict, key: str, ttl: float, now: float):
    hit = cache.get(key)
    return hit if hit is not None and now - hit[0] < ttl else None


def _remember(cache: dict, key: str, now: float, value) -> None:
    if len(cache) >= MAX_CACHED:  # bounded: unknown keys must not grow it without limit
        cache.clear()
    cache[key] = (now, value)


async def token_info(state: AppState, token: str) -> TokenInfo | None:
    """The token's record (cached for ``token_cache_seconds``), or None if there is no such token."""
    now = time.monotonic()
    hit = _cached(state.tokens, token, state.settings.token_cache_seconds, now)
    if hit is not None:
        return hit[1]
    found = await run_in_threadpool(_read_token, state.store, token)
    _remember(state.tokens, token, now, found)
    return found


def _read_token(store: SqlStore, token: str) -> TokenInfo | None:
    with store.read() as tx:
        return tx.tokens.find(token)


async def authenticate(state: AppState, header: str) -> TokenInfo:
    """The valid, unrevoked token of an ``Authorization`` header.

    Raises:
        UnauthorizedError: no bearer token, or an unknown or revoked one.
    """
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise UnauthorizedError("missing bearer token: send 'Authorization: Bearer <token>' "
                                "(create one with 'cmtune token create --role reader')")
    found = await token_info(state, token.strip())
    if found is None or found.revoked:
        raise UnauthorizedError("unknown or revoked token")
    return found


async def authorize(state: AppState, request: Request, roles: tuple[TokenRole, ...]) -> Principal:
    """The caller, if its bearer token has one of ``roles`` (anyone when auth is off).

    Raises:
        UnauthorizedError: no bearer token, or an unknown or revoked one.
        ForbiddenError: a token of another role.
    """
    if state.settings.auth == "off":
        return Principal(role=TokenRole.ADMIN, token_id=None)
    found = await authenticate(state, request.headers.get("authorization", ""))
    if found.role not in roles:
        raise ForbiddenError(f"a {found.role} token cannot do this; it needs one of: {', '.join(roles)}")
    return Principal(role=found.role, token_id=found.id)


def require(*roles: TokenRole):
    """A dependency admitting bearer tokens of ``roles`` (anyone when auth is off)."""

    async def check(request: Request,
                    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
        return await authorize(request.app.state.cmtune, request, roles)

    return check


WORKER_ROLES = (TokenRole.ADMIN, TokenRole.WORKER)
ReaderDep = Annotated[Principal, Depends(require(TokenRole.ADMIN, TokenRole.WORKER, TokenRole.READER))]
WorkerRoleDep = Annotated[Principal, Depends(require(*WORKER_ROLES))]
AdminDep = Annotated[Principal, Depends(require(TokenRole.ADMIN))]


async def calling_worker(request: Request,
                         _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
                         _credential: Annotated[str | None, Depends(worker_credential)]) -> int:
    """The dependency form of `worker_of` (the security schemes it names document the route)."""
    return await worker_of(request)


async def worker_of(request: Request) -> int:
    """The worker a request comes from, by its credential (a worker token alone names no worker), after
    the bearer token's role is checked.  The result route, which every worker calls for every trial,
    calls it itself: FastAPI solving it and its two security schemes as dependencies cost more than
    the check (its operation declares `WORKER_SECURITY` instead).

    Raises:
        UnauthorizedError: no bearer token or credential, an unknown one, or one of no active worker
            (register again).
        ForbiddenError: a token of another role, or the path names another worker.
    """
    state: AppState = request.app.state.cmtune
    await authorize(state, request, WORKER_ROLES)
    credential = request.headers.get(WORKER_HEADER)
    if not credential or len(credential) > 128:
        raise UnauthorizedError(f"missing worker credential: send the 'credential' that POST /v1/workers "
                                f"returned in the {WORKER_HEADER} header")
    now = time.monotonic()
    hit = _cached(state.credentials, credential, state.settings.token_cache_seconds, now)
    worker_id = hit[1] if hit is not None else await run_in_threadpool(_read_credential, state.store, credential)
    if hit is None:
        _remember(state.credentials, credential, now, worker_id)
    if worker_id is None:
        raise UnauthorizedError("unknown worker credential, or the worker left: register again with POST /v1/workers")
    named = str(request.path_params.get("worker_id", ""))
    if named.isdigit() and int(named) != worker_id:  # a malformed id is the path's own 422
        raise ForbiddenError(f"this credential is worker {worker_id}'s; a worker acts only as itself")
    return worker_id


def _read_credential(store: SqlStore, credential: str) -> int | None:
    with store.read() as tx:
        return tx.workers.of_credential(credential)


WorkerDep = Annotated[int, Depends(calling_worker)]
# the OpenAPI security of a route that calls `worker_of` itself, as `WorkerDep` declares it
WORKER_SECURITY = [{bearer.scheme_name: []}, {worker_credential.scheme_name: []}]
