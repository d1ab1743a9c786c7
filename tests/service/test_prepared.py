"""`Prepared` runs a statement on the driver's cursor and must return and store exactly what SQLAlchemy does."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import bindparam, create_engine, event, insert, select, update
from sqlalchemy.exc import IntegrityError

from cmtune.service import migrate
from cmtune.service.db import Database
from cmtune.service.errors import UnavailableError
from cmtune.service.models import HardwareRow, Lease, Study, Trial, Worker
from cmtune.service.store.prepared import Prepared
from collective_matmul.wire import StudyState, TrialKind, TrialState
from tests.service.conftest import reset_postgres

studies, trials, hardware, workers, leases = (Study.__table__, Trial.__table__, HardwareRow.__table__,
                                              Worker.__table__, Lease.__table__)
NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
def db(database_url):
    if database_url.startswith("sqlite"):
        migrate.upgrade(create_engine(database_url))
    database = Database(database_url)
    yield database
    database.dispose()


def _study(connection) -> int:
    hardware_id = connection.execute(insert(hardware).values(
        key="cpu:cpu:8:1", platform="cpu", device_kind="cpu", device_count=8, process_count=1)
        .returning(hardware.c.id)).scalar_one()
    return connection.execute(insert(studies).values(
        hardware_id=hardware_id, state=StudyState.PENDING, settings={"seed": 1}, protocol={}, space_size=3,
        created_at=NOW, trials_done=0).returning(studies.c.id)).scalar_one()


def test_rows_match_sqlalchemy_for_json_enum_datetime_and_nulls(db):
    add = Prepared(insert(trials).returning(trials.c.id))
    read = select(trials.c.id, trials.c.kind, trials.c.decompositions, trials.c.state, trials.c.created_at,
                  trials.c.ratio, trials.c.measurements).where(trials.c.study_id == bindparam("study_id")) \
        .order_by(trials.c.number)
    with db.transaction(write=True) as c:
        study_id = _study(c)
        for number in (1, 2):
            (row,) = add.rows(c, dict(study_id=study_id, number=number, kind=TrialKind.CONFIRM, attempts=0,
                                      state=TrialState.PENDING, created_at=NOW, decomposition_id=f"d{number}",
                                      decompositions=[{"method": "baseline", "n": number}]))
            assert row.id > 0
        Prepared(update(trials).where(trials.c.number == bindparam("_n"))).rows(c, {"_n": 2, "ratio": 0.75})
        expected = [tuple(r) for r in c.execute(read, {"study_id": study_id})]
        got = Prepared(read).rows(c, {"study_id": study_id})
    assert [tuple(r) for r in got] == expected
    first = got[0]
    assert first.kind is TrialKind.CONFIRM and first.state is TrialState.PENDING  # the Enum type's result processor
    assert first.decompositions == [{"method": "baseline", "n": 1}] and first.measurements is None
    assert first.created_at == NOW and first.created_at.tzinfo is not None
    assert got[1].ratio == 0.75


def test_a_statement_with_a_python_default_runs_through_sqlalchemy(db):
    """A column default computed in Python (here `registered_at`) cannot be compiled into the SQL once."""
    register = Prepared(insert(workers).returning(workers.c.id, workers.c.registered_at, workers.c.active))
    with db.transaction(write=True) as c:
        hardware_id = c.execute(insert(hardware).values(key="k", platform="cpu", device_kind="cpu", device_count=8,
                                                        process_count=1).returning(hardware.c.id)).scalar_one()
        (row,) = register.rows(c, {"name": "w", "hardware_id": hardware_id, "software": {}})
    assert row.registered_at is not None and row.active is True


def test_listeners_see_each_statement(db):
    seen = []

    def count(_conn, _cursor, statement, *_):
        seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        with db.transaction() as c:
            Prepared(select(studies.c.id).where(studies.c.id == bindparam("id"))).rows(c, {"id": 1})
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    assert any("FROM studies" in s for s in seen)


def test_driver_errors_are_sqlalchemy_errors_and_the_transaction_rolls_back(db):
    add_lease = Prepared(insert(leases))
    with db.transaction(write=True) as c:
        study_id = _study(c)
    with pytest.raises(IntegrityError), db.transaction(write=True) as c:
        c.execute(update(studies).values(trials_done=5))
        add_lease.rows(c, dict(id="x", trial_id=424242, worker_id=1, created_at=NOW, expires_at=NOW, active=True))
    with db.transaction() as c:  # nothing of the failed transaction stayed, and the pool's connection works
        assert c.execute(select(studies.c.trials_done).where(studies.c.id == study_id)).scalar_one() == 0


def test_missing_parameters_are_refused_before_the_database_sees_them(db):
    with pytest.raises(Exception, match="study_id"), db.transaction() as c:
        Prepared(select(studies.c.id).where(studies.c.id == bindparam("study_id"))).rows(c, {})


def test_a_dropped_connection_is_invalidated(pg_url):  # PostgreSQL: SQLite has no server connection to lose
    reset_postgres(pg_url)
    migrate.upgrade(create_engine(pg_url))
    db = Database(pg_url)
    read = Prepared(select(studies.c.id).where(studies.c.id == bindparam("id")))
    with pytest.raises(UnavailableError), db.transaction() as c:  # the driver's error, as SQLAlchemy's
        pid = c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        with db.engine.connect() as other:
            other.exec_driver_sql(f"SELECT pg_terminate_backend({pid})")
        read.rows(c, {"id": 1})
    with db.transaction() as c:  # the dead connection left the pool
        assert read.rows(c, {"id": 1}) == []
    db.dispose()


def test_the_hot_writes_set_only_their_own_columns():
    """A parameter named like a column becomes a SET of that column in every UPDATE of a compiled statement
    (`Prepared` compiles with the parameters' names): the claim that also ends a lease must set nothing of
    the ended lease but ``active``, nor of its worker but ``trials_done``."""
    from sqlalchemy.dialects import postgresql

    from cmtune.service.store.leases import _claim_leased

    keys = ["claimer", "hardware_key_0", "hardware_key_1", "hardware_key_2", "lease_id", "now", "until", "_lease_id"]
    statement = _claim_leased(True, 3).statement  # a worker of 8 devices: its own key and its rings' of 4 and 2
    sql = " ".join(str(statement.compile(dialect=postgresql.dialect(), column_keys=keys)).split())
    ended = sql[sql.index("ended AS (UPDATE leases SET"):sql.index("RETURNING leases.worker_id")]
    counted = sql[sql.index("counted AS (UPDATE workers SET"):sql.index("FROM ended")]
    assert ended.count("=") == 2 and "active=" in ended, ended  # SET active, WHERE id
    assert counted.count("=") == 1 and "trials_done=" in counted, counted  # SET trials_done (WHERE after FROM)
