"""The wire contract: every type that crosses a process boundary, without JAX.

The service, the worker daemon, the command line, the `Tuned` client, the dashboard's API and the
tests all speak these types, so a field means the same thing everywhere:

- keys: `Problem`, `Hardware`, `Decomposition` (defined in `collective_matmul.planning`, re-exported here);
- the measurement record: `MeasurementProtocol`, `Timing`, `Measurement`, `Status`, a confirmation's
  `BoundsMeasurement`;
- the lifecycle: `StudyState`, `TrialState`, `TrialKind` (the database checks the same values), `StopReason`;
- tuned configs and bundles: `TunedConfig`, `Bundle`;
- the REST API's bodies: ``XCreate`` in, ``XPublic`` out, and the worker's lease and result.

Public bodies carry the derived values (problem keys, hardware keys, decomposition ids, time
saved) so that no client re-implements them.  Importing this package imports pydantic, not JAX.

Each module holds one kind of type, and every name is imported from here (``from collective_matmul.wire
import X``):

- `states`: the lifecycle's Enums (studies, trials, stop reasons, a measurement's status);
- `fields`: the bounded field types the others share (text bounded like its column, reported seconds);
- `stats`: quartiles, and the checks that a reported summary is its samples';
- `records`: the measurement records (a candidate, a problem's bounds, a training step) and a step's decision;
- `bodies`: what the REST API takes (a study to create and its parts, look-ups, a token);
- `public`: what the REST API answers (studies, trials, configs, submissions);
- `protocol`: the worker protocol (registration, a lease and its task, heartbeats, a trial's `TrialResult` and
  the `ResultIn` body that carries it);
- `group`: what process 0 of a multi-process group tells the others.

Three modules hold the contract's rules rather than its types, and are imported by their path:
`bundle` (the bundle file: its format, versions and checks; `Bundle`, `TunedConfig` and `RoleOverride`
are re-exported here), `bounds` (a problem's and a step's bounds, the hidden fraction, the overlap
verdict) and `lookup` (the look-up order and how each answer was matched).
"""

from collective_matmul.planning.decomposition import Decomposition, OpConfigs
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire.bodies import (
    EXAMPLE_HARDWARE,
    EXAMPLE_PROBLEM,
    MAX_BATCH,
    STEP_ROUND_VARIANTS,
    STEP_SEARCH_ROUNDS,
    Budget,
    ConfigQuery,
    ConfigQueryBatch,
    DiscoveredStep,
    HardwareIn,
    MeshIn,
    ProblemScreen,
    Reconfirmation,
    Sampler,
    Screened,
    Seed,
    StepOptions,
    StepProblem,
    StudyCreate,
    TokenCreate,
)
from collective_matmul.wire.bounds import OverlapVerdict
from collective_matmul.wire.bundle import Bundle, RoleOverride, TunedConfig
from collective_matmul.wire.fields import (
    MAX_MESH_AXES,
    MAX_MESSAGE_LENGTH,
    MAX_SAMPLES,
    MAX_VARIANT_NAME,
    LeaseId,
    MeshAxes,
    Message,
    Name,
    PresetName,
    ProblemKey,
    Seconds,
    ShortText,
    Source,
    VariantName,
)
from collective_matmul.wire.group import BlockConfigs, ChosenVariant, GroupMessage, Pin, Resolved, StepCalls, StepRound
from collective_matmul.wire.protocol import (
    RESULT_FIELDS,
    WORKER_HEADER,
    ConfirmResult,
    HeartbeatIn,
    HeartbeatOut,
    LeaseGranted,
    LeasePublic,
    ResultIn,
    ResultOut,
    SearchResult,
    StepResult,
    StepTask,
    TrialResult,
    TrialTask,
    WorkerCreate,
    WorkerPublic,
    WorkerRegistered,
    result_of,
    what_to_send,
)
from collective_matmul.wire.public import (
    BestSoFar,
    ConfigAnswer,
    SeedPublic,
    Skipped,
    StepPublic,
    StudyCreated,
    StudyPage,
    StudyPublic,
    SubmissionEntry,
    SubmissionPublic,
    SubmissionSummary,
    TokenCreated,
    TrialPublic,
    TunedPublic,
)
from collective_matmul.wire.records import (
    MAX_STEP_VARIANTS,
    BoundsMeasurement,
    CompiledCandidate,
    Measurement,
    MeasurementProtocol,
    Speedup,
    StepChoice,
    StepMeasurement,
    StepSetting,
    StepVariant,
    StepVariants,
    Timing,
)
from collective_matmul.wire.states import (
    ACTIVE_STUDY_STATES,
    Outcome,
    Status,
    StopReason,
    StudyKind,
    StudyState,
    TrialKind,
    TrialState,
    reconfirm_outcome,
)
from collective_matmul.wire.stats import Quartiles, paired_quartiles, quartiles

__all__ = [
    # keys and configs, defined beside the ops
    "Bundle", "Decomposition", "Hardware", "OpConfigs", "Problem", "RoleOverride", "Software", "TunedConfig",
    # states
    "ACTIVE_STUDY_STATES", "Outcome", "OverlapVerdict", "Status", "StopReason", "StudyKind", "StudyState",
    "TrialKind", "TrialState", "reconfirm_outcome",
    # fields
    "MAX_MESH_AXES", "MAX_MESSAGE_LENGTH", "MAX_SAMPLES", "MAX_VARIANT_NAME", "LeaseId", "MeshAxes", "Message", "Name",
    "PresetName", "ProblemKey", "Seconds", "ShortText", "Source", "VariantName",
    # stats
    "Quartiles", "paired_quartiles", "quartiles",
    # records
    "MAX_STEP_VARIANTS", "BoundsMeasurement", "CompiledCandidate", "Measurement", "MeasurementProtocol", "Speedup",
    "StepChoice", "StepMeasurement", "StepSetting", "StepVariant", "StepVariants", "Timing",
    # bodies
    "EXAMPLE_HARDWARE", "EXAMPLE_PROBLEM", "MAX_BATCH", "STEP_ROUND_VARIANTS", "STEP_SEARCH_ROUNDS", "Budget",
    "ConfigQuery", "ConfigQueryBatch", "DiscoveredStep", "HardwareIn", "MeshIn", "ProblemScreen", "Reconfirmation",
    "Sampler", "Screened", "Seed", "StepOptions", "StepProblem", "StudyCreate", "TokenCreate",
    # public
    "BestSoFar", "ConfigAnswer", "SeedPublic", "Skipped", "StepPublic", "StudyCreated", "StudyPage", "StudyPublic",
    "SubmissionEntry", "SubmissionPublic", "SubmissionSummary", "TokenCreated", "TrialPublic", "TunedPublic",
    # protocol
    "RESULT_FIELDS", "WORKER_HEADER", "ConfirmResult", "HeartbeatIn", "HeartbeatOut", "LeaseGranted", "LeasePublic",
    "ResultIn", "ResultOut", "SearchResult", "StepResult", "StepTask", "TrialResult", "TrialTask", "WorkerCreate",
    "WorkerPublic", "WorkerRegistered", "result_of", "what_to_send",
    # group
    "BlockConfigs", "ChosenVariant", "GroupMessage", "Pin", "Resolved", "StepCalls", "StepRound",
]
