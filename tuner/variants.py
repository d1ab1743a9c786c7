"""The variants of a training step that a step measurement times, by name: one menu for the worker
that measures them and the engine that checks a step result against what its trial asked for; and
the whole-step settings and per-slot candidates the step search (`cmtune.tuner.stepsearch`) starts from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from collective_matmul.planning.decomposition import DEFAULT_GRAD_WEIGHT, Decomposition, OpConfigs
from collective_matmul.planning.models import ROLES, SLOTS
from collective_matmul.planning.problem import Hardware, Problem

REFERENCE = "as-written"  # the step as a user writes it without cmtune (GSPMD): every step's reference
BASELINE = "baseline"  # every role at the baseline configs, through cmtune's custom VJPs
TUNED = "tuned"  # every role's tuned configs (the op-level winners): the default the step decision starts from
COSTMODEL = "costmodel"  # the cost model's whole-step choice (`cost_model_configs`)
RING_FILL = "tuned-ring-fill"  # the tuned configs, each slot they leave at the baseline on the fixed ring (`ring_fill`)
ALWAYS_RING = "always-ring"  # the fixed ring in every slot (`ring_everywhere`)

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
    both gradients; see `collective_matmul.ops.ring`).

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
    variants: dict[str, dict | None] = {REFERENCE: None, BASELINE: {role: OpConfigs() for role in roles},
                                        TUNED: whole}
    for name, configs in ((RING_FILL, ring_fill(whole, roles)), (ALWAYS_RING, ring_everywhere(roles))):
        if configs not in variants.values():
            variants[name] = configs
    if ablation:
        variants |= ablation_variants(whole, roles)
    return variants


def ablation_variants(whole: Mapping[str, OpConfigs], roles: Sequence[str], others: Sequence[str] = (),
                      ) -> dict[str, dict]:
    """The per-role ablation of ``whole``: ``tuned-minus-<role>`` for each of ``roles`` not all baseline and each
    of ``others`` (roles ``whole`` does not name, set back from what they run), then ``tuned-fuse-<role>`` for
    each of ``roles`` whose weight gradient is an unfused ring."""
    variants = {f"tuned-minus-{role}": {**whole, role: OpConfigs()}
                for role in [*(r for r in roles if not whole[r].is_baseline), *others]}
    for role in roles:
        weight = whole[role].grad_weight
        if weight.method == "ring" and not weight.fuse:
            fused = whole[role].model_copy(update={"grad_weight": weight.model_copy(update={"fuse": True})})
            variants[f"tuned-fuse-{role}"] = {**whole, role: fused}
    return variants


def cost_model_configs(problems: Mapping[str, Mapping[str, Problem]], hardware: Hardware) -> dict[str, OpConfigs]:
    """The cost model's whole-step choice: each role's configs as ``Tuned(unmeasured="costmodel")`` resolves them
    where nothing was measured.

    Each slot's problem gets the cost model's favourite on the profile of ``hardware``'s device kind
    (the baseline where the kind has none), and a weight gradient what
    `collective_matmul.wire.lookup.weight_gradient` makes of that answer (the cost model does not know
    ``fuse``, so the fused baseline).

    Args:
        problems: each role's problems by slot (`collective_matmul.planning.models.role_problems`, or what a
            user's step traced).
        hardware: the hardware the step runs on.
    """
    from collective_matmul.wire.lookup import untuned, weight_gradient

    chosen = {}
    for role, slots in problems.items():
        configs = {}
        for slot in SLOTS:
            match, decomposition, _ = untuned(slots[slot], hardware, "costmodel")
            configs[slot] = weight_gradient(decomposition, match) if slot == "grad_weight" else decomposition
        chosen[role] = OpConfigs(**configs)
    return chosen


def slot_candidates(problem: Problem, slot: str, *, winner: Decomposition, measured: Iterable[Decomposition] = (),
                    hardware: Hardware | None = None, runners_up: int = 2, limit: int = 5) -> tuple[Decomposition, ...]:
    """The short list of configs the step search tries in one slot of one role, best first.

    The op-level ``winner``, the best ``runners_up`` of ``measured`` (a study's ring trials, best
    first), `FIXED_RING`, the baseline (the fused baseline for a weight gradient: what autodiff
    does) and the cost model's favourite on ``hardware`` (where given); each only once and only
    where ``problem`` accepts it, at most ``limit``.
    """
    from collective_matmul.planning.costmodel import model_choice

    baseline = DEFAULT_GRAD_WEIGHT if slot == "grad_weight" else Decomposition.baseline()
    rings = [d for d in measured if d.method == "ring" and d != winner][:runners_up]
    model = model_choice(problem, hardware) if hardware is not None and slot != "grad_weight" else None
    found: list[Decomposition] = []
    for option in (winner, *rings, FIXED_RING, baseline, model):
        if option is not None and option not in found and problem.accepts(option):
            found.append(option)
    return tuple(found[:limit])
