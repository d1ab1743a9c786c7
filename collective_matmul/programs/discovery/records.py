"""What discovery finds in one step: its problems, the collectives it skips and why, what XLA decomposes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from collective_matmul.planning.models import Role
from collective_matmul.wire import StepProblem


class SkippedCollective(BaseModel):
    """A collective next to a dot that is not a collective matmul cmtune decomposes, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    what: str = Field(max_length=400)
    reason: str = Field(max_length=1000)
    count: int = Field(ge=1)


class XlaDecomposed(BaseModel):
    """A collective matmul XLA's own windowed einsum already rewrote as a loop of permutes and partial products."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    what: str = Field(max_length=400, description="the loop, e.g. 'while %loop: 2 permutes and 2 dots per step'")
    problem: str | None = Field(default=None, max_length=200, description="the problem it decomposes, if read")
    count: int = Field(ge=1)


class Discovery(BaseModel):
    """What `discover` found in one step."""

    model_config = ConfigDict(extra="forbid")

    problems: list[StepProblem] = Field(default_factory=list)
    skipped: list[SkippedCollective] = Field(default_factory=list)
    decomposed: list[XlaDecomposed] = Field(default_factory=list, description="what XLA's windowed einsum already "
                                            "decomposes in the compiled step (its problems are listed too)")
    warnings: list[str] = Field(default_factory=list)
    mesh: dict[str, int] = Field(default_factory=dict)
    groups: list[list[Role]] = Field(default_factory=list, description="the roles whose products read one gathered "
                                     "activation (q/k/v, gate/up), each group in the module's order: XLA gathers "
                                     "once for them, and so does the drop-in (collective_matmul.ops.share)")
    seen: dict[str, int] = Field(default_factory=dict, description="what the module read holds, per step: its matrix "
                                 "products ('products') and its collectives by opcode, so that an empty answer says "
                                 "what was looked at")
