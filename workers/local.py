"""`cmtune tune` over the engine: the study engine over an in-memory store, its trials run on this
process's devices by a `cmtune.workers.runner.LocalRunner`.  In a multi-process group only process 0
runs the engine and hands each trial to the others (`cmtune.workers.runner.follow`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cmtune.tuner.engine import Engine, task_for
from cmtune.tuner.search import SearchSettings
from cmtune.tuner.store import InMemoryStore, StudyRecord, TrialRecord, utcnow
from cmtune.tuner.warm import Known, best_ring
from cmtune.workers.runner import Runner, Watchdog
from collective_matmul.planning.problem import Hardware, Problem
from collective_matmul.wire import GroupMessage, MeasurementProtocol, TrialKind
from collective_matmul.wire.bundle import TunedConfig


@dataclass(frozen=True)
class FinishedStudy:
    """One finished study of a local run."""

    study: StudyRecord
    trials: list[TrialRecord]
    tuned: TunedConfig | None

    @property
    def search(self) -> list[TrialRecord]:
        return [t for t in self.trials if t.kind == TrialKind.SEARCH and t.finished_at is not None]

    def known(self) -> Known | None:
        """This study as the warm start of a later one (`cmtune.tuner.warm`); None if it tuned nothing."""
        if self.tuned is None:
            return None
        ring, ratio = best_ring(self.trials) or (None, None)
        return Known(self.tuned, ring, ratio, source="local")


class LocalTuner:
    """The engine over an in-memory store, trials run by ``runner`` (process 0 of a group decides).

    Args:
        runner: times the trials (a `LocalRunner`, or a test double).
        group: the process group (None alone); process 0 sends each trial to the others.
        on_trial: called with each finished trial (progress display).
    """

    def __init__(self, runner: Runner, *, group=None, engine: Engine | None = None,
                 on_trial: Callable[[TrialRecord], None] | None = None, clock=utcnow, grace_s: float = 120.0):
        self.runner, self.group, self.on_trial, self.clock = runner, group, on_trial, clock
        self.grace_s = grace_s
        self.engine = engine or Engine(ready=1)
        self.store = InMemoryStore()

    def tune(self, problem: Problem, hardware: Hardware, settings: SearchSettings,
             protocol: MeasurementProtocol) -> FinishedStudy:
        """Run one study to its end; returns the study, its trials and its tuned config."""
        with self.store.transaction(write=True) as tx:
            study = self.engine.create_study(tx, problem=problem, hardware=hardware, settings=settings,
                                             protocol=protocol, now=self.clock())
        while True:
            with self.store.transaction(write=True) as tx:
                trial = self.engine.claim(tx, study_ids=[study.id], now=self.clock())
                current = tx.study(study.id)
            if trial is None:
                if current.state.active:
                    raise RuntimeError(f"study {study.id} is {current.state} with no trial to run")
                break
            task = task_for(current, trial)
            if self.group is not None:
                self.group.send(GroupMessage(kind="trial", task=task))
            what = f"{problem.key}: trial {trial.number} ({', '.join(d.id for d in task.decompositions)})"
            with Watchdog(Watchdog.deadline(task, self.grace_s), what):
                result = self.runner.run(task)
            with self.store.transaction(write=True) as tx:
                finished = self.engine.record(tx, trial.id, result, now=self.clock())
            if self.on_trial is not None:
                self.on_trial(finished)
        with self.store.transaction() as tx:
            study = tx.study(study.id)
            return FinishedStudy(study, tx.trials(study.id, measurements=True),
                                 tx.tuned_config(problem, study.hardware))

    def stop(self) -> None:
        """Release the other processes of the group (call once, after the last study)."""
        if self.group is not None:
            self.group.send(GroupMessage(kind="stop"))


def tune_problems(problems: list[Problem], *, ring: int, trials: int | None, minutes: float | None,
                  patience: int | None, sampler: str, seed: int, protocol: dict, grace_s: float,
                  warm_start: bool = True, bundled=(), mesh=None, axis: str | None = None,
                  on_study: Callable[[Problem, int], Callable[..., None]] | None = None, screen: bool = False,
                  ) -> tuple[Hardware, list[FinishedStudy]] | None:
    """Tune ``problems`` on rings of ``ring`` devices, all at once: every ring of that size the devices split into
    (`cmtune.workers.measure.ring_mesh`), or those of ``mesh`` along ``axis`` (a user's step's); configs are keyed
    by the first ring's hardware, part of a slice of the mesh's devices
    (`collective_matmul.client.tuned.ring_hardware`).  Process 0 runs the studies; the others run what it hands
    them (`cmtune.workers.runner.follow`).

    With ``warm_start``, each study is seeded (`cmtune.tuner.warm.seeds`) from the studies of this run
    before it and from the configs of ``bundled`` (a bundle's).  With ``screen``, every candidate of each problem is
    compiled for the rings first, on every process alike (`cmtune.workers.aot.screen`), and each search proposes
    the forms whose schedule overlaps before the others (on a GPU node, where XLA's passes decide it).

    Args:
        protocol: the `MeasurementProtocol`'s fields.
        on_study: called on process 0 as each study starts, with its problem and its trials at most (the
            candidates and the baseline); what it returns is called after each trial, and with ``done=True`` when
            the study ends (progress).

    Returns:
        On process 0 the rings' hardware and each study's outcome, in order; None on the others.

    Raises:
        ValueError: rings of ``ring`` do not divide the devices.
    """
    import jax

    from cmtune.tuner.search_studies import study_settings
    from cmtune.tuner.warm import seeds
    from cmtune.workers.aot import screen as compile_screen
    from cmtune.workers.cluster import Group
    from cmtune.workers.measure import ring_mesh
    from cmtune.workers.runner import LocalRunner, follow
    from collective_matmul.planning.models import ring_hardware
    from collective_matmul.planning.space import candidates

    if mesh is None and jax.device_count() % ring:
        raise ValueError(
            f"the problems need rings of {ring} devices, which do not divide the {jax.device_count()} devices "
            f"present; use --devices virtual:{ring} (or a multiple of {ring}), or processes:PxD with P x D a "
            f"multiple of {ring}")
    mesh = mesh or ring_mesh(None, ring)
    axis = axis or mesh.axis_names[-1]
    runner = LocalRunner(mesh=mesh, axis=axis)
    screens = {problem: compile_screen(problem, mesh, axis) for problem in problems} if screen else {}
    group = Group()
    if not group.leader:
        follow(group, runner, grace_s=grace_s)  # process 0 decides; this process runs what it is handed
        return None
    hardware = ring_hardware(mesh, axis)
    on_study = on_study or (lambda _problem, _total: lambda done=False: None)
    outcomes: list[FinishedStudy] = []
    tuner = LocalTuner(runner, group=group, grace_s=grace_s)
    try:
        for problem in problems:
            known = [*(o.known() for o in outcomes), *(Known(c, source="bundle") for c in bundled)]
            warm = seeds(problem, hardware, [k for k in known if k is not None]) if warm_start else ()
            settings = study_settings(problem, hardware, trials=trials, minutes=minutes, patience=patience,
                                      sampler=sampler, seed=seed, seeds=warm, screen=screens.get(problem, ()))
            tick = on_study(problem, min(settings.max_trials, len(candidates(problem))) + 1)
            tuner.on_trial = lambda _trial, tick=tick: tick()
            outcomes.append(tuner.tune(problem, hardware, settings, MeasurementProtocol(**protocol)))
            tick(done=True)
    finally:
        tuner.stop()
    return hardware, outcomes


def add_to_bundle(path, configs: list[TunedConfig]) -> None:
    """Add ``configs`` to the bundle file at ``path`` (a new one where there is none)."""
    from collective_matmul.wire.bundle import Bundle

    bundle = Bundle.load(path) if path.exists() else Bundle()
    for config in configs:
        bundle.add(config)
    bundle.save(path)
