"""Re-confirmation on a software upgrade: what a worker's registration queues (`on_register`).

A tuned config is a measurement of one program on one software stack.  When a worker registers with
a stack the service holds configs for only under other stacks of its hardware, each such config (the
newest of its problem) is re-timed on the new stack by a re-confirmation study
(`Engine.create_reconfirmation`: the stored winner, its runner-up and the baseline in one confirmation
round, leased only to workers of that stack).  It is then re-confirmed (the same decomposition, now
``exact`` for the new stack) or replaced by the new winner.  A model with per-role overrides on that
hardware decided on another stack has its step measured again on the new stack (a step study made as
a submission makes it, waiting for those re-confirmations), once per stack.  The old stack's configs
stay, served to old-stack look-ups.

Idempotent: a (problem, stack) is re-confirmed once, whatever became of it (a failed one is tuned afresh
by submitting the problem with ``force``), so a second worker of the same stack, or one that restarts,
queues nothing.  Registrations of one hardware are serialised (`Submissions.lock_hardware`).
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cmtune.tuner.engine import Engine
from cmtune.tuner.errors import InvalidError
from cmtune.tuner.store import StudyRecord
from collective_matmul.planning.models import role_problems
from collective_matmul.planning.problem import Hardware, Software

if TYPE_CHECKING:
    from cmtune.service.store import SqlTx, TunedRow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Queued:
    """What one registration queued: re-confirmation studies and models' step studies."""

    reconfirmations: list[StudyRecord] = field(default_factory=list)
    steps: list[StudyRecord] = field(default_factory=list)


def on_register(tx: SqlTx, engine: Engine, hardware: Hardware, software: Software, *, now: dt.datetime) -> Queued:
    """Queue the re-confirmations (and the models' steps) a worker of ``software`` on ``hardware`` brings, on its
    hardware and on each of its rings (`Hardware.rings`: it leases their trials too).

    A worker that names no jax version queues nothing: its stack cannot be told from another.
    """
    if not software.jax:
        return Queued()
    whole, *rings = hardware.identity().rings()
    known = [ring for ring in rings if tx.catalog.known(ring)]  # a ring never studied holds nothing
    queued = [_on_ring(tx, engine, ring, software, now=now) for ring in (whole, *known)]
    return Queued([s for q in queued for s in q.reconfirmations], [s for q in queued for s in q.steps])


def _on_ring(tx: SqlTx, engine: Engine, hardware: Hardware, software: Software, *, now: dt.datetime) -> Queued:
    """`on_register` on one of the worker's rings (or its whole hardware)."""
    tx.submissions.lock_hardware(hardware)  # two workers of a new stack at once: the second sees the first's
    done = {s.problem.key for s in tx.catalog.reconfirmations(hardware, software)}
    newest: dict[str, TunedRow] = {}  # problem key -> its newest config of another stack
    for row in tx.catalog.tuned_rows(hardware=hardware.identity().key):
        key = row.config.problem.key
        if row.config.software.key == software.key:
            done.add(key)  # measured on this stack already
        elif key not in newest or row.config.tuned_at >= newest[key].config.tuned_at:
            newest[key] = row
    queued = []
    for key, row in newest.items():
        if key in done:
            continue
        try:
            queued.append(engine.create_reconfirmation(tx, config=row.config, software=software, now=now,
                                                       study_id=row.study_id))
        except InvalidError as exc:  # e.g. an imported config of a problem no ring fits
            log.info("not re-confirming %s on %s: %s", key, software, exc.message)
    steps = _steps_again(tx, engine, hardware, software, now=now)
    if queued or steps:
        log.info("worker of %s on %s: %d config(s) to re-confirm, %d model step(s) to measure again", software,
                 hardware.key, len(queued), len(steps))
    return Queued(queued, steps)


def _steps_again(tx: SqlTx, engine: Engine, hardware: Hardware, software: Software, *,
                 now: dt.datetime) -> list[StudyRecord]:
    """A step study on ``software`` for each model with overrides on ``hardware`` decided on another stack
    (overrides of an unrecorded stack, from before stacks were: where some of the model's problems are
    re-confirmed on ``software``), whose step the service measured (its newest step study gives the block, mesh
    and protocol) and has not measured on ``software``; it waits for the re-confirmations of its problems.  A
    user's own step (`cmtune verify --step`) is measured where it runs."""
    decided: dict[str, set[str | None]] = {}  # model -> the stacks its overrides were decided on (None: unknown)
    for override in tx.catalog.overrides(hardware=hardware):
        decided.setdefault(override.model, set()).add(override.software.key if override.software else None)
    if not decided:
        return []
    measured: dict[str, StudyRecord] = {}
    again: set[str] = set()
    for study in tx.catalog.step_studies(hardware):  # newest first
        name = study.step.block.name
        if study.software is not None and study.software.key == software.key:
            again.add(name)
        measured.setdefault(name, study)
    reconfirming = {s.problem.key: s.id for s in tx.catalog.reconfirmations(hardware, software)}
    created = []
    for model, stacks in decided.items():
        last = measured.get(model)
        if last is None or model in again or stacks == {software.key}:
            continue
        spec = last.step
        keys = {p.key for slots in role_problems(spec.block, spec.mesh).values() for p in slots.values()}
        waits_for = sorted(reconfirming[k] for k in keys if k in reconfirming)
        if stacks == {None} and not waits_for:
            continue  # decided on an unrecorded stack, and nothing of the model is re-confirmed on this one
        created.append(engine.create_step_study(
            tx, block=spec.block, mesh=spec.mesh, hardware=hardware, now=now, protocol=last.protocol,
            depends_on=waits_for, submission_id=last.submission_id, ablation=spec.ablation, software=software,
            search_rounds=spec.search_rounds, round_variants=spec.round_variants))
    return created
