"""The SQL store (SQLite or PostgreSQL), split by what it keeps.

Every route reaches the database one way: ``with store.read() as tx`` or ``with store.write() as tx`` (one
transaction; see `cmtune.service.db`).  ``tx`` is the engine's `StoreTx` (studies and trials: `studies`),
which `cmtune.tuner.engine` takes as it is, and it carries the store's other rooms on the same connection:

- ``tx.leases``: claims, leases, their end and expiry (`leases`; the policy is `cmtune.service.leasing`);
- ``tx.workers`` and ``tx.tokens``: workers, their credentials, API tokens (`workers`);
- ``tx.submissions``: submitted models and their problems (`submissions`);
- ``tx.catalog``: what the API lists and counts, tuned configs and overrides (`catalog`).

Each returns frozen domain records (`StudyRecord`, `TrialRecord`, `LeaseInfo`, `WorkerInfo`,
`SubmissionRecord`, ...), never rows.  The hot statements run through `Prepared` (`prepared`); the rooms
share one transaction's state and the row mapping (`base`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection

from cmtune.service.db import Database
from cmtune.service.store.base import Fixed, Tx
from cmtune.service.store.catalog import Catalog, TunedRow
from cmtune.service.store.leases import LeaseInfo, Leases
from cmtune.service.store.studies import Studies
from cmtune.service.store.submissions import SubmissionRecord, Submissions, SubmittedProblem
from cmtune.service.store.workers import TokenInfo, Tokens, WorkerInfo, Workers
from collective_matmul.planning.problem import Hardware

__all__ = ["Catalog", "LeaseInfo", "Leases", "SqlStore", "SqlTx", "Studies", "SubmissionRecord", "Submissions",
           "SubmittedProblem", "TokenInfo", "Tokens", "TunedRow", "WorkerInfo", "Workers"]


class SqlTx(Studies):
    """One transaction: the engine's `StoreTx` (`Studies`), and the store's other rooms on its connection."""

    def __init__(self, connection: Connection, store: SqlStore):
        tx = Tx(connection, store)
        super().__init__(tx)
        self.connection = connection
        self.workers = Workers(tx)
        self.tokens = Tokens(tx)
        self.submissions = Submissions(tx)
        self.catalog = Catalog(tx, self)


class SqlStore:
    """The database behind the service, and per-process caches of what never changes."""

    def __init__(self, db: Database):
        self.db = db
        self.fixed: dict[int, Fixed] = {}  # study id -> what never changes of it
        self.hardware: dict[int, Hardware] = {}  # hardware rows never change; filled from committed rows only
        self.touched: dict[int, tuple[float, WorkerInfo]] = {}  # worker id -> when this process marked it alive

    @contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[SqlTx]:
        with self.db.transaction(write=write) as connection:
            yield SqlTx(connection, self)

    def read(self):
        return self.transaction(write=False)

    def write(self):
        return self.transaction(write=True)
