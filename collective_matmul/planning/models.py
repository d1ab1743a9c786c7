"""Model shapes → the collective-matmul problems of one training step.

Megatron-style tensor parallelism with sequence parallelism: between blocks the activations
``[tokens, d_model]`` are sharded over the tensor axis on the token (sequence) dimension.  Per
layer and step:

- QKV projection and MLP up: all-gather matmul (gather tokens, multiply by column-sharded w).
- Attention output and MLP down: matmul reduce-scatter (row-sharded w, scatter tokens).
- Backward, input gradients (``.grad_input``): the gradient of an all-gather matmul is a matmul
  reduce-scatter with k and n swapped, and the reverse.
- Backward, weight gradients (``.grad_weight``): all-gather on the contracting (token)
  dimension, ``allgather_grad_weight`` with m = tokens.  An all-gather matmul (x ``[tokens, K]``,
  w ``[K, N]``) has ``dW = all_gather(x)ᵀ @ dy``: k=K, n=N.  A matmul reduce-scatter (x
  ``[tokens, K]`` and w ``[K, N]`` sharded on K) has ``dWᵀ = all_gather(dy)ᵀ @ x``: k=N, n=K.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from collective_matmul.planning.problem import Collective, DType, Hardware, Problem
from collective_matmul.planning.text import label

MODEL_NAME_LENGTH = 200  # a model's name: role_overrides.model
ModelName = label(MODEL_NAME_LENGTH)


class TransformerBlock(BaseModel):
    """The shapes of one transformer block and of the global batch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: ModelName = "model"
    d_model: int = Field(gt=0, le=1 << 20)
    d_ff: int = Field(gt=0, le=1 << 22)
    heads: int = Field(gt=0, le=4096)
    head_dim: int = Field(gt=0, le=4096)
    kv_heads: int | None = Field(default=None, gt=0, le=4096)
    gated_mlp: bool = False
    seq_len: int = Field(gt=0, le=1 << 22)
    global_batch: int = Field(gt=0, le=1 << 22)
    dtype: DType = "bfloat16"
    layers: int = Field(default=1, gt=0, le=10_000)

    @model_validator(mode="after")
    def _kv_heads_divide(self) -> TransformerBlock:
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        return self

    @property
    def qkv_dim(self) -> int:
        return (self.heads + 2 * (self.kv_heads or self.heads)) * self.head_dim

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def mlp_up_dim(self) -> int:
        return self.d_ff * (2 if self.gated_mlp else 1)

    @classmethod
    def load(cls, name_or_path: str) -> TransformerBlock:
        """A preset name (see `PRESETS`) or a JSON file with these fields."""
        if name_or_path in PRESETS:
            return PRESETS[name_or_path]
        path = Path(name_or_path)
        if not path.exists():
            raise ValueError(f"unknown model {name_or_path!r}: not a preset {sorted(PRESETS)} nor a file")
        return cls.model_validate(json.loads(path.read_text()))


class MeshSpec(BaseModel):
    """Mesh axis names and sizes (in order) and which axis is tensor-parallel."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    axes: dict[str, int]
    tensor_axis: str = "model"

    @model_validator(mode="after")
    def _valid(self) -> MeshSpec:
        if not self.axes:
            raise ValueError("mesh has no axes")
        for name, size in self.axes.items():
            if size < 1:
                raise ValueError(f"mesh axis {name!r} has size {size}; sizes must be >= 1")
        if self.tensor_axis not in self.axes:
            raise ValueError(f"tensor_axis {self.tensor_axis!r} is not a mesh axis {list(self.axes)}")
        return self

    @property
    def tensor_size(self) -> int:
        return self.axes[self.tensor_axis]

    @property
    def batch_shards(self) -> int:
        """Product of the axes other than the tensor axis (they shard the batch)."""
        return math.prod(s for a, s in self.axes.items() if a != self.tensor_axis)

    @property
    def device_count(self) -> int:
        return math.prod(self.axes.values())

    @classmethod
    def parse(cls, text: str, tensor_axis: str | None = None) -> MeshSpec:
        """``data=2,model=4``; the tensor axis defaults to ``model`` (or the last axis)."""
        axes: dict[str, int] = {}
        for part in text.replace(" ", "").split(","):
            name, sep, size = part.partition("=")
            if not sep or not name or not size.isdigit():
                raise ValueError(f"cannot parse mesh {text!r}: expected name=size pairs like 'data=1,model=8'")
            if name in axes:
                raise ValueError(f"mesh {text!r} names axis {name!r} twice: give each axis once")
            axes[name] = int(size)
        if tensor_axis is None:
            tensor_axis = "model" if "model" in axes else list(axes)[-1]
        return cls(axes=axes, tensor_axis=tensor_axis)


def rings(grid: np.ndarray, index: int) -> np.ndarray:
    """The rings of a mesh's device (or partition id) grid along its axis ``index``: one a row, in mesh order."""
    return np.moveaxis(np.asarray(grid), index, -1).reshape(-1, np.shape(grid)[index])


