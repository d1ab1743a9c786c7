"""The SQL store's rooms beyond the engine's interface (that one is tests/tuner/test_engine.py's contract
suite): leasing's moves go through `TRIAL_MOVES`, submissions come back as frozen records."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from cmtune.service import migrate
from cmtune.service.db import Database
from cmtune.service.store import SqlStore, SubmissionRecord
from cmtune.tuner import states
from cmtune.tuner.engine import Engine
from cmtune.tuner.errors import ConflictError
from cmtune.tuner.search_studies import study_settings
from collective_matmul import Hardware, Problem
from collective_matmul.planning.problem import Software
from collective_matmul.wire import MeasurementProtocol, TrialState

PROBLEM = Problem.parse("ag:256x64x128:float32:8")
HW = Hardware(platform="cpu", device_kind="cpu", device_count=8)
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
def store(database_url):
    db = Database(database_url)
    migrate.upgrade(db.engine)
    yield SqlStore(db)
    db.dispose()


def test_a_lease_claims_only_along_trial_moves(store, monkeypatch):
    with store.write() as tx:
        study = Engine().create_study(tx, problem=PROBLEM, hardware=HW, settings=study_settings(PROBLEM, HW),
                                      protocol=MeasurementProtocol(), now=NOW)
        worker_id, _ = tx.workers.add(name="w", hardware=HW, software=Software(), memory_bytes=None, now=NOW)
    monkeypatch.setitem(states.TRIAL_MOVES, TrialState.PENDING, frozenset({TrialState.CANCELLED}))
    with pytest.raises(ConflictError, match="cannot become leased"), store.write() as tx:
        tx.leases.claim_leased(hardware=HW, worker_id=worker_id, now=NOW, seconds=60)
    monkeypatch.undo()
    with store.write() as tx:
        trial, lease = tx.leases.claim_leased(hardware=HW, worker_id=worker_id, now=NOW, seconds=60)
        assert trial.study_id == study.id and trial.state == TrialState.LEASED and lease.trial_id == trial.id
        assert tx.leases.extend(lease.id, worker_id=worker_id + 1, now=NOW, seconds=60) is None  # not its own
        assert tx.leases.extend(lease.id, worker_id=worker_id, now=NOW, seconds=120).expires_at == \
            NOW + dt.timedelta(seconds=120)


def test_a_worker_leases_the_trials_of_its_rings_in_one_claim(store):
    """A worker of 8 devices leases a ring of 4 of its slice's study (on PostgreSQL the one-statement claim and
    lease), and never a machine of 4's: the ring's hardware row keeps the slice."""
    machine = HW.model_copy(update={"process_count": 2})
    ring, alone = machine.ring(4), Hardware(platform="cpu", device_kind="cpu", device_count=4, process_count=1)
    problem = Problem.parse("ag:256x64x128:float32:4")
    with store.write() as tx:
        engine = Engine()
        other = engine.create_study(tx, problem=problem, hardware=alone, settings=study_settings(problem, alone),
                                    protocol=MeasurementProtocol(), now=NOW)
        study = engine.create_study(tx, problem=problem, hardware=ring, settings=study_settings(problem, ring),
                                    protocol=MeasurementProtocol(), now=NOW)
        worker_id, _ = tx.workers.add(name="w", hardware=machine, software=Software(), memory_bytes=None, now=NOW)
    assert other.id < study.id and other.hardware.key == "cpu:cpu:4:1" and study.hardware.key == "cpu:cpu:4:1/8"
    with store.write() as tx:
        trial, lease = tx.leases.claim_leased(hardware=machine, worker_id=worker_id, now=NOW, seconds=60)
        assert trial.study_id == study.id and lease.trial_id == trial.id
        assert tx.leases.starving_studies(machine) == []
    store.fixed.clear()
    with store.read() as tx:
        assert tx.study(study.id).hardware == ring.identity()


def test_migration_0009_adds_the_slice_and_keeps_a_ring_through_a_downgrade(database_url):
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    migrate.upgrade(engine)
    migrate.downgrade(engine, "0008")
    with engine.begin() as c:  # a machine stored before the revision
        c.execute(text("INSERT INTO hardware (key, platform, device_kind, device_count, process_count) "
                       "VALUES ('cpu:cpu:8:1', 'cpu', 'cpu', 8, 1)"))
    migrate.upgrade(engine)
    db = Database(database_url)
    with SqlStore(db).write() as tx:
        tx.workers.add(name="w", hardware=HW.ring(4), software=Software(), memory_bytes=None, now=NOW)
    db.dispose()
    rows = "SELECT key, slice_devices FROM hardware ORDER BY id"
    with engine.connect() as c:
        assert c.execute(text(rows)).all() == [("cpu:cpu:8:1", None), ("cpu:cpu:4:1/8", 8)]
    migrate.downgrade(engine, "0008")
    with engine.connect() as c:
        assert c.execute(text("SELECT key FROM hardware ORDER BY id")).scalars().all() == ["cpu:cpu:8:1",
                                                                                          "cpu:cpu:4:1/8"]
    migrate.upgrade(engine)  # the ring gets its slice back from its key
    with engine.connect() as c:
        assert c.execute(text(rows)).all() == [("cpu:cpu:8:1", None), ("cpu:cpu:4:1/8", 8)]
    engine.dispose()


def test_migration_0010_keeps_a_configs_overlap_and_memory_and_the_config_through_a_downgrade(database_url):
    from sqlalchemy import create_engine

    from collective_matmul import Decomposition
    from collective_matmul.wire.bundle import TunedConfig

    config = TunedConfig(problem=PROBLEM, hardware=HW, decomposition=Decomposition.from_id("ring-bi-c1-full-dus"),
                         time_s=1e-3, baseline_s=2e-3, speedup=2.0, overlap="partly", memory_bytes=3 << 20)
    engine = create_engine(database_url)
    migrate.upgrade(engine)
    db = Database(database_url)
    store = SqlStore(db)
    with store.write() as tx:
        tx.save_tuned(config, study_id=None)
    with store.read() as tx:
        stored = tx.tuned_config(PROBLEM, HW)
        assert (stored.overlap, stored.memory_bytes) == ("partly", 3 << 20)
    db.dispose()
    migrate.downgrade(engine, "0009")  # the older code's table: the config stays, without the two
    migrate.upgrade(engine)
    db = Database(database_url)
    with SqlStore(db).read() as tx:
        again = tx.tuned_config(PROBLEM, HW)
    db.dispose()
    engine.dispose()
    assert again.decomposition == config.decomposition and again.speedup == 2.0
    assert (again.overlap, again.memory_bytes) == (None, None)


def test_submissions_are_frozen_records(store):
    with store.write() as tx:
        submission_id = tx.submissions.add(model={"name": "tiny", "layers": 2}, mesh={"model": 8}, hardware=HW,
                                           now=NOW)
        tx.submissions.link(submission_id=submission_id, study_id=None, problem=PROBLEM, roles=["qkv", "mlp_up"],
                            count=3)
    with store.read() as tx:
        found = tx.submissions.get(submission_id)
        assert tx.submissions.newest() == [found] and tx.submissions.get(submission_id + 1) is None
    assert isinstance(found, SubmissionRecord) and found.name == "tiny" and found.hardware == HW.identity()
    (entry,) = found.entries
    assert (entry.problem, entry.study_id, entry.roles, entry.count) == (PROBLEM, None, ("qkv", "mlp_up"), 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.id = 0


def test_both_stores_answer_exactly_the_engines_interface():
    """The SQL transaction's methods are `StoreTx`'s and no more (the other rooms are attributes), and so are
    the in-memory store's (with its `transaction`)."""
    from cmtune.service.store import Studies
    from cmtune.tuner.store import InMemoryStore, StoreTx

    def public(cls):
        return {name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))}

    assert public(Studies) == public(StoreTx)
    assert public(InMemoryStore) == public(StoreTx) | {"transaction"}


def test_every_stop_reason_fits_its_column():
    """A study stores its stop reason as the enum's value: each must fit studies.stop_reason (PostgreSQL refuses a
    longer one, which left a step search that stopped after a full pass unable to be saved there)."""
    from cmtune.service.models import Study
    from collective_matmul.wire import StopReason

    length = Study.__table__.c.stop_reason.type.length
    assert all(len(reason.value) <= length for reason in StopReason), length
