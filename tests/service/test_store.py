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
from cmtune.tuner.searching import study_settings
from collective_matmul import Hardware, Problem
from collective_matmul.problem import Software
from collective_matmul.wire import Protocol, TrialState

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
                                      protocol=Protocol(), now=NOW)
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
