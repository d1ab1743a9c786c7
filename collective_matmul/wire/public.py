"""What the REST API answers: studies and their trials, config look-ups, tuned configs, submissions and their
step, a new token.  Public bodies carry the derived values (problem keys, hardware keys, decomposition ids, time
saved) so that no client re-implements them."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, Field

from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire.bodies import Reconfirmation, Seed
from collective_matmul.wire.bundle import RoleOverride, TunedConfig
from collective_matmul.wire.lookup import Match
from collective_matmul.wire.records import BoundsMeasurement, Speedup, StepChoice, StepMeasurement, StepVariant
from collective_matmul.wire.states import Outcome, Status, StudyKind, StudyState, TrialKind, TrialState


class SeedPublic(Seed):
    """A study's seed as the API shows it."""

    decomposition_id: str


class BestSoFar(BaseModel):
    decomposition: Decomposition
    decomposition_id: str
    ratio: float
    speedup: float
    trial_id: int


class StudyPublic(BaseModel):
    id: int
    kind: StudyKind = StudyKind.SEARCH
    state: StudyState
    problem: Problem | None = Field(description="None for a step study")
    problem_key: str = Field(description="the problem's key, or 'step:<model>' for a step study")
    hardware: Hardware
    hardware_key: str
    settings: dict[str, Any]
    space_size: int
    trials_done: int
    trials_budget: int
    trials_running: int
    best: BestSoFar | None
    tuned: TunedConfig | None = None
    tuned_decomposition_id: str | None = None
    stop_reason: str | None
    message: str | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    decision: StepChoice | None = Field(default=None, description="a completed step study's decision")
    seeds: list[SeedPublic] = Field(default_factory=list, description="what the search times first, after the "
                                                                      "baseline, and where each came from (warm start)")
    software: Software | None = Field(default=None, description="the software stack its trials run on (only "
                                      "workers of that stack lease them); None: any worker of the hardware")
    reconfirm: Reconfirmation | None = Field(default=None, description="a re-confirmation study: the stored config "
                                             "it re-times on its stack")
    outcome: Outcome | None = Field(default=None, description="a re-confirmation's: waiting, re-confirmed, "
                                    "replaced, failed or cancelled")


class Skipped(BaseModel):
    problem: str = Field(description="the problem's key, or 'step:<model>' for a model's step study")
    study_id: int | None
    reason: Literal["under study", "already tuned", "nothing to tune"] = Field(
        description="'nothing to tune': no ring decomposition fits the problem (a ring of one device, or shapes "
                    "no chunking divides), so the baseline runs")


class StudyCreated(BaseModel):
    studies: list[StudyPublic]
    submission_id: int | None = None
    skipped: list[Skipped] = Field(default_factory=list, description="problems already tuned or under study")
    joined: bool = Field(default=False, description="the same model, mesh and hardware is being measured already: "
                                                    "this submission joined that one (submission_id is its)")


class StudyPage(BaseModel):
    items: list[StudyPublic]
    total: int
    offset: int
    limit: int


class TrialPublic(BaseModel):
    id: int
    study_id: int
    number: int
    kind: TrialKind
    decompositions: list[Decomposition]
    decomposition_id: str = Field(description="the candidate's id (search) or confirm:N (confirmation)")
    state: TrialState
    attempts: int
    status: Status | None
    ratio: float | None
    speedup: float | None
    median_s: float | None
    iqr_s: float | None
    baseline_s: float | None
    message: str | None
    worker_id: int | None
    created_at: dt.datetime
    finished_at: dt.datetime | None
    step: StepMeasurement | None = Field(default=None, description="a step trial's every variant")
    variants: list[str] = Field(default_factory=list, description="a step search round's variants, by name (empty: "
                                                                  "the standard menu)")
    bounds: BoundsMeasurement | None = Field(default=None, description="a confirmation's bounds rounds")


class ConfigAnswer(BaseModel):
    """A config look-up's answer and which fallback produced it."""

    problem: Problem
    problem_key: str
    hardware: Hardware
    decomposition: Decomposition
    decomposition_id: str
    match: Match
    time_s: float | None = None
    baseline_s: float | None = None
    speedup: float | None = None
    source_problem: Problem | None = Field(default=None, description="the tuned problem a 'nearest' answer came from")
    software: Software | None = Field(default=None, description="the stack that measured the answer's config")
    note: str | None = Field(default=None, description="what the answer says of the stacks: the look-up named none, "
                             "or the config was measured on another (a 'stale' answer)")
    compute_s: float | None = Field(default=None, description="the local matmul alone (bounds rounds)")
    communication_s: float | None = Field(default=None, description="the collective alone (bounds rounds)")
    bounds_baseline_s: float | None = Field(default=None, description="the baseline in the bounds rounds")
    bound_s: float | None = Field(default=None, description="max(compute_s, communication_s)")
    hidden_fraction: float | None = Field(default=None, description="(baseline − tuned) / (baseline − bound), "
                                          "each against its own round's baseline; None: nothing to hide or no "
                                          "bounds")
    reason: str | None = Field(default=None, description="how much the ring hid, or why no ring won")


