"""The whole-step measurement protocol: one session for the reference block's step and a user's own.

A *variant* of a step is a config source (or the step as written); a `StepSession` runs the
protocol of `cmtune.workers.measure` over a set of them, the reference first:

1. Every variant's step is compiled ahead of time: compile seconds, compiled memory and the
   per-role configs it used are recorded; a failure to build or compile is the variant's status
   (``compile_error``, ``oom``).  A program compiled before is reused with what was recorded then.
2. Every variant runs one step from the reference's arguments and its outputs are checked against
   the reference's by dtype; one that disagrees is ``invalid`` and is not timed; none is checked
   when the reference fails.
3. The variants that passed are timed together (`interleave`): warm-up, then rounds, each in its
   own seeded order (`cmtune.workers.rounds.round_order`), a barrier before each run with several processes, the
   slowest process counting.

Every process must make the same calls; after each compile and each check every process agrees
(`any_process`): a variant that fails on one process fails on all.  What differs between the
reference block (`cmtune.workers.step.BlockStep`) and a user's step (`cmtune.workers.userstep.UserStep`)
is the session's `StepKind`: how a variant's step is built, keyed and lowered, how its check runs
and compares, how its timed runs are fed, and what its record says besides the variants.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cmtune.tuner.variants import REFERENCE
from cmtune.workers.rounds import any_process, time_rounds
from collective_matmul.planning.decomposition import OpConfigs
from collective_matmul.wire import MeasurementProtocol, Status, StepMeasurement, StepVariant, Timing, quartiles

if TYPE_CHECKING:
    from jax.sharding import Mesh

MAX_COMPILED = 32  # compiled step programs a session keeps


@dataclass(frozen=True)
class Check:
    """What one checking step of a variant gave (`StepKind.check_run`)."""

    value: object  # what the kind compares (`StepKind.agrees`) and feeds its timed runs (`StepKind.timed_run`)
    loss: float | None = None  # the step's loss, for the variant's record
    rel_error: float | None = None  # the record's relative error where the check alone tells it (the reference's)


@dataclass(frozen=True)
class Agreement:
    """A variant's check against the reference's (`StepKind.agrees`): its worst relative error, and why it is
    ``invalid`` where it is."""

    rel_error: float | None = None
    invalid: str | None = None  # None: it agrees

    @property
    def ok(self) -> bool:
        return self.invalid is None


class StepKind(ABC):
    """What a kind of step says to a `StepSession`: how a variant is built, checked and fed, and what its record
    says.  The four hooks with a body serve any kind; the abstract ones are each kind's own."""

    mesh: Mesh  # the step's mesh (its devices are the record's hardware)
    # the message of a variant left unchecked because the reference failed (formatted with ``reference``)
    not_checked = "not checked: the reference {reference!r} failed"

    def program_key(self, source) -> Hashable:
        """What identifies the program ``source`` compiles to (here: the source object itself)."""
        return "source", id(source)  # the session's cache keeps the source alive, so its id is not reused

    def tracer(self, source):
        """What the step is traced with for ``source`` (here: ``source`` itself)."""
        return source

    @abstractmethod
    def lowering(self, tracer) -> Callable[[], Any]:
        """Build the variant's step (not timed; may raise) and return its lowering (timed with its compile)."""

    def compiler_options(self, tracer) -> Mapping[str, object] | None:
        """The XLA compile options of the variant (here: none, XLA's defaults)."""
        return None

    @abstractmethod
    def used(self, tracer) -> dict[str, OpConfigs]:
        """The per-role configs the variant's step used, as far as its build went."""

    def compile_failure(self, exc: Exception) -> str:
        """What a variant that failed to build or compile says."""
        from cmtune.workers.measure import error_message

        return error_message(exc)

    @abstractmethod
    def check_run(self, executable, expected: Check | None) -> Check:
        """Run one step of a variant to check it (``expected``: the reference's, None for the reference itself).

        Raises what the step raises."""

    @abstractmethod
    def agrees(self, got: Check, expected: Check, reference: str) -> Agreement:
        """Compare a variant's check with the reference's (``reference``: its name, for the message)."""

    @abstractmethod
    def timed_run(self, executable, got: Check) -> Callable[[], object]:
        """One timed step of a checked variant (``got``: its check), on the arguments it is fed."""

    @abstractmethod
    def record_fields(self, **options) -> dict:
        """The `StepMeasurement` fields of this kind (what the step is, its tensor and batch axes), from the
        options `StepSession.measure` was given besides the variants."""