def ring_hardware(mesh, axis: str) -> Hardware:
    """The hardware of one ring of ``mesh`` (a `jax.sharding.Mesh`) along ``axis``, the first (what configs are
    tuned for), as part of a slice of the mesh's devices (`Hardware.slice_devices`)."""
    return Hardware.detect(rings(mesh.devices, mesh.axis_names.index(axis))[0].tolist(), slice_devices=mesh.size)


class ModelProblem(BaseModel):
    """One unique problem of a model step, with how often and where it occurs per layer."""

    model_config = ConfigDict(frozen=True)

    problem: Problem
    count: int
    roles: tuple[str, ...]


# A role labels where a problem occurs in a step: the reference block's four projections, or the
# label discovery and the drop-in give a user's projection (collective_matmul.programs.roles).  Open, bounded.
MAX_ROLE_LENGTH = 200
MAX_ROLES = 256
Role = label(MAX_ROLE_LENGTH)  # role_overrides.role

ROLES: tuple[str, ...] = ("qkv", "attn_out", "mlp_up", "mlp_down")  # the reference block's
SLOTS: tuple[str, ...] = ("forward", "grad_input", "grad_weight")
COLUMN, ROW = Collective.ALLGATHER_MATMUL, Collective.MATMUL_REDUCE_SCATTER  # an activation ring's two forwards
GRAD_WEIGHT = Collective.ALLGATHER_GRAD_WEIGHT  # their weight-gradient collective
# FSDP's forwards, the weight gathered (sharded on k, on n), and their weight gradient reduce-scattered
WEIGHT_K, WEIGHT_N = Collective.WEIGHT_ALLGATHER_MATMUL_K, Collective.WEIGHT_ALLGATHER_MATMUL_N
WEIGHT_GRAD = Collective.REDUCE_SCATTER_GRAD_WEIGHT
DUAL = {COLUMN: ROW, ROW: COLUMN, WEIGHT_K: WEIGHT_N, WEIGHT_N: WEIGHT_K}  # the collective of a forward's dx
_GRAD_WEIGHTS = {COLUMN: GRAD_WEIGHT, ROW: GRAD_WEIGHT, WEIGHT_K: WEIGHT_GRAD, WEIGHT_N: WEIGHT_GRAD}
_KN_ORDER = (COLUMN, WEIGHT_K)  # forwards whose weight gradient is [K, N] (the others': [N, K], transposed)


def slot_collective(collective: Collective, slot: str) -> Collective:
    """The collective of ``slot`` of an op call whose forward is ``collective``: the forward itself, its dual for
    the input gradient (`DUAL`: an all-gather matmul's ``dx`` is a matmul reduce-scatter, and the reverse; a weight
    gathered on k is, transposed, gathered on n), `GRAD_WEIGHT` for the weight gradient (`WEIGHT_GRAD` of FSDP's).

    Raises:
        ValueError: if ``collective`` is not one of the forward collectives, or ``slot`` not one of `SLOTS`.
    """
    if collective not in DUAL:
        raise ValueError(f"collective must be one of {sorted(map(str, DUAL))}, got {collective!r}")
    if slot not in SLOTS:
        raise ValueError(f"slot must be one of {list(SLOTS)}, got {slot!r}")
    return {"forward": collective, "grad_input": DUAL[collective], "grad_weight": _GRAD_WEIGHTS[collective]}[slot]


def slot_label(role: str, slot: str) -> str:
    """A role's slot as a label: ``role`` for its forward, else ``role.slot`` (``mlp_up.grad_weight``)."""
    return role if slot == "forward" else f"{role}.{slot}"


def parse_slot_label(text: str) -> tuple[str, str]:
    """``(role, slot)`` of a `slot_label` (``role.forward`` is read as ``role``)."""
    role, dot, slot = text.rpartition(".")
    return (role, slot) if dot and slot in SLOTS else (text, "forward")