class TunedPublic(TunedConfig):
    """A stored tuned config with its keys and id spelled out (`GET /v1/tuned`; bundles hold `TunedConfig`)."""

    problem_key: str
    hardware_key: str
    software_key: str
    decomposition_id: str
    study_id: int | None = Field(description="the study that tuned it (None: imported from a bundle)")

    @classmethod
    def of(cls, config: TunedConfig, study_id: int | None) -> TunedPublic:
        return cls(**dict(config), problem_key=config.problem.key, hardware_key=config.hardware.key,
                   software_key=config.software.key, decomposition_id=config.decomposition.id, study_id=study_id)


class SubmissionEntry(BaseModel):
    """One unique problem of a submitted model: its roles, its study and its tuned config."""

    role: str
    roles: list[str]
    count: int = Field(description="occurrences per layer")
    problem: Problem
    problem_key: str
    study_id: int | None
    study_state: StudyState | None = Field(description="None: tuned before (imported or an earlier study)")
    decomposition: Decomposition | None
    decomposition_id: str | None
    speedup: float | None
    speedup_iqr: float | None
    time_s: float | None
    baseline_s: float | None
    trials: int | None
    space_size: int | None
    saved_s_per_layer: float | None = Field(description="count × (baseline − tuned time)")
    saved_s_per_step: float | None = Field(description="saved_s_per_layer × layers")
    compute_s: float | None = Field(default=None, description="the local matmul alone (bounds rounds)")
    communication_s: float | None = Field(default=None, description="the collective alone (bounds rounds)")
    bounds_baseline_s: float | None = Field(default=None, description="the baseline in the bounds rounds")
    bound_s: float | None = Field(default=None, description="max(compute_s, communication_s)")
    hidden_fraction: float | None = Field(default=None, description="(baseline − tuned) / (baseline − bound); None: "
                                          "nothing to hide or no bounds")
    reason: str | None = Field(default=None, description="how much the ring hid, or why no ring won")


class SubmissionSummary(BaseModel):
    id: int
    name: str
    mesh: dict[str, Any]
    hardware: Hardware
    hardware_key: str
    problems: int
    created_at: dt.datetime


class StepPublic(BaseModel):
    """A submitted model's step, measured: what runs, and how much faster it is."""

    study_id: int
    state: StudyState
    message: str | None
    decision: StepChoice | None = Field(default=None, description="what the measurement decided, as stored")
    variant: str | None = Field(description="the configuration that runs: tuned, or one change of it")
    vs_reference: Speedup | None = Field(description="against the step as written (GSPMD): what a user has "
                                                    "without cmtune")
    vs_baseline: Speedup | None = Field(description="against the custom VJP with every role at the baseline")
    measured_saved_s_per_step: float | None = Field(
        description="the all-baseline step's median minus the chosen one's, times the model's layers")
    reference: str | None = Field(default=None, description="the variant the speedups are against: the step "
                                                             "as written")
    mesh: dict[str, int] | None = Field(description="the mesh measured (one ring of the submitted one)")
    batch: int | None = Field(description="the batch measured")
    variants: list[StepVariant] = Field(
        default_factory=list, description="the rounds that chose the variant: of a step search, every variant its "
                                          "rounds timed, each once, from the round that first timed it (its speedup "
                                          "against that round's step as written)")
    confirmation: list[StepVariant] = Field(
        default_factory=list, description="fresh rounds after the decision (reference, all-baseline, the search's "
                                          "seed, chosen): the speedups above come from these where present")


class SubmissionPublic(BaseModel):
    id: int
    name: str
    model: dict[str, Any]
    mesh: dict[str, Any]
    hardware: Hardware
    hardware_key: str
    created_at: dt.datetime
    entries: list[SubmissionEntry]
    layers: int
    complete: bool = Field(description="every problem has a tuned config")
    saved_s_per_step: float | None = Field(description="estimated time saved per training step, all layers")
    step: StepPublic | None = Field(default=None, description="the step measured (once every study is done)")
    overrides: list[RoleOverride] = Field(default_factory=list, description="roles this model runs otherwise "
                                                                           "than their problems' tuned configs")


class TokenCreated(BaseModel):
    id: int
    name: str
    role: str
    token: str = Field(description="shown once; only its hash is stored")
