"""The SQL store's rooms beyond the engine's interface (that one is tests/tuner/test_engine.py's contract
suite): submissions come back as frozen records."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from cmtune.service import migrate
from cmtune.service.db import Database
from cmtune.service.store import SqlStore, SubmissionRecord
from collective_matmul import Hardware, Problem

PROBLEM = Problem.parse("ag:256x64x128:float32:8")
HW = Hardware(platform="cpu", device_kind="cpu", device_count=8)
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
def store(database_url):
    db = Database(database_url)
    migrate.upgrade(db.engine)
    yield SqlStore(db)
    db.dispose()


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

