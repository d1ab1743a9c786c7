"""Typed dependencies: the database, settings, config cache and the caller's role."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from service import repository as repo
from service.db import Database
from service.errors import ForbiddenError, UnauthorizedError
from service.lookup import ConfigCache
from service.settings import Settings


@dataclass
class AppState:
    settings: Settings
    db: Database
    cache: ConfigCache


async def get_state(request: Request) -> AppState:
    return request.app.state.cmtune


async def get_db(request: Request) -> Database:
    return request.app.state.cmtune.db


def get_session(request: Request) -> Iterator[Session]:
    """A read-only session (writes open their own transaction with ``db.session(write=True)``)."""
    with request.app.state.cmtune.db.session() as session:
        yield session


StateDep = Annotated[AppState, Depends(get_state)]
DatabaseDep = Annotated[Database, Depends(get_db)]
SessionDep = Annotated[Session, Depends(get_session)]

ROLES = ("admin", "worker", "reader")


@dataclass(frozen=True)
class Principal:
    role: str
    token_id: int | None


def require(*roles: str):
    """A dependency admitting bearer tokens of ``roles`` (anyone when auth is off)."""

    async def check(request: Request) -> Principal:
        """Async so that a cached token costs no thread hop; a new token is looked up off the loop."""
        state: AppState = request.app.state.cmtune
        if state.settings.auth == "off":
            return Principal(role="admin", token_id=None)
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise UnauthorizedError("missing bearer token: send 'Authorization: Bearer <token>' "
                                    "(create one with 'cmtune token create --role reader')")
        cache = request.app.state.token_cache
        row = cache.get(token)
        if row is None:
            row = await run_in_threadpool(_token_role, state.db, token)
            if row is None:
                raise UnauthorizedError("unknown or revoked token")
            cache[token] = row
        if row[0] not in roles:
            raise ForbiddenError(f"a {row[0]} token cannot do this; it needs one of: {', '.join(roles)}")
        return Principal(role=row[0], token_id=row[1])

    return check


def _token_role(db: Database, token: str) -> tuple[str, int] | None:
    with db.session() as session:
        found = repo.find_token(session=session, token=token)
        return (found.role, found.id) if found is not None else None


ReaderDep = Annotated[Principal, Depends(require("admin", "worker", "reader"))]
WorkerRoleDep = Annotated[Principal, Depends(require("admin", "worker"))]
AdminDep = Annotated[Principal, Depends(require("admin"))]
