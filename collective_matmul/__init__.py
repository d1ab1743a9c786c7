"""Collective matmul: decomposed all-gather/reduce-scatter matmuls in JAX, and their keys.

``import collective_matmul`` is the training API: the ops and their per-shard forms, their
configs (`Decomposition`, `OpConfigs`), the tuned-config client `Tuned` (with `Bundle`, the file it
reads), the keys it looks them up by (`Problem`, `Hardware`) and `discover` for a step's problems.
The rest lives in sub-packages, split by who imports them (tests/test_layers.py holds the map):

- `collective_matmul.planning` — keys and planning: decompositions, problems and hardware, model
  shapes, the candidate space, the cost model, XLA's options (no JAX).
- `collective_matmul.wire` — the service's contract, with bundles, bounds and the look-up order
  (no JAX).
- `collective_matmul.programs` — reading compiled programs: discovery, the HLO reader, schedules,
  topologies, roles (no JAX at import).
- `collective_matmul.ops` — the ops in JAX: rings, baselines, shared gathers.
- `collective_matmul.client` — the `Tuned` client, its sources, report and overrides, the REST
  client, and the drop-ins for Flax and MaxText.
- `collective_matmul.block` — the reference transformer block, an example of a step.

Importing this package touches no device, does no I/O and imports no JAX: names are resolved on
first use (PEP 562), so the keys and the wire contract serve processes that never run an op, like
the cmtune service.

The 30 other names version 0.3.0 exported here (the reference block's, the model shapes', `candidates`,
`input_shardings`, ...) still resolve for one more release, each with a `DeprecationWarning` naming its
new home (`_MOVED`); they are not in `__all__` or `dir()`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING

_EXPORTS = {
    "Decomposition": "planning.decomposition",
    "OpConfigs": "planning.decomposition",
    "Problem": "planning.problem",
    "Hardware": "planning.problem",
    "Bundle": "wire.bundle",
    "allgather_matmul": "ops.collective",
    "matmul_reduce_scatter": "ops.collective",
    "allgather_grad_weight": "ops.collective",
    "weight_allgather_matmul": "ops.collective",
    "allgather_matmul_shard": "ops.ring",
    "matmul_reduce_scatter_shard": "ops.ring",
    "allgather_grad_weight_shard": "ops.ring",
    "Tuned": "client.tuned",
    "Discovery": "programs.discovery",
    "discover": "programs.discovery",
}

# 0.3.0's names that moved, and their modules now: they resolve for one more release, with a warning.
_MOVED = {
    "AS_WRITTEN": "block",
    "AsWritten": "block",
    "FixedConfigs": "block",
    "activation_sharding": "block",
    "apply": "block",
    "check_block": "block",
    "configs_per_role": "block",
    "init_params": "block",
    "loss": "block",
    "loss_and_grads": "block",
    "param_shardings": "block",
    "train_step": "block",
    "ConfigSource": "client.sources",
    "Lookup": "client.sources",
    "TunedConfig": "wire.bundle",
    "PRESETS": "planning.models",
    "ROLES": "planning.models",
    "MeshSpec": "planning.models",
    "ModelProblem": "planning.models",
    "TransformerBlock": "planning.models",
    "model_problems": "planning.models",
    "ring_hardware": "planning.models",
    "check_decomposition": "planning.problem",
    "candidates": "planning.space",
    "input_shardings": "ops.collective",
    "plain_baseline": "ops.collective",
    "problem_of": "ops.collective",
    "baseline_allgather_grad_weight_shard": "ops.baseline",
    "baseline_allgather_matmul_shard": "ops.baseline",
    "baseline_matmul_reduce_scatter_shard": "ops.baseline",
}

__all__ = [
    "Decomposition",
    "OpConfigs",
    "Problem",
    "Hardware",
    "Bundle",
    "allgather_matmul",
    "matmul_reduce_scatter",
    "allgather_grad_weight",
    "weight_allgather_matmul",
    "allgather_matmul_shard",
    "matmul_reduce_scatter_shard",
    "allgather_grad_weight_shard",
    "Tuned",
    "Discovery",
    "discover",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"collective_matmul.{module}"), name)
        globals()[name] = value
        return value
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'collective_matmul' has no attribute {name!r}")
    warnings.warn(f"collective_matmul.{name} moved to collective_matmul.{module}.{name}; import it from there (the "
                  "old path goes in the next release)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(f"collective_matmul.{module}"), name)  # not kept: each use warns


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from collective_matmul.client.tuned import Tuned
    from collective_matmul.ops.collective import (
        allgather_grad_weight,
        allgather_matmul,
        matmul_reduce_scatter,
        weight_allgather_matmul,
    )
    from collective_matmul.ops.ring import (
        allgather_grad_weight_shard,
        allgather_matmul_shard,
        matmul_reduce_scatter_shard,
    )
    from collective_matmul.planning.decomposition import Decomposition, OpConfigs
    from collective_matmul.planning.problem import Hardware, Problem
    from collective_matmul.programs.discovery import Discovery, discover
    from collective_matmul.wire.bundle import Bundle
