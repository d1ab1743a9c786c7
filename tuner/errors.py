"""Domain errors of the study lifecycle; the service maps each to its HTTP status in one place."""

from __future__ import annotations


class CmtuneError(Exception):
    """A request the domain refuses; ``message`` says what to fix."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NotFoundError(CmtuneError):
    """No such study, trial, worker, submission or lease."""


class ConflictError(CmtuneError):
    """The request clashes with the stored state (a stale lease, a final study, a duplicate)."""


class InvalidError(CmtuneError):
    """Well-formed but unusable input (a result for another candidate, a bad transition)."""
