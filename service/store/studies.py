"""Studies and trials: the engine's store interface (`cmtune.tuner.store.StoreTx`) on SQL, and nothing else.

The hot paths (a claim, a result, a study's history, a new study) are single Core statements, built once at
import and run through `Prepared`.  States change only in `apply_study_move` / `apply_trial_move`, which
the engine's guard calls (`cmtune.tuner.states.move_study` / `move_trial`); `update_study` refuses a state.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
from collections.abc import Sequence

from sqlalchemy import Integer, case, delete, func, insert, null, select, type_coerce, update

from cmtune.service.models import RoleOverrideRow
from cmtune.service.store.base import (
    MEASURED,
    MUTABLE,
    TRIAL,
    Fixed,
    P,
    Tx,
    decomposition_of,
    hardware_t,
    problems,
    studies,
    trial_record,
    trials,
    tuned_config_of,
    tuned_select,
    tuned_t,
)
from cmtune.service.store.leases import Leases
from cmtune.service.store.prepared import Prepared
from cmtune.tuner.errors import NotFoundError
from cmtune.tuner.store import StudyRecord, TrialRecord, refuse_state, step_variants_json
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import ACTIVE_STUDY_STATES, Status, StudyKind, StudyState, TrialKind, TrialState
from collective_matmul.wire.bundle import RoleOverride, TunedConfig

overrides_t = RoleOverrideRow.__table__
log = logging.getLogger(__name__)

_STUDY_SELECT = select(*MUTABLE).where(studies.c.id == P("study_id"))
_STUDY = Prepared(_STUDY_SELECT)
_STUDY_LOCKED = Prepared(_STUDY_SELECT.with_for_update())
_INSERT_STUDY = Prepared(insert(studies).returning(*MUTABLE))
_UPDATE_STUDY = Prepared(update(studies).where(studies.c.id == P("_study_id")))  # SET: the other parameters
# a move: the state changes only from the one the engine checked (``_expected``); the row comes back if it did
_MOVE_STUDY = Prepared(update(studies).where(studies.c.id == P("_study_id"), studies.c.state == P("_expected"))
                       .returning(studies.c.id))

# a study's history: a search trial's candidate comes back from its id, so its JSON is not fetched
_BRIEF = (*TRIAL[:4], type_coerce(case((trials.c.kind == TrialKind.SEARCH.value, null()),
                                       else_=trials.c.decompositions), trials.c.decompositions.type)
          .label("decompositions"), *TRIAL[5:])
_TRIALS = Prepared(select(*_BRIEF).where(trials.c.study_id == P("study_id")).order_by(trials.c.number))
_TRIALS_MEASURED = Prepared(select(*_BRIEF, *MEASURED).where(trials.c.study_id == P("study_id"))
                            .order_by(trials.c.number))
_TRIAL_SELECT = select(*TRIAL, *MEASURED).where(trials.c.id == P("trial_id"))
_TRIAL = Prepared(_TRIAL_SELECT)
_TRIAL_LOCKED = Prepared(_TRIAL_SELECT.with_for_update())
_MOVE_TRIAL = Prepared(update(trials).where(trials.c.id == P("_trial_id"), trials.c.state == P("_expected"))
                       .returning(trials.c.id))
_INSERT_TRIAL = Prepared(insert(trials).returning(trials.c.id))
_NEW_TRIAL = ("study_id", "number", "kind", "decompositions", "decomposition_id", "state", "attempts", "created_at",
              "variants")
# a problem's best search trials on one hardware, over every study of it (the step search's runners-up)
_BEST_SEARCH_TRIALS = select(trials.c.decomposition_id).select_from(trials) \
    .join(studies, studies.c.id == trials.c.study_id).join(problems, problems.c.id == studies.c.problem_id) \
    .join(hardware_t, hardware_t.c.id == studies.c.hardware_id) \
    .where(problems.c.key == P("problem"), hardware_t.c.key == P("hardware"),
           trials.c.kind == TrialKind.SEARCH.value, trials.c.status == Status.OK.value, trials.c.ratio.is_not(None)) \
    .group_by(trials.c.decomposition_id).order_by(func.min(trials.c.ratio), trials.c.decomposition_id) \
    .limit(P("limit", type_=Integer))
_TUNED_ID = Prepared(select(tuned_t.c.id).where(tuned_t.c.problem_id == P("problem_id"),
                                                tuned_t.c.hardware_id == P("hardware_id"),
                                                tuned_t.c.software_key == P("software_key")).with_for_update())
_INSERT_TUNED = Prepared(insert(tuned_t))
_UPDATE_TUNED = Prepared(update(tuned_t).where(tuned_t.c.id == P("_tuned_id")))


@functools.lru_cache(maxsize=64)  # n is at most CMTUNE_READY_PROPOSALS (<= 32) or a new study's first proposals
def _insert_trials(n: int) -> Prepared:
    """``n`` new trials in one statement: parameters ``column_i`` for row i; each row's id and number come
    back (in no promised order)."""
    return Prepared(insert(trials).values([{c: P(f"{c}_{i}", type_=trials.c[c].type) for c in _NEW_TRIAL}
                                           for i in range(n)]).returning(trials.c.id, trials.c.number))


@functools.cache
def _update_trial_and_study(trial_columns: tuple[str, ...], study_columns: tuple[str, ...]) -> Prepared:
    """PostgreSQL: a trial's move and its study's update in one statement (the study's as a data-modifying
    WITH); the values are the parameters ``trial_`` and ``study_`` + column (a parameter named like a
    column would become a SET of that column in both updates).  The trial moves only from ``_expected``
    (its row comes back if it did); the caller rolls back when it did not."""
    study = update(studies).where(studies.c.id == P("_study_id")) \
        .values({name: P(f"study_{name}", type_=studies.c[name].type) for name in study_columns}).cte("study")
    return Prepared(update(trials).where(trials.c.id == P("_trial_id"), trials.c.state == P("_expected"))
                    .values({name: P(f"trial_{name}", type_=trials.c[name].type) for name in trial_columns})
                    .returning(trials.c.id).add_cte(study))


class Studies:
    """The engine's `StoreTx` over one transaction (`Tx`); `SqlTx` adds the store's other rooms."""

    def __init__(self, tx: Tx):
        self._tx = tx
        self.leases = Leases(tx)

    def add_study(self, *, problem, hardware, settings, protocol, space_size, now, kind=StudyKind.SEARCH, step=None,
                  submission_id=None, software=None, reconfirm=None) -> StudyRecord:
        tx = self._tx
        hardware_id = tx.hardware_id(hardware, create=True)
        problem_id = tx.problem_id(problem, create=True) if problem is not None else None
        row = tx.first(_INSERT_STUDY, dict(
            problem_id=problem_id, hardware_id=hardware_id, state=StudyState.PENDING,
            settings=settings.model_dump(mode="json"), protocol=protocol.model_dump(mode="json"),
            space_size=space_size, created_at=now, trials_done=0, kind=kind,
            step=step.to_json() if step is not None else None, submission_id=submission_id,
            software=software.model_dump(mode="json") if software is not None else null(),  # SQL NULL, not JSON null
            software_key=software.key if software is not None else None,
            reconfirm=reconfirm.model_dump(mode="json") if reconfirm is not None else null(),
        ))
        # what never changes is what was just written (no read back)
        tx.store.fixed[row.id] = Fixed(problem, hardware.identity(), hardware_id, problem_id, settings, protocol,
                                       space_size, row.created_at, StudyKind(kind), step, submission_id, software,
                                       reconfirm)
        tx.locked.add(row.id)  # a row this transaction inserted is its own until it commits
        return tx.remember_study(row)

    def study(self, study_id: int, *, lock: bool = False) -> StudyRecord:
        tx = self._tx
        seen = tx.studies.get(study_id)
        if seen is not None and (not lock or study_id in tx.locked):
            return seen
        row = tx.first(_STUDY_LOCKED if lock else _STUDY, {"study_id": study_id})
        if row is None:
            raise NotFoundError(f"study {study_id} does not exist")
        if lock:
            tx.locked.add(study_id)
        return tx.remember_study(row)

    def waiting_step_studies(self, hardware: Hardware) -> list[StudyRecord]:
        return self._step_studies(hardware, [StudyState.PENDING], lock=True)

    def active_step_studies(self, hardware: Hardware) -> list[StudyRecord]:
        return self._step_studies(hardware, sorted(ACTIVE_STUDY_STATES), lock=False)

    def _step_studies(self, hardware: Hardware, states: Sequence[StudyState], *, lock: bool) -> list[StudyRecord]:
        ids = self._tx.execute(select(studies.c.id).join(hardware_t, hardware_t.c.id == studies.c.hardware_id)
                               .where(studies.c.kind == StudyKind.STEP.value,
                                      studies.c.state.in_([state.value for state in states]),
                                      hardware_t.c.key == hardware.identity().key).order_by(studies.c.id)
                               ).scalars().all()
        return [self.study(i, lock=lock) for i in ids]

    def trials(self, study_id: int, *, measurements: bool = False) -> list[TrialRecord]:
        rows = self._tx.rows(_TRIALS_MEASURED if measurements else _TRIALS, {"study_id": study_id})
        return [trial_record(row, measurements) for row in rows]

    def trial(self, trial_id: int, *, lock: bool = False) -> TrialRecord:
        row = self._tx.first(_TRIAL_LOCKED if lock else _TRIAL, {"trial_id": trial_id})
        if row is None:
            raise NotFoundError(f"trial {trial_id} does not exist")
        return trial_record(row, True)

    def add_trials(self, study_id, kind, candidates, now, *, after: int | None = None,
                   variants=None) -> list[TrialRecord]:
        tx = self._tx
        if after is None:
            after = tx.scalar(select(func.max(trials.c.number)).where(trials.c.study_id == study_id)) or 0
        records, stored = [], []
        for i, (number, configs) in enumerate(enumerate(candidates, start=after + 1)):
            configs = tuple(configs)
            if kind == TrialKind.SEARCH and decomposition_of(configs[0].id) != configs[0]:
                raise ValueError(f"{configs[0]!r} does not round-trip through its id {configs[0].id!r}")
            stored.append(step_variants_json(variants[i]) if variants else None)
            records.append(TrialRecord(id=0, study_id=study_id, number=number, kind=kind, decompositions=configs,
                                       state=TrialState.PENDING, created_at=now,
                                       variants=variants[i] if variants else None))
        if not records:
            return []
        rows = [dict(study_id=study_id, number=r.number, kind=kind, decompositions=[
            d.model_dump(mode="json") for d in r.decompositions], decomposition_id=r.decomposition_id,
            state=TrialState.PENDING, attempts=0, created_at=now, variants=v)
            for r, v in zip(records, stored, strict=True)]
        if len(rows) == 1:  # a refill's one proposal
            return [dataclasses.replace(records[0], id=tx.first(_INSERT_TRIAL, rows[0]).id)]
        ids = {number: i for i, number in tx.rows(_insert_trials(len(rows)), {
            f"{column}_{i}": value for i, row in enumerate(rows) for column, value in row.items()})}
        return [dataclasses.replace(r, id=ids[r.number]) for r in records]

    def best_search_trials(self, problem: Problem, hardware: Hardware, *, limit: int) -> list[Decomposition]:
        ids = self._tx.execute(_BEST_SEARCH_TRIALS, {"problem": problem.key, "hardware": hardware.identity().key,
                                                     "limit": limit}).scalars().all()
        return [decomposition_of(i) for i in ids]

    def claim(self, *, study_ids=None, hardware=None, worker_id=None, now) -> TrialRecord | None:
        return self.leases.claim(study_ids=study_ids, hardware=hardware, worker_id=worker_id,
                                 software=hardware.software if hardware is not None else None)

    def update_study(self, study_id: int, **changes) -> None:
        self._update_study(study_id, refuse_state(changes))

    def apply_study_move(self, study_id: int, to: StudyState, *, expected: StudyState, **changes) -> bool:
        self._tx.studies.pop(study_id, None)
        changes = _study_columns({"state": to, **refuse_state(changes)})
        return bool(self._tx.rows(_MOVE_STUDY, {"_study_id": study_id, "_expected": expected, **changes}))

    def _update_study(self, study_id: int, changes: dict) -> None:
        self._tx.studies.pop(study_id, None)
        self._tx.rows(_UPDATE_STUDY, {"_study_id": study_id, **_study_columns(changes)})

    def apply_trial_move(self, trial_id: int, to: TrialState, *, expected: TrialState, study_id: int,
                         study_changes: dict | None = None, **changes) -> bool:
        tx = self._tx
        trial_changes = _trial_columns({"state": to, **refuse_state(changes)})
        move = {"_trial_id": trial_id, "_expected": expected}
        if not study_changes:
            return bool(tx.rows(_MOVE_TRIAL, {**move, **trial_changes}))
        study_changes = _study_columns(refuse_state(study_changes))
        if not tx.is_postgres:  # SQLite: no writes inside WITH
            moved = bool(tx.rows(_MOVE_TRIAL, {**move, **trial_changes}))
            if moved:
                self._update_study(study_id, study_changes)
            return moved
        tx.studies.pop(study_id, None)
        return bool(tx.rows(_update_trial_and_study(tuple(trial_changes), tuple(study_changes)),
                            {**move, **{f"trial_{k}": v for k, v in trial_changes.items()},
                             "_study_id": study_id, **{f"study_{k}": v for k, v in study_changes.items()}}))

    def tuned_config(self, problem: Problem, hardware: Hardware, software: Software | None = None
                     ) -> TunedConfig | None:
        if self._tx.problem_id(problem) is None:
            return None
        conditions = [problems.c.key == problem.key, hardware_t.c.key == hardware.identity().key]
        if software is not None:
            conditions.append(tuned_t.c.software_key == software.key)
        row = self._tx.execute(tuned_select(*conditions).order_by(None).order_by(
            tuned_t.c.updated_at.desc(), tuned_t.c.id.desc()).limit(1)).first()
        return tuned_config_of(row) if row is not None else None

    def save_tuned(self, config: TunedConfig, *, study_id: int | None) -> None:
        tx = self._tx
        problem_id = tx.problem_id(config.problem, create=True)
        hardware_id = tx.hardware_id(config.hardware, create=True)
        values = dict(
            decomposition=config.decomposition.model_dump(mode="json"), time_s=config.time_s,
            baseline_s=config.baseline_s, speedup=config.speedup, speedup_iqr=config.speedup_iqr,
            trials=config.trials, invalid=config.invalid, failed=config.failed, space_size=config.space_size,
            software=config.software.model_dump(mode="json"),
            updated_at=dt.datetime.now(dt.UTC), study_id=study_id, compute_s=config.compute_s,
            communication_s=config.communication_s, bounds_baseline_s=config.bounds_baseline_s,
            overlap=config.overlap, memory_bytes=config.memory_bytes,
        )
        key = config.software.key
        existing = tx.first(_TUNED_ID, {"problem_id": problem_id, "hardware_id": hardware_id, "software_key": key})
        if existing is None:
            tx.rows(_INSERT_TUNED, dict(problem_id=problem_id, hardware_id=hardware_id, software_key=key, **values))
        else:
            tx.rows(_UPDATE_TUNED, {"_tuned_id": existing.id, **values})

    def save_overrides(self, model: str, hardware: Hardware, overrides: Sequence[RoleOverride]) -> None:
        tx = self._tx
        hardware_id = tx.hardware_id(hardware, create=True)
        tx.execute(delete(overrides_t).where(overrides_t.c.model == model, overrides_t.c.hardware_id == hardware_id))
        for o in overrides:
            tx.execute(insert(overrides_t).values(
                model=model, role=o.role, hardware_id=hardware_id, configs=o.configs.model_dump(mode="json"),
                problems=None if o.problems is None else {s: p.model_dump(mode="json") for s, p in o.problems.items()},
                reason=o.reason, step_speedup=o.step_speedup, updated_at=dt.datetime.now(dt.UTC),
                software=o.software.model_dump(mode="json") if o.software is not None else None))


def _study_columns(changes: dict) -> dict:
    """A study's changes as its columns hold them (a step study's decision as JSON)."""
    if changes.get("decision") is not None:
        return changes | {"decision": changes["decision"].model_dump(mode="json")}
    return changes


def _trial_columns(changes: dict) -> dict:
    """A trial's changes as its columns hold them (measurements, a step result and bounds as JSON)."""
    changes = dict(changes)
    if changes.get("measurements") is not None:
        changes["measurements"] = [m.model_dump(mode="json") for m in changes["measurements"]]
    if changes.get("step") is not None:  # a step trial's result lives where the measurements do
        changes["measurements"] = [changes.pop("step").model_dump(mode="json")]
    changes.pop("step", None)
    if changes.get("bounds") is not None:
        changes["bounds"] = changes["bounds"].model_dump(mode="json")
    return changes