class StepSession:
    """The protocol over variants of one step, its kind (`StepKind`) saying how the step is built, checked and fed.

    Works in one process or across a `jax.distributed` cluster (every process must make the
    same calls in the same order, with the same variants).  What the session does not hold
    (a block's parameters and inputs, a user's built steps) its ``kind`` does.  Made for the reference block by
    `cmtune.workers.step.block_session`, for a user's step by `cmtune.workers.userstep.user_step_session`.

    Args:
        kind: the step (`cmtune.workers.step.BlockStep`, `cmtune.workers.userstep.UserStep`).
        protocol: warm-up, repeats (rounds), seed and timeout.
    """

    def __init__(self, kind: StepKind, *, protocol: MeasurementProtocol = MeasurementProtocol()):
        from collective_matmul.planning.problem import Hardware

        self.kind, self.protocol = kind, protocol
        self.hardware = Hardware.detect(kind.mesh.devices.flat)
        # program (`StepKind.program_key`) -> (source, executable, record fields): a variant measured again (the
        # confirmation after a decision, the incumbent of every search round) is not compiled again
        self._compiled: dict[Hashable, tuple[object, object, dict]] = {}

    def measure(self, variants: Mapping, *, reference: str = REFERENCE, protocol: MeasurementProtocol | None = None,
                on_event: Callable[[str], None] | None = None, **options) -> StepMeasurement:
        """Run the protocol for every variant; failures come back as variant statuses.

        Args:
            variants: name -> config source, as the kind takes it, in the order to run them.
            reference: the variant every other one is checked and timed against.
            protocol: changes the warm-up, repeats and timeout (not the seed: the inputs are
                this session's).
            on_event: called with a line of progress (compiles, checks, timing).
            options: what the kind's record takes (`StepKind.record_fields`: a user's step its ``axis``).

        Raises:
            ValueError: if ``reference`` is not one of ``variants``.
        """
        protocol = protocol or self.protocol
        results = self.measure_variants(variants, reference=reference, protocol=protocol, on_event=on_event)
        return StepMeasurement(mesh={str(name): int(size) for name, size in self.kind.mesh.shape.items()},
                               hardware=self.hardware, protocol=protocol, reference=reference, variants=results,
                               **self.kind.record_fields(**options))

    def measure_variants(self, variants: Mapping, *, reference: str, protocol: MeasurementProtocol,
                         on_event: Callable[[str], None] | None = None) -> list[StepVariant]:
        """Run the protocol for every variant (name -> config source), in the order given.

        Args:
            variants: name -> config source, as the kind takes it.
            reference: the variant every other one is checked and timed against.
            protocol: the warm-up, repeats and timeout of the timed rounds.
            on_event: called with a line of progress (compiles, checks, timing).

        Returns:
            One record per variant, in the order of ``variants``; failures are their statuses.

        Raises:
            ValueError: if ``reference`` is not one of ``variants``.
        """
        if reference not in variants:
            raise ValueError(f"the reference variant {reference!r} is not among {list(variants)}")
        say = on_event or (lambda _line: None)
        started = time.monotonic()
        order = [reference, *(name for name in variants if name != reference)]
        records: dict[str, dict] = {name: {"name": name} for name in order}
        compiled = {}
        for name in order:
            executable = self._compile(name, variants[name], records[name], say)
            if _agreed(executable is not None, records[name]):  # every process runs the same variants, or none
                compiled[name] = executable
        runs = self._check(compiled, records, reference, say)
        say(f"checked {len(runs)} of {len(order)} variants against {reference!r}")
        if runs:
            interleave(runs, records, reference, started, protocol, say)
        return [StepVariant(**records[name]) for name in variants]

    def _compile(self, name: str, source, record: dict, say):
        """Build and compile one variant's step ahead of time; None if either fails.

        A program this session compiled before (`StepKind.program_key`) is reused, with the compile time,
        memory and configs recorded then.
        """
        from cmtune.workers.measure import classify_failure, compiled_memory

        key = self.kind.program_key(source)
        cached = self._compiled.get(key)
        if cached is not None:
            record.update(cached[2])
            say(f"{name}: compiled before in {record['compile_s']:.1f}s")
            return cached[1]
        tracer = self.kind.tracer(source)
        try:
            lower = self.kind.lowering(tracer)
            start = time.perf_counter()
            executable = lower().compile(compiler_options=self.kind.compiler_options(tracer))
            record["compile_s"] = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - any failure to build or compile is a result
            oom = classify_failure(exc) == Status.OOM
            record.update(status=Status.OOM if oom else Status.COMPILE_ERROR, message=self.kind.compile_failure(exc),
                          configs=self.kind.used(tracer))
            say(f"{name}: {record['status']}")
            return None
        record.update(memory_bytes=compiled_memory(executable), configs=self.kind.used(tracer))
        say(f"{name}: compiled in {record['compile_s']:.1f}s")
        if len(self._compiled) >= MAX_COMPILED:  # the oldest program goes first (a long search times many)
            self._compiled.pop(next(iter(self._compiled)))
        self._compiled[key] = (source, executable, {field: record[field] for field in ("compile_s", "memory_bytes",
                                                                                       "configs")})
        return executable

    def _check(self, compiled: dict, records: dict, reference: str, say) -> dict[str, Callable[[], object]]:
        """One step of every compiled variant, compared with the reference's; the timed run of each that agrees.

        Every process keeps the same variants: one that fails or disagrees on any process is
        dropped on all.
        """
        from cmtune.workers.measure import classify_failure, error_message

        runs: dict[str, Callable[[], object]] = {}
        expected = None
        for name in [reference, *(n for n in compiled if n != reference)]:
            if name not in compiled:
                continue
            if expected is None and name != reference:
                records[name].update(status=Status.ERROR, message=self.kind.not_checked.format(reference=reference))
                continue
            ok, got = False, None
            try:
                got = self.kind.check_run(compiled[name], expected)
                records[name]["loss"] = got.loss
                if got.rel_error is not None:
                    records[name]["rel_error"] = got.rel_error
                if name == reference:
                    expected, ok = got, True
                else:
                    agreement = self.kind.agrees(got, expected, reference)
                    records[name]["rel_error"] = agreement.rel_error
                    if not agreement.ok:
                        records[name].update(status=Status.INVALID, message=agreement.invalid)
                    ok = agreement.ok
            except Exception as exc:  # noqa: BLE001 - a step that fails or returns something else is a result
                records[name].update(status=classify_failure(exc), message=error_message(exc))
            if not _agreed(ok, records[name]):
                if name == reference:
                    expected = None
                continue
            runs[name] = self.kind.timed_run(compiled[name], got)
        return runs


