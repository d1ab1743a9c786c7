"""The names version 0.3.0 exported from `collective_matmul` (its ``__all__``, listed here as it was) resolve for
one more release: the ones still exported as they are, the moved ones with a `DeprecationWarning` naming their
new home, and out of ``__all__`` and ``dir()``."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import collective_matmul

# collective_matmul.__all__ of version 0.3.0, in its order.
V030 = [
    "AS_WRITTEN", "ROLES", "AsWritten", "ConfigSource", "FixedConfigs", "OpConfigs", "apply", "check_block",
    "configs_per_role", "init_params", "loss", "loss_and_grads", "param_shardings", "activation_sharding",
    "train_step", "Bundle", "TunedConfig", "Lookup", "Tuned", "ring_hardware", "Decomposition", "PRESETS",
    "MeshSpec", "ModelProblem", "TransformerBlock", "model_problems", "allgather_grad_weight", "allgather_matmul",
    "input_shardings", "matmul_reduce_scatter", "plain_baseline", "problem_of", "Hardware", "Problem",
    "check_decomposition", "baseline_allgather_grad_weight_shard", "baseline_allgather_matmul_shard",
    "baseline_matmul_reduce_scatter_shard", "allgather_grad_weight_shard", "allgather_matmul_shard",
    "matmul_reduce_scatter_shard", "candidates", "Discovery", "discover",
]

# Where each moved name lives now.
MOVED = {
    "AS_WRITTEN": "collective_matmul.block",
    "AsWritten": "collective_matmul.block",
    "FixedConfigs": "collective_matmul.block",
    "activation_sharding": "collective_matmul.block",
    "apply": "collective_matmul.block",
    "check_block": "collective_matmul.block",
    "configs_per_role": "collective_matmul.block",
    "init_params": "collective_matmul.block",
    "loss": "collective_matmul.block",
    "loss_and_grads": "collective_matmul.block",
    "param_shardings": "collective_matmul.block",
    "train_step": "collective_matmul.block",
    "ConfigSource": "collective_matmul.client.sources",
    "Lookup": "collective_matmul.client.sources",
    "TunedConfig": "collective_matmul.wire.bundle",
    "PRESETS": "collective_matmul.planning.models",
    "ROLES": "collective_matmul.planning.models",
    "MeshSpec": "collective_matmul.planning.models",
    "ModelProblem": "collective_matmul.planning.models",
    "TransformerBlock": "collective_matmul.planning.models",
    "model_problems": "collective_matmul.planning.models",
    "ring_hardware": "collective_matmul.planning.models",
    "check_decomposition": "collective_matmul.planning.problem",
    "candidates": "collective_matmul.planning.space",
    "input_shardings": "collective_matmul.ops.collective",
    "plain_baseline": "collective_matmul.ops.collective",
    "problem_of": "collective_matmul.ops.collective",
    "baseline_allgather_grad_weight_shard": "collective_matmul.ops.baseline",
    "baseline_allgather_matmul_shard": "collective_matmul.ops.baseline",
    "baseline_matmul_reduce_scatter_shard": "collective_matmul.ops.baseline",
}


def test_the_list_is_030s():
    assert len(V030) == len(set(V030)) == 44
    assert set(MOVED) <= set(V030) and len(MOVED) == 30
    assert set(V030) - set(MOVED) <= set(collective_matmul.__all__)


@pytest.mark.parametrize("name", [n for n in V030 if n not in MOVED])
def test_a_name_still_exported_resolves_without_a_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(collective_matmul, name) is not None
    assert name in collective_matmul.__all__ and name in dir(collective_matmul)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_resolves_with_a_warning_naming_its_new_home(name):
    home = MOVED[name]
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(collective_matmul, name)
    (warning,) = caught
    assert str(warning.message).startswith(f"collective_matmul.{name} moved to {home}.{name}; import it from there")
    assert warning.filename == __file__  # it points at the code to change
    assert value is getattr(importlib.import_module(home), name)
    with pytest.warns(DeprecationWarning):  # every use warns, not only the first
        getattr(collective_matmul, name)
    assert name not in collective_matmul.__all__ and name not in dir(collective_matmul)


def test_from_import_of_a_moved_name_warns_too():
    with pytest.warns(DeprecationWarning, match=r"collective_matmul\.block\.train_step"):
        from collective_matmul import train_step
    from collective_matmul.block import train_step as at_home

    assert train_step is at_home


def test_a_name_0_3_0_did_not_export_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        collective_matmul.nothing_here  # noqa: B018


def test_the_moved_names_of_the_jax_free_parts_resolve_without_jax():
    """`import collective_matmul` imports no JAX (tests/test_layers.py); neither does resolving a moved name whose
    new home is JAX-free."""
    names = sorted(n for n, home in MOVED.items() if home.split(".")[1] in ("planning", "wire"))
    code = ("import sys, warnings; warnings.simplefilter('ignore', DeprecationWarning); import collective_matmul; "
            f"[getattr(collective_matmul, n) for n in {names!r}]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
