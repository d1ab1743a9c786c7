"""The study store: the interface the engine works over, its domain records, and the in-memory store.

Like OSS Vizier's datastore and Optuna's `BaseStorage`, the store returns frozen domain records,
never database rows, and knows nothing of the lifecycle: the engine (`cmtune.tuner.engine`) owns
every decision.  Two implementations: `InMemoryStore` here (what `cmtune tune` uses) and the SQL
store of the service (`cmtune.service.store`), both checked by one contract suite
(tests/tuner/test_engine.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

from cmtune.tuner.errors import NotFoundError
from cmtune.tuner.search import SearchSettings
from collective_matmul.planning.decomposition import Decomposition, OpConfigs
from collective_matmul.planning.models import MeshSpec, TransformerBlock
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import (
    BoundsMeasurement,
    Measurement,
    MeasurementProtocol,
    Reconfirmation,
    Status,
    StepChoice,
    StepMeasurement,
    StepVariants,
    StudyKind,
    StudyState,
    TrialKind,
    TrialState,
)
from collective_matmul.wire.bundle import RoleOverride, TunedConfig


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class StepStudySpec:
    """What a step study is of: a submitted model's training step (its block on a mesh), measured once its search
    studies are done (not a user's ``file.py:NAME`` step)."""

    block: TransformerBlock
    mesh: MeshSpec
    depends_on: tuple[int, ...] = ()
    ablation: bool = True
    search_rounds: int = 1  # the step search's budget (`cmtune.tuner.stepsearch`); 1: one round of the menu
    round_variants: int = 3  # changes of one role a search round times

    @property
    def searches(self) -> bool:
        """True if the study searches over several rounds (a step trial per round, then the grading)."""
        return self.search_rounds > 1

    def to_json(self) -> dict:
        return {"block": self.block.model_dump(mode="json"), "mesh": self.mesh.model_dump(mode="json"),
                "depends_on": list(self.depends_on), "ablation": self.ablation, "search_rounds": self.search_rounds,
                "round_variants": self.round_variants}

    @classmethod
    def from_json(cls, data: dict) -> StepStudySpec:
        """A stored spec; one stored before the step search measures one round of the menu, as it did."""
        return cls(TransformerBlock.model_validate(data["block"]), MeshSpec.model_validate(data["mesh"]),
                   tuple(data.get("depends_on", ())), bool(data.get("ablation", True)),
                   int(data.get("search_rounds", 1)), int(data.get("round_variants", 3)))


def step_variants_json(variants: StepVariants | None) -> dict | None:
    """A step trial's variants as trials.variants holds them."""
    if variants is None:
        return None
    return {name: None if setting is None else {role: c.model_dump(mode="json") for role, c in setting.items()}
            for name, setting in variants.items()}


def step_variants_of(data: dict | None) -> StepVariants | None:
    """A step trial's variants from trials.variants (None: the standard menu of its configs)."""
    if data is None:
        return None
    return {name: None if setting is None else {role: OpConfigs.model_validate(c) for role, c in setting.items()}
            for name, setting in data.items()}


@dataclass(frozen=True)
class StudyRecord:
    """One study as stored: its key, settings, state and progress."""

    id: int
    problem: Problem | None  # None for a step study
    hardware: Hardware
    settings: SearchSettings
    protocol: MeasurementProtocol
    space_size: int
    state: StudyState
    created_at: dt.datetime
    stop_reason: str | None = None
    message: str | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    trials_done: int = 0
    best_trial_id: int | None = None
    best_ratio: float | None = None
    kind: StudyKind = StudyKind.SEARCH
    step: StepStudySpec | None = None
    submission_id: int | None = None
    decision: StepChoice | None = None  # a completed step study's (`cmtune.tuner.decision.step_decision`)
    software: Software | None = None  # the stack its trials run on (None: any worker of the hardware)
    reconfirm: Reconfirmation | None = None  # a re-confirmation study's (`Engine.create_reconfirmation`)


@dataclass(frozen=True)
class TrialRecord:
    """One trial as stored; ``measurements`` (and ``bounds``) only when asked for (they are large)."""

    id: int
    study_id: int
    number: int
    kind: TrialKind
    decompositions: tuple[Decomposition, ...]
    state: TrialState
    created_at: dt.datetime
    attempts: int = 0
    status: Status | None = None
    ratio: float | None = None
    measurements: tuple[Measurement, ...] | None = None
    message: str | None = None
    worker_id: int | None = None
    result_lease_id: str | None = None
    finished_at: dt.datetime | None = None
    step: StepMeasurement | None = None  # a step trial's result
    variants: StepVariants | None = None  # a step search round's variants (None: the standard menu)
    bounds: BoundsMeasurement | None = None  # a confirmation's bounds rounds (with ``measurements`` only)

    @property
    def decomposition(self) -> Decomposition:
        """The candidate of a search trial (the baseline, first, of a confirmation)."""
        return self.decompositions[0]

    @property
    def decomposition_id(self) -> str:
        if self.kind == TrialKind.STEP:
            return "step"
        return self.decomposition.id if self.kind == TrialKind.SEARCH else f"confirm:{len(self.decompositions)}"


class StoreTx(Protocol):
    """One transaction of a store: what the engine reads and writes."""

    def add_study(self, *, problem: Problem | None, hardware: Hardware, settings: SearchSettings,
                  protocol: MeasurementProtocol, space_size: int, now: dt.datetime, kind: StudyKind = StudyKind.SEARCH,
                  step: StepStudySpec | None = None, submission_id: int | None = None, software: Software | None = None,
                  reconfirm: Reconfirmation | None = None) -> StudyRecord: ...

    def waiting_step_studies(self, hardware: Hardware) -> list[StudyRecord]:
        """The pending step studies on ``hardware`` (they wait for their search studies), locked."""
        ...

    def active_step_studies(self, hardware: Hardware) -> list[StudyRecord]:
        """The step studies on ``hardware`` that are not final (pending, running or confirming)."""
        ...

    def tuned_config(self, problem: Problem, hardware: Hardware, software: Software | None = None
                     ) -> TunedConfig | None:
        """The tuned config of (problem, hardware) measured on ``software``; without one, the newest of any stack."""
        ...

    def save_overrides(self, model: str, hardware: Hardware, overrides: Sequence[RoleOverride]) -> None:
        """Replace every override of (model, hardware) with ``overrides``."""
        ...

    def study(self, study_id: int, *, lock: bool = False) -> StudyRecord:
        """The study (locked for this transaction if asked); `NotFoundError` if there is none."""
        ...

    def trials(self, study_id: int, *, measurements: bool = False) -> list[TrialRecord]:
        """Every trial of a study in number order."""
        ...

    def trial(self, trial_id: int, *, lock: bool = False) -> TrialRecord: ...

    def add_trials(self, study_id: int, kind: TrialKind, candidates: Sequence[Sequence[Decomposition]],
                   now: dt.datetime, *, after: int | None = None,
                   variants: Sequence[StepVariants | None] | None = None) -> list[TrialRecord]:
        """New pending trials, numbered after the study's last one (``after``, when the caller knows it); a step
        trial with its ``variants`` (one per candidate) where given."""
        ...

    def best_search_trials(self, problem: Problem, hardware: Hardware, *, limit: int) -> list[Decomposition]:
        """The decompositions of ``problem``'s finished ``ok`` search trials on ``hardware`` (every study of it),
        fastest first (each at its best ratio), at most ``limit``."""
        ...

    def claim(self, *, study_ids: Sequence[int] | None, hardware: Hardware | None, worker_id: int | None,
              now: dt.datetime) -> TrialRecord | None:
        """Atomically move the oldest pending trial to leased (attempts + 1, worker set), or None.

        Candidates: trials of ``study_ids``, else of every active study on ``hardware`` or one of its rings
        (`Hardware.rings`: a worker tunes every ring whose size divides its devices; where ``hardware.software``
        is set, only studies of that stack or of none); the oldest study first, then trial number.  Concurrent
        claims never get the same trial.
        """
        ...

    def update_study(self, study_id: int, **changes) -> None:
        """Change a study's progress (``trials_done``, ``best_ratio``, ``best_trial_id``, ``stop_reason``), never
        its state: `TypeError` for ``state`` (see `apply_study_move`)."""
        ...

    def apply_study_move(self, study_id: int, to: StudyState, *, expected: StudyState, **changes) -> bool:
        """The study's state becomes ``to``, with ``changes``, if it is still ``expected`` (one conditional
        statement); whether it moved.  Called by `cmtune.tuner.states.move_study` alone, once `STUDY_MOVES` allows
        the move (tests/tuner/test_engine.py checks that nothing else calls it)."""
        ...

    def apply_trial_move(self, trial_id: int, to: TrialState, *, expected: TrialState, study_id: int,
                         study_changes: dict | None = None, **changes) -> bool:
        """The trial's state becomes ``to``, with ``changes``, if it is still ``expected`` (a trial another
        transaction claimed since this one read it stays as it is); whether it moved.  ``study_changes``
        (progress, as `update_study`) update its study ``study_id`` in the same write (one statement where the
        store can), only if the trial moved.  Called by `cmtune.tuner.states.move_trial` alone, once
        `TRIAL_MOVES` allows the move."""
        ...

    def save_tuned(self, config: TunedConfig, *, study_id: int | None) -> None:
        """Store (or replace) the tuned config of ``config``'s (problem, hardware, software stack): another
        stack's stays."""
        ...


def refuse_state(changes: dict) -> dict:
    """``changes`` of a study's or a trial's columns, refused with `TypeError` if they set a state: states change
    only through the engine's guard (`apply_study_move`, `apply_trial_move`)."""
    if "state" in changes:
        raise TypeError("a state changes only through the engine's guard (cmtune.tuner.states.move_study, "
                        "move_trial)")
    return changes


class Store(Protocol):
    def transaction(self, *, write: bool = False) -> AbstractContextManager[StoreTx]: ...


class InMemoryStore:
    """A store in this process's memory: `cmtune tune` and unit tests.

    Transactions are serialised by one lock and applied at once (no rollback: the engine checks
    before it writes).
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._studies: dict[int, StudyRecord] = {}
        self._trials: dict[int, TrialRecord] = {}
        self._tuned: dict[tuple[str, str, str], TunedConfig] = {}
        self._overrides: dict[tuple[str, str, str], RoleOverride] = {}

    @contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[InMemoryStore]:
        with self._lock:
            yield self

    def add_study(self, *, problem, hardware, settings, protocol, space_size, now, kind=StudyKind.SEARCH, step=None,
                  submission_id=None, software=None, reconfirm=None) -> StudyRecord:
        study = StudyRecord(id=len(self._studies) + 1, problem=problem, hardware=hardware, settings=settings,
                            protocol=protocol, space_size=space_size, state=StudyState.PENDING, created_at=now,
                            kind=kind, step=step, submission_id=submission_id, software=software, reconfirm=reconfirm)
        self._studies[study.id] = study
        return study

    def waiting_step_studies(self, hardware: Hardware) -> list[StudyRecord]:
        return [s for s in self.active_step_studies(hardware) if s.state == StudyState.PENDING]

    def active_step_studies(self, hardware: Hardware) -> list[StudyRecord]:
        return [s for s in self._studies.values() if s.kind == StudyKind.STEP and s.state.active
                and s.hardware.key == hardware.identity().key]

    def tuned_config(self, problem: Problem, hardware: Hardware, software: Software | None = None
                     ) -> TunedConfig | None:
        found = [c for (p, h, s), c in self._tuned.items() if (p, h) == (problem.key, hardware.identity().key)
                 and (software is None or s == software.key)]
        return max(reversed(found), key=lambda c: c.tuned_at) if found else None

    def save_overrides(self, model: str, hardware: Hardware, overrides) -> None:
        key = hardware.identity().key
        self._overrides = {k: v for k, v in self._overrides.items() if (k[0], k[2]) != (model, key)}
        self._overrides.update({o.key: o for o in overrides})

    def study(self, study_id: int, *, lock: bool = False) -> StudyRecord:
        try:
            return self._studies[study_id]
        except KeyError:
            raise NotFoundError(f"study {study_id} does not exist") from None

    def trials(self, study_id: int, *, measurements: bool = False) -> list[TrialRecord]:
        found = sorted((t for t in self._trials.values() if t.study_id == study_id), key=lambda t: t.number)
        return found if measurements else [dataclasses.replace(t, measurements=None, bounds=None) for t in found]

    def trial(self, trial_id: int, *, lock: bool = False) -> TrialRecord:
        try:
            return self._trials[trial_id]
        except KeyError:
            raise NotFoundError(f"trial {trial_id} does not exist") from None

    def add_trials(self, study_id, kind, candidates, now, *, after=None, variants=None) -> list[TrialRecord]:
        number = max((t.number for t in self._trials.values() if t.study_id == study_id), default=0)
        added = []
        for i, configs in enumerate(candidates):
            number += 1
            trial = TrialRecord(id=len(self._trials) + 1, study_id=study_id, number=number, kind=kind,
                                decompositions=tuple(configs), state=TrialState.PENDING, created_at=now,
                                variants=step_variants_of(step_variants_json(variants[i])) if variants else None)
            self._trials[trial.id] = trial
            added.append(trial)
        return added

    def best_search_trials(self, problem: Problem, hardware: Hardware, *, limit: int) -> list[Decomposition]:
        key = hardware.identity().key
        best: dict[Decomposition, float] = {}
        for t in self._trials.values():
            study = self._studies[t.study_id]
            if (t.kind == TrialKind.SEARCH and t.status == Status.OK and t.ratio is not None
                    and study.problem == problem and study.hardware.key == key):
                best[t.decomposition] = min(t.ratio, best.get(t.decomposition, t.ratio))
        return sorted(best, key=lambda d: (best[d], d.id))[:limit]

    def claim(self, *, study_ids=None, hardware=None, worker_id=None, now) -> TrialRecord | None:
        served = {ring.key for ring in hardware.identity().rings()} if hardware is not None else set()
        studies = [s for s in sorted(self._studies.values(), key=lambda s: s.id) if s.state.active
                   and (study_ids is None or s.id in study_ids)
                   and (hardware is None or s.hardware.key in served)
                   and (hardware is None or hardware.software is None or s.software is None
                        or s.software.key == hardware.software.key)]
        for study in studies:
            pending = [t for t in self.trials(study.id) if t.state == TrialState.PENDING]
            if pending:
                self._set_trial(pending[0].id, state=TrialState.LEASED, attempts=pending[0].attempts + 1,
                                worker_id=worker_id)
                return self.trial(pending[0].id)
        return None

    def update_study(self, study_id: int, **changes) -> None:
        self._set_study(study_id, **refuse_state(changes))

    def apply_study_move(self, study_id: int, to: StudyState, *, expected: StudyState, **changes) -> bool:
        if self.study(study_id).state != expected:
            return False
        self._set_study(study_id, state=to, **refuse_state(changes))
        return True

    def apply_trial_move(self, trial_id: int, to: TrialState, *, expected: TrialState, study_id: int,
                         study_changes: dict | None = None, **changes) -> bool:
        refuse_state(study_changes or {})  # before anything changes: this store has no rollback
        refuse_state(changes)
        if self.trial(trial_id).state != expected:
            return False
        self._set_trial(trial_id, state=to, **changes)
        if study_changes:
            self._set_study(study_id, **study_changes)
        return True

    def _set_study(self, study_id: int, **changes) -> None:
        self._studies[study_id] = dataclasses.replace(self.study(study_id), **changes)

    def _set_trial(self, trial_id: int, **changes) -> None:
        self._trials[trial_id] = dataclasses.replace(self.trial(trial_id), **changes)

    def save_tuned(self, config: TunedConfig, *, study_id: int | None) -> None:
        self._tuned.pop(config.key, None)  # the newest last
        self._tuned[config.key] = config