def _agreed(ok: bool, record: dict) -> bool:
    """True if ``ok`` on every process; a variant that failed on another process only fails here too."""
    if not any_process(not ok):
        return True
    if ok or "status" not in record:
        record.update(status=Status.ERROR, message="failed on another process of the group")
    return False


def interleave(runs: Mapping[str, Callable[[], object]], records: dict[str, dict], reference: str, started: float,
               protocol: MeasurementProtocol, say: Callable[[str], None]) -> None:
    """Time ``runs`` together (`cmtune.workers.rounds.time_rounds`: warm-up, then one synchronised step a call, each
    round in its own order) and fill in the records.

    Each call is timed from a barrier (with several processes) to `block_until_ready` of what it
    returns; the slowest process's time counts.  A run that raises leaves the rotation with its
    failure as its status.  Every process must call this together, with the same runs.  Each
    record gets ``status``, ``timing``, and ``ratio`` / ``ratio_iqr``: its time over the
    ``reference``'s, paired by round.  The order of round ``r`` is `cmtune.workers.rounds.round_order`: what runs just
    before a step (another program's buffers, a collective still draining) and its place in the
    round move from round to round, so they are spread over every variant instead of always
    favouring the same one.
    """
    from cmtune.workers.measure import classify_failure, error_message

    rounds = time_rounds(runs, started=started, protocol=protocol, shuffled=True, keep_going=True, say=say)
    for name, exc in rounds.failures.items():
        records[name].update(status=classify_failure(exc), message=error_message(exc))
    base = rounds.samples[reference]
    reference_failed = "status" in records[reference]
    for name in runs:
        record = records[name]
        if "status" in record:  # failed while timing
            continue
        times = rounds.samples[name]
        if reference_failed:  # nothing to compare against: a ratio would be made up
            record.update(status=Status.ERROR, message=f"not compared: the reference {reference} failed",
                          timing=Timing.of(times) if times else None)
            continue
        ratios = [t / b for t, b in zip(times, base, strict=True)]
        q1, ratio, q3 = quartiles(ratios) if ratios else (None, None, None)
        record.update(
            status=Status.TIMEOUT if rounds.timed_out else Status.OK, message=rounds.message,
            timing=Timing.of(times) if times else None, ratio=ratio,
            ratio_iqr=None if ratio is None else q3 - q1,
        )
