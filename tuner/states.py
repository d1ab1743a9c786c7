"""The study and trial states' moves, and the one guard on them.

Every state change goes through `move_study` / `move_trial`, which refuse transitions that are not in
`STUDY_MOVES` / `TRIAL_MOVES` (`check_study_move`, `check_trial_move`; the database's CHECK constraints hold the
same states) and are the only callers of the store's `apply_study_move` / `apply_trial_move`: a move is one
conditional write from the state it was read in.  A store's claim (pending to leased, in one statement) checks
the same table.  Why a study stopped is a `StopReason` (`collective_matmul.wire`, where the API reads it too).
"""

from __future__ import annotations

from cmtune.tuner.errors import ConflictError
from cmtune.tuner.store import StoreTx, StudyRecord, TrialRecord
from collective_matmul.wire import StopReason, StudyState, TrialState

__all__ = ["STUDY_MOVES", "TRIAL_MOVES", "StopReason", "check_study_move", "check_trial_move", "move_study",
           "move_trial"]

S, T = StudyState, TrialState
STUDY_MOVES: dict[StudyState, frozenset[StudyState]] = {
    S.PENDING: frozenset({S.RUNNING, S.CONFIRMING, S.COMPLETED, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.CONFIRMING, S.COMPLETED, S.FAILED, S.CANCELLED}),
    S.CONFIRMING: frozenset({S.COMPLETED, S.FAILED, S.CANCELLED}),
}
TRIAL_MOVES: dict[TrialState, frozenset[TrialState]] = {
    T.PENDING: frozenset({T.LEASED, T.FAILED, T.CANCELLED}),
    T.LEASED: frozenset({T.PENDING, T.COMPLETED, T.FAILED, T.CANCELLED}),
}


def check_study_move(study_id: int, state: StudyState, to: StudyState) -> None:
    """`ConflictError` unless `STUDY_MOVES` lets a study in ``state`` become ``to``."""
    if to not in STUDY_MOVES.get(state, ()):
        raise ConflictError(f"study {study_id} is {state}; it cannot become {to}")


def check_trial_move(trial_id: int | None, state: TrialState, to: TrialState) -> None:
    """`ConflictError` unless `TRIAL_MOVES` lets a trial in ``state`` become ``to`` (``trial_id`` None: the
    move of a claim, whichever trial it takes)."""
    if to not in TRIAL_MOVES.get(state, ()):
        raise ConflictError(f"trial {'' if trial_id is None else f'{trial_id} '}is {state}; it cannot become {to}")


def move_study(tx: StoreTx, study: StudyRecord, to: StudyState, *, strict: bool = True, **changes) -> bool:
    """Move a study along `STUDY_MOVES` from the state ``study`` was read in, with ``changes``.

    Returns:
        whether it moved (another transaction may have moved it since).

    Raises:
        ConflictError: the move is not in `STUDY_MOVES`; or, if ``strict``, the study is no longer in the state
            it was read in.
    """
    check_study_move(study.id, study.state, to)
    moved = tx.apply_study_move(study.id, to, expected=study.state, **changes)
    if strict and not moved:
        raise ConflictError(f"study {study.id} is no longer {study.state}; it cannot become {to}: try again")
    return moved


def move_trial(tx: StoreTx, trial: TrialRecord, to: TrialState | None = None, *, strict: bool = True,
               study_changes: dict | None = None, **changes) -> bool:
    """Move a trial along `TRIAL_MOVES` from the state ``trial`` was read in, with ``changes`` (``to`` may come
    as ``changes["state"]``); ``study_changes`` update its study in the same write.

    Returns:
        whether it moved (another transaction may have claimed it since).

    Raises:
        ConflictError: the move is not in `TRIAL_MOVES`; or, if ``strict``, the trial is no longer in the state
            it was read in.
    """
    to = changes.pop("state", to)
    check_trial_move(trial.id, trial.state, to)
    moved = tx.apply_trial_move(trial.id, to, expected=trial.state, study_id=trial.study_id,
                                study_changes=study_changes, **changes)
    if strict and not moved:
        raise ConflictError(f"trial {trial.id} is no longer {trial.state}; it cannot become {to}: try again")
    return moved
