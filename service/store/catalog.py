"""What the API and the dashboard read beyond the engine's interface: pages and counts of studies and
trials, a problem's study, and tuned configs and overrides with their filters."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy import and_, func, or_, select

from cmtune.service.store.base import (
    FIXED,
    HARDWARE,
    MUTABLE,
    PROBLEM,
    P,
    Tx,
    decomposition_of,
    hardware_of,
    hardware_t,
    problems,
    studies,
    study_record,
    trials,
    tuned_config_of,
    tuned_select,
    tuned_t,
    with_keys,
)
from cmtune.service.store.prepared import Prepared
from cmtune.service.store.studies import Studies, overrides_t
from cmtune.tuner.store import StudyRecord
from cmtune.tuner.warm import Known
from collective_matmul.planning.decomposition import Decomposition, OpConfigs
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import ACTIVE_STUDY_STATES, Status, StudyKind, StudyState, TrialKind, TrialState
from collective_matmul.wire.bundle import RoleOverride, TunedConfig

log = logging.getLogger(__name__)

_FIND_STUDY = Prepared(select(studies.c.id).where(
    studies.c.problem_id == P("problem_id"), studies.c.hardware_id == P("hardware_id"),
    studies.c.kind == StudyKind.SEARCH.value,
    or_(*(studies.c.state == s for s in [*ACTIVE_STUDY_STATES, StudyState.COMPLETED])))
    .order_by(studies.c.id.desc()).limit(1))


@dataclass(frozen=True)
class TunedRow:
    """A stored tuned config and the study that produced it."""

    config: TunedConfig
    study_id: int | None


class Catalog:
    """The API's reads in one transaction (`Tx`); a study it names is read through ``studies``."""

    def __init__(self, tx: Tx, studies_: Studies):
        self._tx, self._studies = tx, studies_

    def known(self, hardware: Hardware) -> bool:
        """Whether anything was ever stored on ``hardware`` (its row exists)."""
        return self._tx.hardware_id(hardware) is not None

    # --- studies ------------------------------------------------------------------------------

    def find_study(self, problem: Problem, hardware: Hardware) -> StudyRecord | None:
        """The newest study of this (problem, hardware) that is active or completed."""
        problem_id, hardware_id = self._tx.problem_id(problem), self._tx.hardware_id(hardware)
        if problem_id is None or hardware_id is None:
            return None
        found = self._tx.first(_FIND_STUDY, {"problem_id": problem_id, "hardware_id": hardware_id})
        return self._studies.study(found.id) if found is not None else None

    def step_study_of(self, submission_id: int) -> StudyRecord | None:
        """The newest step study of a submission."""
        found = self._tx.scalar(select(studies.c.id).where(studies.c.submission_id == submission_id,
                                                           studies.c.kind == StudyKind.STEP.value)
                                .order_by(studies.c.id.desc()).limit(1))
        return self._studies.study(found) if found is not None else None

    def list_studies(self, *, state: StudyState | None, hardware: str | None, offset: int,
                     limit: int) -> tuple[list[StudyRecord], int]:
        """A page of studies, newest first, and the total; two queries whatever the page size."""
        query = with_keys(select(*MUTABLE, *(c for c in FIXED if c.name != "created_at"), *PROBLEM, *HARDWARE))
        count = select(func.count()).select_from(studies)
        if state is not None:
            query, count = query.where(studies.c.state == state), count.where(studies.c.state == state)
        if hardware:
            query = query.where(hardware_t.c.key == hardware)
            count = count.join(hardware_t, hardware_t.c.id == studies.c.hardware_id).where(hardware_t.c.key == hardware)
        total = self._tx.scalar(count)
        rows = self._tx.execute(query.order_by(studies.c.id.desc()).offset(offset).limit(limit))
        return [study_record(self._tx.fixed(row.id, row.created_at, row), row) for row in rows], int(total or 0)

    def leased_counts(self, study_ids: Sequence[int]) -> dict[int, int]:
        """Trials currently leased, per study."""
        if not study_ids:
            return {}
        return dict(self._tx.execute(
            select(trials.c.study_id, func.count()).where(trials.c.study_id.in_(list(study_ids)),
                                                          trials.c.state == TrialState.LEASED)
            .group_by(trials.c.study_id)).all())

    def trial_decompositions(self, trial_ids: Sequence[int]) -> dict[int, Decomposition]:
        """The candidates of search trials, by id (for the best-so-far of a page of studies)."""
        if not trial_ids:
            return {}
        rows = self._tx.execute(select(trials.c.id, trials.c.decomposition_id).where(trials.c.id.in_(list(trial_ids))))
        return {row.id: decomposition_of(row.decomposition_id) for row in rows}

    def count_studies_by_state(self) -> dict[str, int]:
        return {str(s): n for s, n in self._tx.execute(
            select(studies.c.state, func.count()).group_by(studies.c.state)).all()}

    def count_trials_by_state(self) -> dict[str, int]:
        return {str(s): n for s, n in self._tx.execute(
            select(trials.c.state, func.count()).group_by(trials.c.state)).all()}

    # --- tuned configs and overrides ------------------------------------------------------------

    def tuned(self, problem: Problem, hardware: Hardware) -> TunedRow | None:
        """The newest tuned config of (problem, hardware), of any stack, and its study (`StoreTx.tuned_config`
        without it)."""
        if self._tx.problem_id(problem) is None:
            return None
        found = self._tuned(problems.c.key == problem.key, hardware_t.c.key == hardware.identity().key)
        return max(reversed(found), key=lambda row: row.config.tuned_at) if found else None

    def family_shapes(self, problem: Problem, hardware: Hardware) -> list[tuple[str, int, int, int]]:
        """The tuned problems on ``hardware`` of ``problem``'s collective, dtype and ring size, each once, as
        (key, m, k, n): what a warm start measures distances to (`cmtune.tuner.warm.nearest_keys`), read without
        their configs, so that a family of thousands costs a scan of four columns."""
        query = select(problems.c.key, problems.c.m, problems.c.k, problems.c.n).distinct() \
            .join(tuned_t, tuned_t.c.problem_id == problems.c.id) \
            .join(hardware_t, hardware_t.c.id == tuned_t.c.hardware_id).where(*self._family(problem, hardware))
        return [tuple(row) for row in self._tx.execute(query)]

    def neighbours(self, problem: Problem, hardware: Hardware, keys: Sequence[str]) -> list[Known]:
        """The tuned configs on ``hardware`` of the problems ``keys`` (of ``problem``'s family), each with the
        fastest ring its study's search ran (the lowest ratio, the first trial of equals): the neighbours a warm
        start chooses from (`cmtune.tuner.warm.seeds`), in one statement.  A config without a study was
        imported (a bundle)."""
        if not keys:
            return []
        family = (*self._family(problem, hardware), problems.c.key.in_(list(keys)))
        studies_of_family = select(tuned_t.c.study_id).join(problems, problems.c.id == tuned_t.c.problem_id) \
            .join(hardware_t, hardware_t.c.id == tuned_t.c.hardware_id).where(*family)
        rank = func.row_number().over(partition_by=trials.c.study_id, order_by=(trials.c.ratio, trials.c.number))
        rings = select(trials.c.study_id, trials.c.decomposition_id.label("ring_id"),
                       trials.c.ratio.label("ring_ratio"), rank.label("ring_rank")).where(
            trials.c.study_id.in_(studies_of_family), trials.c.kind == TrialKind.SEARCH,
            trials.c.state == TrialState.COMPLETED, trials.c.status == Status.OK, trials.c.ratio.is_not(None),
            trials.c.decomposition_id != Decomposition.baseline().id).subquery()
        query = tuned_select(*family).add_columns(rings.c.ring_id, rings.c.ring_ratio).outerjoin(
            rings, and_(rings.c.study_id == tuned_t.c.study_id, rings.c.ring_rank == 1))
        return [Known(tuned_config_of(row), decomposition_of(row.ring_id) if row.ring_id else None, row.ring_ratio,
                      source="study" if row.study_id is not None else "bundle", study_id=row.study_id)
                for row in self._tx.execute(query)]

    @staticmethod
    def _family(problem: Problem, hardware: Hardware) -> tuple:
        return (hardware_t.c.key == hardware.identity().key, problems.c.collective == problem.collective,
                problems.c.dtype == problem.dtype, problems.c.axis_size == problem.axis_size)

    def tuned_of_studies(self, study_ids: Sequence[int]) -> dict[int, TunedConfig]:
        """The tuned configs written by these studies."""
        if not study_ids:
            return {}
        return {row.study_id: row.config for row in self._tuned(tuned_t.c.study_id.in_(list(study_ids)))}

    def list_tuned(self, *, platform: str | None = None, device_kind: str | None = None,
                   hardware: str | None = None) -> list[TunedConfig]:
        return [row.config for row in self.tuned_rows(platform=platform, device_kind=device_kind, hardware=hardware)]

    def tuned_rows(self, *, platform: str | None = None, device_kind: str | None = None,
                   hardware: str | None = None) -> list[TunedRow]:
        return self._tuned(*_hardware_filter(platform, device_kind, hardware))

    def _tuned(self, *conditions) -> list[TunedRow]:
        return [TunedRow(tuned_config_of(row), row.study_id) for row in self._tx.execute(tuned_select(*conditions))]

    def overrides(self, *, model: str | None = None, hardware: Hardware | None = None, platform: str | None = None,
                  device_kind: str | None = None) -> list[RoleOverride]:
        """The stored per-role overrides that fit their problems (a misfit is logged and left out)."""
        query = select(overrides_t, *HARDWARE).join(hardware_t, hardware_t.c.id == overrides_t.c.hardware_id)
        if model is not None:
            query = query.where(overrides_t.c.model == model)
        query = query.where(*_hardware_filter(platform, device_kind,
                                              hardware.identity().key if hardware is not None else None))
        found = []
        for r in self._tx.execute(query.order_by(overrides_t.c.model, overrides_t.c.role)):
            try:
                found.append(RoleOverride(
                    model=r.model, role=r.role, hardware=hardware_of(r), configs=OpConfigs.model_validate(r.configs),
                    reason=r.reason, step_speedup=r.step_speedup,
                    problems=None if r.problems is None else {s: Problem.model_validate(p)
                                                              for s, p in r.problems.items()},
                    software=Software.of(r.software) if r.software is not None else None))
            except ValidationError as exc:  # stored before its checks existed: never served
                log.warning("override of %s role %s on %s:%s does not fit its problems, not served: %s",
                            r.model, r.role, r.platform, r.device_kind, exc.errors()[0]["msg"])
        return found


    # --- re-confirmation -----------------------------------------------------------------------

    def reconfirmations(self, hardware: Hardware, software: Software) -> list[StudyRecord]:
        """The re-confirmation studies (any state) on ``hardware`` for the stack ``software``, oldest first."""
        ids = self._tx.execute(select(studies.c.id).join(hardware_t, hardware_t.c.id == studies.c.hardware_id)
                               .where(hardware_t.c.key == hardware.identity().key, studies.c.reconfirm.is_not(None),
                                      studies.c.software_key == software.key).order_by(studies.c.id)).scalars()
        return [self._studies.study(i) for i in ids]

    def step_studies(self, hardware: Hardware, *, software: Software | None = None) -> list[StudyRecord]:
        """The step studies on ``hardware`` (of the stack ``software`` only, where given), newest first."""
        query = select(studies.c.id).join(hardware_t, hardware_t.c.id == studies.c.hardware_id).where(
            hardware_t.c.key == hardware.identity().key, studies.c.kind == StudyKind.STEP.value)
        if software is not None:
            query = query.where(studies.c.software_key == software.key)
        return [self._studies.study(i) for i in self._tx.execute(query.order_by(studies.c.id.desc())).scalars()]


def _hardware_filter(platform: str | None, device_kind: str | None, key: str | None) -> list:
    conditions = []
    if platform:
        conditions.append(hardware_t.c.platform == platform)
    if device_kind:
        conditions.append(hardware_t.c.device_kind == device_kind)
    if key:
        conditions.append(hardware_t.c.key == key)
    return conditions
