"""`cmtune verify` on devices, for the reference block and a user's step alike: process 0 looks the configs up and
shares them, every process measures (or searches the step and writes the overrides), process 0 returns the result.

`verify_step` is the one pipeline; what differs between the reference block (`cmtune.workers.step.BlockVerify`) and
a user's step (`cmtune.workers.userstep.UserVerify`) is a `VerifyTarget`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from cmtune.workers.overrides import SearchBudget, StepPlan, search_and_write_overrides
from cmtune.workers.progress import Event, Level, ProgressLine, Say, lines, quiet

if TYPE_CHECKING:
    from pydantic import BaseModel

    from cmtune.workers.stepmeasure import StepSession
    from collective_matmul.wire import StepMeasurement


class VerifyTarget(Protocol):
    """What a kind of step supplies to `verify_step`.  Every process calls the hooks in the same order, but those
    marked "process 0" are called there alone."""

    found: type[BaseModel]  # the wire record process 0 shares of the configs it looked up

    def start(self, leader: bool) -> None:
        """Every process, first: what must be built before process 0 looks the configs up."""

    def look_up(self) -> BaseModel:
        """Process 0: the configs, as the record to share."""

    def shown(self, found: BaseModel) -> list[Event]:
        """Process 0: what to show of what it looked up."""

    def follow(self, found: BaseModel, leader: bool) -> StepSession:
        """Every process: take what process 0 found; the session to measure with."""

    def variants(self, found: BaseModel) -> dict:
        """The variants to measure without a search: name -> the session's config source."""

    def announce(self, found: BaseModel, variants: Mapping | None, budget: SearchBudget | None) -> list[ProgressLine]:
        """What process 0 says before measuring ``variants`` (None: before the search of ``budget``)."""

    def plan(self, found: BaseModel) -> StepPlan:
        """Process 0: what the step search searches."""

    def sources(self, found: BaseModel) -> Callable[[Mapping], dict]:
        """A search round's variants (name -> per-role configs, None: the step as written) as config sources."""

    def measure_options(self, found: BaseModel) -> dict:
        """What `StepSession.measure` takes besides the variants (a user's step: its ``axis``)."""


def verify_step(target: VerifyTarget, *, budget: SearchBudget | None, bundle: Path | None,
                say: Say) -> StepMeasurement | None:
    """Measure ``target``'s step with the configs process 0 looks up, against the step as written; with ``budget``,
    search the step instead and write the tuner's choice as per-role overrides into ``bundle``
    (`cmtune.workers.overrides.search_and_write_overrides`).

    Every process of the group calls this together; ``say`` is called on process 0 alone.

    Returns:
        On process 0 the step measurement (with a search: its first round, the grading rounds as its
        confirmation); None on the others.

    Raises:
        What ``target`` raises when what process 0 found cannot be measured (a user's step without a drop-in call).
    """
    from cmtune.workers.cluster import Group

    group = Group()
    say = say if group.leader else quiet
    target.start(group.leader)
    found = None
    if group.leader:  # process 0 looks the configs up; the others run what it found
        found = target.look_up()
        for event in target.shown(found):
            say(event)
    found = group.share(found, target.found)
    session = target.follow(found, group.leader)
    options = target.measure_options(found)
    if budget is not None:
        for line in target.announce(found, None, budget):
            say(line)
        result = search_and_write_overrides(group, session, lambda: target.plan(found), target.sources(found),
                                            bundle=bundle, budget=budget, say=say, **options)
    else:
        variants = target.variants(found)
        for line in target.announce(found, variants, None):
            say(line)
        result = session.measure(variants, on_event=lines(say, Level.DETAIL), **options)
    return result if group.leader else None
