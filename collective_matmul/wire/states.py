"""The lifecycle's states and outcomes: Enums the engine moves between and the database constrains alike."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class StudyState(StrEnum):
    """pending → running → confirming → completed; or failed / cancelled (final)."""

    PENDING = "pending"
    RUNNING = "running"
    CONFIRMING = "confirming"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        return self in ACTIVE_STUDY_STATES


ACTIVE_STUDY_STATES = frozenset({StudyState.PENDING, StudyState.RUNNING, StudyState.CONFIRMING})


class TrialState(StrEnum):
    """pending → leased → completed | failed; cancelled with its study."""

    PENDING = "pending"
    LEASED = "leased"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def in_flight(self) -> bool:
        return self in (TrialState.PENDING, TrialState.LEASED)


class TrialKind(StrEnum):
    """What a trial times: one search candidate, the confirmation round of the top ones, or a whole
    training step (the step study of a submitted model)."""

    SEARCH = "search"
    CONFIRM = "confirm"
    STEP = "step"


class StudyKind(StrEnum):
    """A search over one problem's decompositions, or the step measurement of a submitted model."""

    SEARCH = "search"
    STEP = "step"


class StopReason(StrEnum):
    """Why a study stopped searching, or how it ended (a study's ``stop_reason``, stored as its value).

    A step study's search stops at its budget of rounds or after a full pass over the roles that changed nothing
    (`cmtune.tuner.stepsearch.StepSearch.plan` says which in words).
    """

    TRIAL_BUDGET = "trial budget"
    TIME_BUDGET = "time budget"
    NO_IMPROVEMENT = "no improvement"
    NEIGHBOURS_AGREE = "neighbours agree"  # a warm-started search learnt what its neighbours predicted
    EXHAUSTED = "exhausted"
    BASELINE_FAILED = "baseline failed"
    CANCELLED = "cancelled"
    MEASURED = "measured"  # a step study of one round, graded by its worker
    RECONFIRMED = "re-confirmed"  # a re-confirmation whose stored winner won again
    REPLACED = "replaced"  # a re-confirmation that a new winner decided
    STEP_BUDGET = "step budget"  # a step search that spent its rounds
    NOTHING_LEFT = "nothing left to try"  # a step search whose full pass over the roles changed nothing


class Status(StrEnum):
    """The outcome of timing one candidate (every failure is a result, never a crash)."""

    OK = "ok"
    INVALID = "invalid"
    COMPILE_ERROR = "compile_error"
    OOM = "oom"
    TIMEOUT = "timeout"
    ERROR = "error"


Outcome = Literal["waiting", "re-confirmed", "replaced", "failed", "cancelled"]


def reconfirm_outcome(state: StudyState, stop_reason: str | None) -> Outcome:
    """What became of a re-confirmation: still waiting (for a worker of its stack), the same config
    re-confirmed, replaced by a new winner, or failed / cancelled."""
    if state.active:
        return "waiting"
    if state == StudyState.COMPLETED:
        return "replaced" if stop_reason == StopReason.REPLACED else "re-confirmed"
    return "failed" if state == StudyState.FAILED else "cancelled"
