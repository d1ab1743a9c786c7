"""Submissions: a model and mesh submitted on one hardware, and the problem and study of each of its roles."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import insert, select

from cmtune.service.models import Submission, SubmissionStudy
from cmtune.service.store.base import HARDWARE, PROBLEM, Tx, hardware_of, hardware_t, problem_of, problems
from collective_matmul.planning.problem import Hardware, Problem

submissions_t, links_t = Submission.__table__, SubmissionStudy.__table__


@dataclass(frozen=True)
class SubmittedProblem:
    """One unique problem of a submission: its roles, how often a step runs it, and its study (None: none
    was needed)."""

    problem: Problem
    study_id: int | None
    roles: tuple[str, ...]
    count: int


@dataclass(frozen=True)
class SubmissionRecord:
    id: int
    model: dict  # the submitted block as JSON (a discovered step: its name, ``discovered`` and ``layers``)
    mesh: dict
    hardware: Hardware
    created_at: dt.datetime
    entries: tuple[SubmittedProblem, ...]

    @property
    def name(self) -> str:
        return self.model.get("name", "model")


class Submissions:
    """The submissions of one transaction (`Tx`)."""

    def __init__(self, tx: Tx):
        self._tx = tx

    def lock_hardware(self, hardware: Hardware) -> None:
        """Serialise this transaction with every other that locks ``hardware`` (its row, made if missing)
        until it ends: submissions of one model on one hardware then see each other's step study.
        SQLite's write transactions are serial already."""
        hardware_id = self._tx.hardware_id(hardware, create=True)
        self._tx.execute(select(hardware_t.c.id).where(hardware_t.c.id == hardware_id).with_for_update())

    def add(self, *, model: dict, mesh: dict, hardware: Hardware, now: dt.datetime) -> int:
        return self._tx.execute(insert(submissions_t).values(
            model=model, mesh=mesh, hardware_id=self._tx.hardware_id(hardware, create=True), created_at=now)
            .returning(submissions_t.c.id)).scalar_one()

    def link(self, *, submission_id: int, study_id: int | None, problem: Problem, roles: Sequence[str],
             count: int) -> None:
        self._tx.execute(insert(links_t).values(
            submission_id=submission_id, study_id=study_id, problem_id=self._tx.problem_id(problem, create=True),
            roles=list(roles), count=count))

    def get(self, submission_id: int) -> SubmissionRecord | None:
        found = self._select(limit=1, submission_id=submission_id)
        return found[0] if found else None

    def newest(self, *, limit: int = 100) -> list[SubmissionRecord]:
        return self._select(limit=limit)

    def _select(self, *, limit: int, submission_id: int | None = None) -> list[SubmissionRecord]:
        query = select(submissions_t, *HARDWARE).join(hardware_t, hardware_t.c.id == submissions_t.c.hardware_id)
        if submission_id is not None:
            query = query.where(submissions_t.c.id == submission_id)
        rows = self._tx.execute(query.order_by(submissions_t.c.id.desc()).limit(limit)).all()
        if not rows:
            return []
        entries: dict[int, list[SubmittedProblem]] = {row.id: [] for row in rows}
        for e in self._tx.execute(
                select(links_t.c.submission_id, links_t.c.study_id, links_t.c.roles, links_t.c.count, *PROBLEM)
                .join(problems, problems.c.id == links_t.c.problem_id)
                .where(links_t.c.submission_id.in_(list(entries))).order_by(links_t.c.id)):
            entries[e.submission_id].append(SubmittedProblem(problem_of(e), e.study_id, tuple(e.roles), e.count))
        return [SubmissionRecord(r.id, r.model, r.mesh, hardware_of(r), r.created_at, tuple(entries[r.id]))
                for r in rows]
