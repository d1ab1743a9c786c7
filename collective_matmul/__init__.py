"""Collective matmul: decomposed all-gather/reduce-scatter matmuls in JAX, and their keys.

Importing this package touches no device and does no I/O.
"""

from collective_matmul.bundle import Bundle, TunedConfig
from collective_matmul.client import Lookup, Tuned, ring_hardware
from collective_matmul.decomposition import Decomposition
from collective_matmul.models import (
    PRESETS,
    MeshSpec,
    ModelProblem,
    TransformerBlock,
    model_problems,
)
from collective_matmul.ops import (
    allgather_matmul,
    input_shardings,
    matmul_reduce_scatter,
    problem_of,
)
from collective_matmul.problem import Hardware, Problem, check_decomposition
from collective_matmul.reference import (
    baseline_allgather_matmul_shard,
    baseline_matmul_reduce_scatter_shard,
)
from collective_matmul.ring import allgather_matmul_shard, matmul_reduce_scatter_shard
from collective_matmul.space import candidates

__all__ = [
    "PRESETS",
    "Bundle",
    "Lookup",
    "Tuned",
    "TunedConfig",
    "ring_hardware",
    "Decomposition",
    "Hardware",
    "MeshSpec",
    "ModelProblem",
    "Problem",
    "TransformerBlock",
    "allgather_matmul",
    "allgather_matmul_shard",
    "baseline_allgather_matmul_shard",
    "baseline_matmul_reduce_scatter_shard",
    "candidates",
    "check_decomposition",
    "input_shardings",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_shard",
    "model_problems",
    "problem_of",
]
