"""The variants of a training step that a step measurement times, by name: one menu for the worker
that measures them and the engine that checks a step result against what its trial asked for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from collective_matmul.decomposition import Decomposition, OpConfigs
from collective_matmul.models import ROLES, SLOTS

REFERENCE = "as-written"  # the step as a user writes it without cmtune (GSPMD): every step's reference

# One ring for every slot: what a user who switches collective matmuls on everywhere gets (XLA's
# size-threshold flag once every shape crosses it).  The step tries it whole, and in every slot
# the tuned configs leave at the baseline, because what an op wins alone and what it wins inside
# the step differ (a weight-gradient ring that loses alone can win in the step).
FIXED_RING = Decomposition(direction="unidirectional", chunks=1, unroll="full")


def ring_everywhere(roles: Sequence[str] = ROLES) -> dict[str, OpConfigs]:
    """Every role's forward, input and weight gradient on `FIXED_RING` (the weight gradient unfused)."""
    return {role: OpConfigs(forward=FIXED_RING, grad_input=FIXED_RING, grad_weight=FIXED_RING) for role in roles}


def ring_fill(tuned: Mapping[str, OpConfigs], roles: Sequence[str] = ROLES) -> dict[str, OpConfigs]:
    """``tuned`` with each slot it leaves at the baseline on `FIXED_RING` (rings it chose stay)."""
    filled = {}
    for role in roles:
        configs = tuned.get(role, OpConfigs())
        filled[role] = OpConfigs(**{slot: getattr(configs, slot) if getattr(configs, slot).method == "ring"
                                    else FIXED_RING for slot in SLOTS})
    return filled


def variant_configs(tuned: Mapping[str, OpConfigs], *, roles: Sequence[str] = ROLES,
                    ablation: bool = True) -> dict[str, dict | None]:
    """The usual variants of a step measurement, each as its per-role `OpConfigs` (None: the reference).

    ``REFERENCE`` (the step as written: what users have), ``baseline`` (the custom VJPs, every
    role at the baseline configs), ``tuned`` (every role's tuned configs), the whole-step
    alternatives ``tuned-ring-fill`` (`ring_fill`) and ``always-ring`` (`ring_everywhere`), each
    only where it differs from the variants before it, and, with ``ablation``,
    ``tuned-minus-<role>`` for each role whose tuned configs are not all baseline (that role set
    back to the baseline) and ``tuned-fuse-<role>`` for each role whose weight gradient is an
    unfused ring (the same ring fused: what the backward keeps from the forward, or one loop for
    both gradients; see `collective_matmul.ring`).

    Args:
        tuned: each role's tuned configs (a role not named: the baseline).
        roles: the step's roles (default: the reference block's four).
        ablation: include the per-role variants.

    Raises:
        ValueError: if ``tuned`` names a role that is not in ``roles``.
    """
    unknown = sorted(set(tuned) - set(roles))
    if unknown:
        raise ValueError(f"unknown roles {unknown}; the step's roles are {list(roles)}")
    whole = {role: tuned.get(role, OpConfigs()) for role in roles}
    variants: dict[str, dict | None] = {REFERENCE: None, "baseline": {role: OpConfigs() for role in roles},
                                        "tuned": whole}
    for name, configs in (("tuned-ring-fill", ring_fill(whole, roles)), ("always-ring", ring_everywhere(roles))):
        if configs not in variants.values():
            variants[name] = configs
    if ablation:
        for role in roles:
            if not whole[role].is_baseline:
                variants[f"tuned-minus-{role}"] = whole | {role: OpConfigs()}
        for role in roles:
            weight = whole[role].grad_weight
            if weight.method == "ring" and not weight.fuse:
                fused = whole[role].model_copy(update={"grad_weight": weight.model_copy(update={"fuse": True})})
                variants[f"tuned-fuse-{role}"] = whole | {role: fused}
    return variants
