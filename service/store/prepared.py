"""Hot statements, compiled once and run on the driver's cursor with SQLAlchemy's own type processing.

For every execution SQLAlchemy builds an execution context and a result object and reads the
cursor's description (0.1-0.2 ms of CPU per statement on the benchmark machine, more for wide rows:
about a quarter of a lease+report cycle's server time).  The cycle's statements never change, so
`Prepared` compiles each once per dialect (and per set of parameter names), then binds values with
the bind processors of its parameters' types and turns rows into named tuples with the result
processors of its columns' types: what SQLAlchemy would send and return, without the per-call
machinery.  It runs on the transaction's own connection, fires ``before_cursor_execute`` for
listeners, and raises driver errors as SQLAlchemy's (a dropped connection is invalidated), so
callers see no difference.  A statement it cannot compile so (a parameter expanded at execution, a column
default computed in Python) runs through SQLAlchemy as usual.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError


@dataclass
class _Compiled:
    """A statement compiled for one dialect and set of parameter names: its SQL and its type processing."""

    sql: str
    construct: Callable[[Mapping[str, Any]], dict]  # the statement's parameters, fixed values included
    binds: tuple[tuple[str, Callable], ...]  # parameters whose type converts the value
    order: tuple[str, ...] | None  # positional drivers (SQLite): the parameters in order
    row: type | None  # a named tuple of the result columns, or None: no rows come back
    types: tuple  # the result columns' types
    results: tuple[Callable | None, ...] | None = None  # their result processors, from the first run's
    # description (a processor may depend on the type the database reports); () when none converts


class Prepared:
    """A statement of a hot path: compiled once per dialect and run on the driver's cursor."""

    def __init__(self, statement):
        self.statement = statement
        self._compiled: dict[tuple, _Compiled | None] = {}

    def rows(self, connection: Connection, parameters: Mapping[str, Any] | None = None) -> list:
        """Run it in ``connection``'s transaction; its rows (named tuples) or []."""
        parameters = parameters or {}
        dialect = connection.dialect
        key = (dialect.name, dialect.driver, tuple(parameters))
        try:
            compiled = self._compiled[key]
        except KeyError:
            compiled = self._compiled[key] = _compile(self.statement, dialect, tuple(parameters))
        if compiled is None:
            result = connection.execute(self.statement, dict(parameters))
            return result.all() if result.returns_rows else []
        values = compiled.construct(parameters)
        for name, process in compiled.binds:
            values[name] = process(values[name])
        if compiled.order is not None:
            values = tuple(values[name] for name in compiled.order)
        return _run(connection, compiled, values)

    def one(self, connection: Connection, parameters: Mapping[str, Any] | None = None):
        """The one row it returns, or None."""
        found = self.rows(connection, parameters)
        if len(found) > 1:
            raise RuntimeError(f"expected at most one row, got {len(found)}")
        return found[0] if found else None


def _compile(statement, dialect: Dialect, keys: tuple[str, ...]) -> _Compiled | None:
    compiled = statement.compile(dialect=dialect, column_keys=list(keys) or None)
    if compiled.post_compile_params or compiled.insert_prefetch or compiled.update_prefetch:
        return None  # values known only at execution, or Python-side defaults: SQLAlchemy's path
    binds = []
    for bind, name in compiled.bind_names.items():
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if process is not None:
            binds.append(((compiled.escaped_bind_names or {}).get(name, name), process))
    columns = list(statement.exported_columns)  # a select's columns, or what a write returns
    names = tuple(column.key for column in columns)
    row = None
    if columns:
        try:
            row = namedtuple("Row", names)
        except ValueError:
            return None  # a name a named tuple cannot hold: SQLAlchemy's path
    return _Compiled(sql=compiled.string, construct=compiled.construct_params, binds=tuple(binds),
                 order=tuple(compiled.positiontup) if compiled.positional else None, row=row,
                 types=tuple(column.type.dialect_impl(dialect) for column in columns))


def _run(connection: Connection, compiled: _Compiled, values) -> list:
    dbapi_connection = connection.connection
    cursor = dbapi_connection.cursor()
    try:
        listeners = connection.dispatch.before_cursor_execute
        if listeners:
            listeners(connection, cursor, compiled.sql, values, None, False)
        cursor.execute(compiled.sql, values)
        raw = cursor.fetchall() if compiled.row is not None else ()
        if compiled.row is not None and compiled.results is None:
            dialect = connection.dialect
            processors = tuple(kind.result_processor(dialect, column[1])
                               for kind, column in zip(compiled.types, cursor.description, strict=True))
            compiled.results = processors if any(processors) else ()
    except connection.dialect.loaded_dbapi.Error as exc:
        dialect = connection.dialect
        gone = dialect.is_disconnect(exc, dbapi_connection, cursor)
        if gone:
            connection.invalidate(exc)
        raise DBAPIError.instance(compiled.sql, values, exc, dialect.loaded_dbapi.Error, connection_invalidated=gone,
                                  dialect=dialect) from exc
    finally:
        cursor.close()
    if compiled.row is None:
        return []
    make, results = compiled.row._make, compiled.results
    if not results:
        return [make(r) for r in raw]
    return [make(value if process is None else process(value) for process, value in zip(results, r, strict=True))
            for r in raw]
