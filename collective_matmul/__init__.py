"""Collective matmul: decomposed all-gather/reduce-scatter matmuls in JAX, and their keys.

Importing this package touches no device, does no I/O and imports no JAX: names are resolved on
first use (PEP 562), so the keys (`Problem`, `Hardware`, `Decomposition`) and the wire contract
(`collective_matmul.wire`) serve processes that never run an op, like the cmtune service.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "AS_WRITTEN": "block",
    "ROLES": "block",
    "AsWritten": "block",
    "ConfigSource": "block",
    "FixedConfigs": "block",
    "OpConfigs": "decomposition",
    "apply": "block",
    "check_block": "block",
    "configs_per_role": "block",
    "init_params": "block",
    "loss": "block",
    "loss_and_grads": "block",
    "param_shardings": "block",
    "activation_sharding": "block",
    "train_step": "block",
    "Bundle": "bundle",
    "TunedConfig": "bundle",
    "Lookup": "sources",
    "Tuned": "client",
    "ring_hardware": "client",
    "Decomposition": "decomposition",
    "PRESETS": "models",
    "MeshSpec": "models",
    "ModelProblem": "models",
    "TransformerBlock": "models",
    "model_problems": "models",
    "allgather_grad_weight": "ops",
    "allgather_matmul": "ops",
    "input_shardings": "ops",
    "matmul_reduce_scatter": "ops",
    "plain_baseline": "ops",
    "problem_of": "ops",
    "Hardware": "problem",
    "Problem": "problem",
    "check_decomposition": "problem",
    "baseline_allgather_grad_weight_shard": "reference",
    "baseline_allgather_matmul_shard": "reference",
    "baseline_matmul_reduce_scatter_shard": "reference",
    "allgather_grad_weight_shard": "ring",
    "allgather_matmul_shard": "ring",
    "matmul_reduce_scatter_shard": "ring",
    "candidates": "space",
    "Discovery": "discovery",
    "discover": "discovery",
}

__all__ = [
    "AS_WRITTEN",
    "ROLES",
    "AsWritten",
    "ConfigSource",
    "FixedConfigs",
    "OpConfigs",
    "apply",
    "check_block",
    "configs_per_role",
    "init_params",
    "loss",
    "loss_and_grads",
    "param_shardings",
    "activation_sharding",
    "train_step",
    "Bundle",
    "TunedConfig",
    "Lookup",
    "Tuned",
    "ring_hardware",
    "Decomposition",
    "PRESETS",
    "MeshSpec",
    "ModelProblem",
    "TransformerBlock",
    "model_problems",
    "allgather_grad_weight",
    "allgather_matmul",
    "input_shardings",
    "matmul_reduce_scatter",
    "plain_baseline",
    "problem_of",
    "Hardware",
    "Problem",
    "check_decomposition",
    "baseline_allgather_grad_weight_shard",
    "baseline_allgather_matmul_shard",
    "baseline_matmul_reduce_scatter_shard",
    "allgather_grad_weight_shard",
    "allgather_matmul_shard",
    "matmul_reduce_scatter_shard",
    "candidates",
    "Discovery",
    "discover",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'collective_matmul' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"collective_matmul.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from collective_matmul.block import (
        AS_WRITTEN,
        ROLES,
        AsWritten,
        ConfigSource,
        FixedConfigs,
        activation_sharding,
        apply,
        check_block,
        configs_per_role,
        init_params,
        loss,
        loss_and_grads,
        param_shardings,
        train_step,
    )
    from collective_matmul.bundle import Bundle, TunedConfig
    from collective_matmul.client import Tuned, ring_hardware
    from collective_matmul.decomposition import Decomposition, OpConfigs
    from collective_matmul.discovery import Discovery, discover
    from collective_matmul.models import PRESETS, MeshSpec, ModelProblem, TransformerBlock, model_problems
    from collective_matmul.ops import (
        allgather_grad_weight,
        allgather_matmul,
        input_shardings,
        matmul_reduce_scatter,
        plain_baseline,
        problem_of,
    )
    from collective_matmul.problem import Hardware, Problem, check_decomposition
    from collective_matmul.reference import (
        baseline_allgather_grad_weight_shard,
        baseline_allgather_matmul_shard,
        baseline_matmul_reduce_scatter_shard,
    )
    from collective_matmul.ring import allgather_grad_weight_shard, allgather_matmul_shard, matmul_reduce_scatter_shard
    from collective_matmul.sources import Lookup
    from collective_matmul.space import candidates
