"""Engine and sessions: SQLite (WAL, busy timeout, immediate write transactions) or PostgreSQL."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from cmtune.service.errors import UnavailableError

log = logging.getLogger("cmtune.service")

WRITE = {"cmtune_write": True}


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
    # as many pooled connections as the request threads that can hold one (anyio's limiter: 40),
    # so a busy server reuses connections instead of opening and closing overflow ones
    return create_engine(url, pool_size=40, max_overflow=10, pool_pre_ping=True)


class Database:
    """The engine plus the two session factories (reads, and writes)."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self.engine.execution_options(**WRITE), expire_on_commit=False)

    @property
    def is_postgres(self) -> bool:
        return self.engine.dialect.name == "postgresql"

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """One transaction: commits on success, rolls back on any error, wraps driver errors.

        Domain errors pass through unchanged; database failures become `UnavailableError`.
        """
        session = (self._write if write else self._read)()
        try:
            yield session
            session.commit()
        except SQLAlchemyError as exc:
            session.rollback()
            if isinstance(exc, OperationalError):
                log.warning("database unavailable: %s", exc.orig)  # where it is stays in the server's log
                raise UnavailableError("database unavailable; retry shortly") from exc
            raise
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def dispose(self) -> None:
        self.engine.dispose()
