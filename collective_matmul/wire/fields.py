"""The bounded field types the bodies share: free text bounded like the column that stores it, and the times a
worker reports."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from collective_matmul.planning.models import MAX_ROLE_LENGTH, MODEL_NAME_LENGTH
from collective_matmul.planning.text import label, message

# Free text (collective_matmul.planning.text): bounded like the columns that store it
ShortText = label(64)  # a mesh axis, a package, a variant the others are checked against
Name = label(200)  # workers.name, tokens.name
LeaseId = label(36)  # leases.id (a UUID)
MAX_MESSAGE_LENGTH = 4000  # what a worker may say about a result; trials.message keeps the first 2000 characters
Message = message(MAX_MESSAGE_LENGTH)
MAX_VARIANT_NAME = MAX_ROLE_LENGTH + 16
VariantName = label(MAX_VARIANT_NAME)  # tuned-minus-<role>, r<round>-<role>-<change>
Source = label(400, min_length=0)  # file:line
PresetName = label(MODEL_NAME_LENGTH, min_length=0)  # (an empty one is an unknown model, as any other)
ProblemKey = label(200)  # problems.key
MeshAxes = dict[ShortText, Annotated[int, Field(ge=1, le=1 << 20)]]
# The axes a mesh may name: MaxText's meshes name 12 (data, stage, fsdp, ..., tensor_sequence, expert, autoregressive).
MAX_MESH_AXES = 16

# Times and ratios a worker reports: finite, and times above zero (a result that is neither is refused)
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
MAX_SAMPLES = 100_000
