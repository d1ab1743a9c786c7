"""Engine and transactions: SQLite (WAL, busy timeout, immediate write transactions) or PostgreSQL."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import DataError, DisconnectionError, OperationalError

from cmtune.service.errors import InvalidError, UnavailableError

log = logging.getLogger("cmtune.service")

WRITE = {"cmtune_write": True}
PING_AFTER_IDLE_S = 5.0


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite files get WAL mode, a busy timeout and immediate writes.

    On SQLite, a transaction begun on a connection with the ``cmtune_write`` execution option
    starts with ``BEGIN IMMEDIATE``, so two writers never deadlock on a lock upgrade; reads stay
    deferred and run concurrently with the writer under WAL.
    """
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               pool_size=20, max_overflow=40)

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_connection, _record):
            dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(connection):
            immediate = connection.get_execution_options().get("cmtune_write")
            connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine
    # more pooled connections than the request threads that can hold one (`Settings.request_threads`),
    # so a busy server reuses connections instead of opening and closing overflow ones
    engine = create_engine(url, pool_size=40, max_overflow=10)
    _ping_when_idle(engine)
    return engine


def _ping_when_idle(engine: Engine) -> None:
    """Check a pooled connection before use only when it sat idle over `PING_AFTER_IDLE_S` (a database
    restart or a dropped socket shows there); a busy pool pays no round trip per transaction, as
    ``pool_pre_ping`` would.  A dead connection is replaced before the transaction starts."""

    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_connection, record):
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection, record, _proxy):
        if time.monotonic() - record.info.get("idle_since", time.monotonic()) < PING_AFTER_IDLE_S:
            return
        try:
            cursor = dbapi_connection.cursor()
            cursor.execute("SELECT 1")
            cursor.close()
            dbapi_connection.rollback()
        except Exception as exc:  # the pool discards this connection and checks out another
            raise DisconnectionError(f"pooled connection dead after idling: {exc}") from exc


class Database:
    """The engine, and transactions on it (reads, and writes)."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self._writer = self.engine.execution_options(**WRITE)

    @property
    def is_postgres(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[Connection]:
        """One transaction on a pooled connection (Core, no ORM unit of work): commits on success,
        rolls back on any error, wraps driver errors.

        Domain errors pass through unchanged; database failures become `UnavailableError`, and a value the
        database refuses (a NUL in text, a string over its column, an integer out of range) `InvalidError`:
        the API's own bounds should have refused it first, so it is logged as an error.
        """
        try:
            with (self._writer if write else self.engine).begin() as connection:
                yield connection
        except OperationalError as exc:
            log.warning("database unavailable: %s", exc.orig)  # where it is stays in the server's log
            raise UnavailableError("database unavailable; retry shortly") from exc
        except DataError as exc:
            reason = (str(exc.orig).strip().splitlines() or [type(exc.orig).__name__])[0][:200]
            log.error("the database refused a value the API let through: %s", reason)
            raise InvalidError(f"the database refused a value of this request ({reason}): nothing was stored; "
                               "send shorter text, without NUL characters, and numbers in range") from exc

    def dispose(self) -> None:
        self.engine.dispose()
