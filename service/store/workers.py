"""Workers and tokens: who may call the service, and the workers that lease its trials.

Secrets are never stored: a token's and a worker credential's SHA-256 is.  A busy worker leases several
times a second, so `Workers.touch` marks it alive at most every few seconds per process (`SqlStore.touched`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import func, insert, select, update

from cmtune.service.models import Token, TokenRole
from cmtune.service.store.base import HARDWARE, P, Tx, hardware_of, hardware_t, workers
from cmtune.service.store.prepared import Prepared
from cmtune.tuner.errors import NotFoundError
from collective_matmul.planning.problem import Hardware, Software

tokens = Token.__table__
MAX_TOUCHED = 100_000  # workers one process remembers marking alive


@dataclass(frozen=True)
class TokenInfo:
    id: int
    name: str
    role: TokenRole
    revoked: bool
    created_at: dt.datetime


@dataclass(frozen=True)
class WorkerInfo:
    id: int
    name: str
    hardware: Hardware
    software: Software
    registered_at: dt.datetime
    last_heartbeat: dt.datetime
    active: bool
    trials_done: int
    memory_bytes: int | None = None


_TOUCH_WORKER = Prepared(update(workers).where(workers.c.id == P("_worker_id"), workers.c.active.is_(True))
                         .values(last_heartbeat=P("now")).returning(workers))
_HARDWARE_MEMORY = Prepared(select(func.max(workers.c.memory_bytes))
                            .join(hardware_t, hardware_t.c.id == workers.c.hardware_id)
                            .where(hardware_t.c.key == P("key")))
_TOKEN_COLUMNS = (tokens.c.id, tokens.c.name, tokens.c.role, tokens.c.revoked, tokens.c.created_at)


def _not_registered(worker_id: int) -> NotFoundError:
    return NotFoundError(f"worker {worker_id} is not registered; register again with POST /v1/workers")


def _worker(row, hardware: Hardware) -> WorkerInfo:
    return WorkerInfo(id=row.id, name=row.name, hardware=hardware, software=Software.of(row.software),
                      registered_at=row.registered_at, last_heartbeat=row.last_heartbeat, active=row.active,
                      trials_done=row.trials_done, memory_bytes=row.memory_bytes)


class Workers:
    """The workers of one transaction (`Tx`)."""

    def __init__(self, tx: Tx):
        self._tx = tx

    def add(self, *, name: str, hardware: Hardware, software: Software, memory_bytes: int | None,
            now: dt.datetime) -> tuple[int, str]:
        """A new worker and its credential (``cmw_<id>_<secret>``, shown once; only its hash is stored)."""
        tx = self._tx
        worker_id = tx.execute(insert(workers).values(
            name=name, hardware_id=tx.hardware_id(hardware, create=True), software=software.model_dump(mode="json"),
            registered_at=now, last_heartbeat=now, active=True, trials_done=0, memory_bytes=memory_bytes,
        ).returning(workers.c.id)).scalar_one()
        credential = f"cmw_{worker_id}_{secrets.token_urlsafe(32)}"
        tx.execute(update(workers).where(workers.c.id == worker_id).values(credential_hash=hash_token(credential)))
        return worker_id, credential

    def of_credential(self, credential: str) -> int | None:
        """The active worker a credential belongs to, or None."""
        worker_id = credential_worker_id(credential)
        if worker_id is None:
            return None
        return self._tx.scalar(select(workers.c.id).where(workers.c.id == worker_id, workers.c.active.is_(True),
                                                          workers.c.credential_hash == hash_token(credential)))

    def get(self, worker_id: int) -> WorkerInfo:
        """An active worker; `NotFoundError` (register again) otherwise."""
        found = self.all(worker_id=worker_id)
        if not found:
            raise _not_registered(worker_id)
        return found[0]

    def all(self, *, include_inactive: bool = False, worker_id: int | None = None) -> list[WorkerInfo]:
        query = select(workers, *HARDWARE).join(hardware_t, hardware_t.c.id == workers.c.hardware_id)
        if not include_inactive:
            query = query.where(workers.c.active.is_(True))
        if worker_id is not None:
            query = query.where(workers.c.id == worker_id)
        return [_worker(r, hardware_of(r)) for r in self._tx.execute(query.order_by(workers.c.id))]

    def touch(self, worker_id: int, now: dt.datetime, *, at_most_every_s: float = 0.0) -> WorkerInfo:
        """Mark an active worker alive and return it (one statement; its hardware is cached).

        Args:
            at_most_every_s: a worker this process marked alive more recently is not written again
                (a busy worker leases several times a second; "online" is judged over a minute).

        Raises:
            NotFoundError: the worker is not registered (or left).
        """
        tx, store = self._tx, self._tx.store
        touched = store.touched.get(worker_id)
        if touched is not None and time.monotonic() - touched[0] < at_most_every_s:
            return touched[1]
        row = tx.first(_TOUCH_WORKER, {"_worker_id": worker_id, "now": now})
        if row is None:
            raise _not_registered(worker_id)
        hardware = store.hardware.get(row.hardware_id)
        if hardware is None:
            hardware = hardware_of(tx.one(select(*HARDWARE).where(hardware_t.c.id == row.hardware_id)))
            store.hardware[row.hardware_id] = hardware
        worker = _worker(row, hardware)
        if len(store.touched) >= MAX_TOUCHED:
            store.touched.clear()
        store.touched[worker_id] = (time.monotonic(), worker)
        return worker

    def beat(self, worker_id: int, now: dt.datetime) -> None:
        """A heartbeat: the worker is alive at ``now``."""
        self._set(worker_id, last_heartbeat=now)

    def leave(self, worker_id: int) -> None:
        """The worker is no longer active (it unregistered)."""
        self._set(worker_id, active=False)

    def _set(self, worker_id: int, **columns) -> None:
        self._tx.store.touched.pop(worker_id, None)  # a changed worker is read afresh by its next lease
        self._tx.execute(update(workers).where(workers.c.id == worker_id).values(**columns))

    def memory(self, hardware: Hardware) -> int | None:
        """The most device memory any worker of ``hardware`` (now or before) reported (None: none did).

        A problem that does not fit it fits no worker known to the service.
        """
        return self._tx.first(_HARDWARE_MEMORY, {"key": hardware.identity().key})[0]

    def count_online(self, *, since: dt.datetime) -> int:
        return int(self._tx.scalar(select(func.count()).select_from(workers).where(
            workers.c.active.is_(True), workers.c.last_heartbeat >= since)) or 0)


class Tokens:
    """The API tokens of one transaction (`Tx`)."""

    def __init__(self, tx: Tx):
        self._tx = tx

    def add(self, *, name: str, role: TokenRole, value: str | None = None) -> tuple[int, str]:
        """A new token (random unless ``value``); only its SHA-256 is stored.  Returns its id and the token."""
        plain = value or "cmt_" + secrets.token_urlsafe(32)
        token_id = self._tx.execute(insert(tokens).values(
            name=name, role=role, hash=hash_token(plain), created_at=dt.datetime.now(dt.UTC), revoked=False)
            .returning(tokens.c.id)).scalar_one()
        return token_id, plain

    def all(self) -> list[TokenInfo]:
        return [_token(r) for r in self._tx.execute(select(*_TOKEN_COLUMNS).order_by(tokens.c.id))]

    def revoke(self, token_id: int) -> TokenInfo:
        """Mark a token revoked (kept for the record); `NotFoundError` if there is none."""
        if self._tx.execute(update(tokens).where(tokens.c.id == token_id).values(revoked=True)).rowcount == 0:
            raise NotFoundError(f"token {token_id} does not exist; see 'cmtune token list'")
        return _token(self._tx.one(select(*_TOKEN_COLUMNS).where(tokens.c.id == token_id)))

    def find(self, token: str) -> TokenInfo | None:
        """The token's record (revoked ones too), by its hash."""
        row = self._tx.one(select(*_TOKEN_COLUMNS).where(tokens.c.hash == hash_token(token)))
        return _token(row) if row is not None else None


def _token(row) -> TokenInfo:
    return TokenInfo(id=row.id, name=row.name, role=TokenRole(row.role), revoked=row.revoked, created_at=row.created_at)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def credential_worker_id(credential: str) -> int | None:
    """The worker id a credential names (``cmw_<id>_<secret>``), or None if it is not one."""
    prefix, _, rest = credential.partition("_")
    worker_id, _, secret = rest.partition("_")
    if prefix != "cmw" or not secret or not worker_id.isdigit() or len(worker_id) > 18:
        return None
    return int(worker_id)