def slot_problems(collective: Collective, *, m: int, k: int, n: int, dtype: str, axis_size: int) -> dict[str, Problem]:
    """The three problems of one op call, ``{"forward" | "grad_input" | "grad_weight": problem}``: the one rule.

    The forward is ``(collective, m, k, n)``.  The input gradient is the dual collective
    (`slot_collective`) with k and n swapped.  The weight gradient contracts the tokens:
    ``allgather_grad_weight`` with k, n = K, N for an all-gather matmul
    (``dW = all_gather(x)ᵀ dy``) and N, K for a matmul reduce-scatter (``dWᵀ = all_gather(dy)ᵀ x``);
    ``reduce_scatter_grad_weight`` with K, N for a weight gathered on k (``dW = reduce_scatter(xᵀ dy)``) and N, K
    for one gathered on n (``dWᵀ = reduce_scatter(dyᵀ x)``).

    Raises:
        ValueError: if ``collective`` is not one of the forward collectives, or a dimension
            does not divide over the ring.
    """
    collectives = {slot: slot_collective(collective, slot) for slot in SLOTS}
    common = dict(m=m, dtype=dtype, axis_size=axis_size)
    grad_weight = (k, n) if collective in _KN_ORDER else (n, k)
    return {
        "forward": Problem(collective=collectives["forward"], k=k, n=n, **common),
        "grad_input": Problem(collective=collectives["grad_input"], k=n, n=k, **common),
        "grad_weight": Problem(collective=collectives["grad_weight"], k=grad_weight[0], n=grad_weight[1], **common),
    }


def role_problems(model: TransformerBlock, mesh: MeshSpec) -> dict[str, dict[str, Problem]]:
    """Each role's three problems, ``{role: {"forward" | "grad_input" | "grad_weight": problem}}`` (`slot_problems`).

    Raises:
        ValueError: if the batch or a dimension does not divide over the mesh.
    """
    if model.global_batch % mesh.batch_shards:
        raise ValueError(
            f"global_batch={model.global_batch} is not divisible by the {mesh.batch_shards} "
            "data-parallel shards of the mesh"
        )
    tokens = model.global_batch // mesh.batch_shards * model.seq_len
    forward = [
        ("qkv", COLUMN, model.d_model, model.qkv_dim),
        ("attn_out", ROW, model.attn_dim, model.d_model),
        ("mlp_up", COLUMN, model.d_model, model.mlp_up_dim),
        ("mlp_down", ROW, model.d_ff, model.d_model),
    ]
    found: dict[str, dict[str, Problem]] = {}
    for role, collective, k, n in forward:
        try:
            found[role] = slot_problems(collective, m=tokens, k=k, n=n, dtype=model.dtype,
                                        axis_size=mesh.tensor_size)
        except ValueError as exc:  # a Problem's own reason, without pydantic's frame around it
            reason = exc.errors()[0]["msg"].removeprefix("Value error, ") if isinstance(exc, ValidationError) else exc
            raise ValueError(f"{model.name} {role}: {reason}") from None
    return found


def model_problems(model: TransformerBlock, mesh: MeshSpec) -> list[ModelProblem]:
    """The deduplicated collective-matmul problems of one training step, per layer.

    Raises:
        ValueError: if the batch or a dimension does not divide over the mesh.
    """
    found: dict[str, tuple[Problem, list[str]]] = {}
    for role, slots in role_problems(model, mesh).items():
        for slot, problem in slots.items():
            found.setdefault(problem.key, (problem, []))[1].append(slot_label(role, slot))
    return [ModelProblem(problem=prob, count=len(roles), roles=tuple(roles)) for prob, roles in found.values()]


PRESETS: dict[str, TransformerBlock] = {
    # Small enough to tune on 8 virtual CPU devices in minutes (8 heads: the block runs on a ring of 8).
    "tiny": TransformerBlock(
        name="tiny", d_model=256, d_ff=1024, heads=8, head_dim=32, seq_len=128, global_batch=4,
        dtype="float32", layers=2,
    ),
    # The demo's model: MLP-heavy, sized so that on a 2-core machine over the 2-process gloo cluster
    # some roles pick rings (the reduce-scatters, whose baseline is expensive across processes) and
    # others the baseline, and a step takes about 2 s.
    "demo": TransformerBlock(
        name="demo", d_model=1024, d_ff=2048, heads=8, head_dim=16, seq_len=512, global_batch=4,
        dtype="float32", layers=2,
    ),
    # Brown et al. 2020, Table 2.1; batch in sequences (3.2M tokens / 2048).
    "gpt3-175b": TransformerBlock(
        name="gpt3-175b", d_model=12288, d_ff=49152, heads=96, head_dim=128, seq_len=2048,
        global_batch=1536, dtype="bfloat16", layers=96,
    ),
    # Touvron et al. 2023 (Llama 2): GQA with 8 KV heads, SwiGLU MLP, 4M-token batches.
    "llama2-70b": TransformerBlock(
        name="llama2-70b", d_model=8192, d_ff=28672, heads=64, head_dim=128, kv_heads=8,
        gated_mlp=True, seq_len=4096, global_batch=1024, dtype="bfloat16", layers=80,
    ),
    "llama2-7b": TransformerBlock(
        name="llama2-7b", d_model=4096, d_ff=11008, heads=32, head_dim=128, gated_mlp=True,
        seq_len=4096, global_batch=1024, dtype="bfloat16", layers=32,
    ),
}
