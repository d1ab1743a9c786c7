"""What a measured verify tells its command while it runs: typed events, rendered by the command.

The measurement core (`cmtune.workers.stepmeasure.StepSession`, `cmtune.workers.step_rounds.run_step_search`) says
plain lines; `cmtune.workers.verify.verify_step` hands the command each as a `ProgressLine` of a `Level` (what kind of
line it is), and the records it looked up as `RolesResolved` or `SitesTraced`.  The command decides how each looks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collective_matmul.client.report import Report


class Level(StrEnum):
    """What kind of line a `ProgressLine` is."""

    INFO = "info"  # what is measured, what was chosen and written
    DETAIL = "detail"  # a session's progress: compiles, checks, timing
    ROUND = "round"  # the step search: one line per round, and why it stops
    WARNING = "warning"  # something left out
    FAILURE = "failure"  # nothing to write: the search chose nothing


@dataclass(frozen=True)
class ProgressLine:
    """One line of progress."""

    text: str
    level: Level = Level.INFO


@dataclass(frozen=True)
class RolesResolved:
    """The reference block's configs per role as process 0 looked them up: role -> slot -> `Resolved`."""

    resolved: dict


@dataclass(frozen=True)
class SitesTraced:
    """The call sites a user's step traced through the drop-in (its `Tuned` client's report)."""

    sites: Report


Event = ProgressLine | RolesResolved | SitesTraced
Say = Callable[[Event], None]


def quiet(_event: Event) -> None:
    """A `Say` that says nothing (the processes other than 0)."""


def lines(say: Say, level: Level) -> Callable[[str], None]:
    """A plain-line callback handing each line to ``say`` as a `ProgressLine` of ``level``."""
    return lambda text: say(ProgressLine(text, level))
