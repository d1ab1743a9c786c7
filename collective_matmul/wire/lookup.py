"""The look-up order, in one place: what answers a problem on one hardware and software stack, and how it says so.

1. ``override``: the model's per-role decision from its step measurement (`Tuned`, for a call
   with a role); one measured on another stack is still applied, and reported so (`override_note`);
2. ``exact``: the tuned config of this problem and hardware measured on the look-up's stack (a
   look-up that names no stack: the newest measurement of any stack, and the answer says so);
3. ``stale``: the tuned config of this problem and hardware measured on another stack (the newest),
   with the stack that measured it (`note`): until a worker of this stack re-confirms it;
4. ``nearest``: the tuned problem of the same collective, dtype and ring size closest in
   log-distance over (m, k, n) whose decomposition is valid here (`collective_matmul.wire.bundle.nearest`),
   each tuned problem by its config of this stack where it has one, else its newest;
5. ``model``: only where the caller asks for it (``unmeasured="costmodel"``): the cost model's favourite
   on the profile of the hardware's device kind;
6. ``baseline``: nothing was measured on this hardware (the default: no ring that no one measured goes
   into a training step), or the model was asked for and the device kind has no figures.

An answer of 5 or 6 says why (`untuned`).  The service answers 2-6 from its tuned configs
(`cmtune.service.lookup`); `Tuned` answers 1, then 2-4 from the server and its bundle (comparing a
bundle's stacks with its own), then 5-6, with the same functions.  A weight gradient runs what
`weight_gradient` makes of its answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, get_args

from collective_matmul.planning.decomposition import DEFAULT_GRAD_WEIGHT, Decomposition
from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire.bundle import TunedConfig, nearest

Match = Literal["exact", "stale", "nearest", "model", "baseline"]  # what a config look-up answers with (2-6)
Unmeasured = Literal["baseline", "costmodel"]  # what answers where nothing measured on the hardware does
UNMEASURED: tuple[str, ...] = get_args(Unmeasured)
NOT_MEASURED = "not measured on this hardware"  # how the reason of an answer of 5 or 6 begins
MATCHES: tuple[str, ...] = ("override", "exact", "stale", "nearest", "model", "baseline")  # the order, first wins
MEASURED = ("override", "exact", "stale", "nearest")  # answers that come from a measurement
NO_STACK = ("the look-up named no software stack: answered with the newest measurement of any stack; send jax, "
            "jaxlib, platform_version and flags (collective_matmul.planning.problem.Software) to tell exact from stale")


def by_problem(configs: Iterable[TunedConfig]) -> dict[str, list[TunedConfig]]:
    """``configs`` (of one hardware) by problem key: each problem's configs, one per stack, the newest last."""
    found: dict[str, list[TunedConfig]] = {}
    for config in configs:
        found.setdefault(config.problem.key, []).append(config)
    return {key: sorted(group, key=lambda c: c.tuned_at) for key, group in found.items()}  # stable: ties keep order


def _of_stack(configs: Sequence[TunedConfig], software: Software | None) -> TunedConfig | None:
    """The newest of ``configs`` measured on ``software`` (any stack when None)."""
    same = [c for c in configs if software is None or c.software.key == software.key]
    return same[-1] if same else None


def from_tuned(problem: Problem, configs: Mapping[str, Sequence[TunedConfig]], software: Software | None = None,
               ) -> tuple[Match, TunedConfig] | None:
    """The ``exact`` config of ``problem`` among ``configs`` (of one hardware, `by_problem`) measured on
    ``software``, else the ``stale`` one of another stack, else the ``nearest``; None if none of these."""
    own = configs.get(problem.key) or ()
    if own:
        exact = _of_stack(own, software)
        return ("exact", exact) if exact is not None else ("stale", own[-1])
    close = nearest(problem, [_of_stack(group, software) or group[-1] for group in configs.values() if group])
    return ("nearest", close) if close is not None else None


def stack_note(match: str, config: TunedConfig | None, software: Software | None) -> str | None:
    """What an answer says about the stacks: a look-up that named none, or a config measured on another."""
    if software is None:
        return NO_STACK if config is not None else None
    if config is not None and config.software.key != software.key:
        what = "stale" if match == "stale" else f"{match}, from a config"
        return (f"{what}: measured on another software stack ({config.software}), not on this look-up's "
                f"({software}): until it is re-confirmed on this stack")
    return None


def override_note(measured_on: Software | None, software: Software | None) -> str | None:
    """An override decided on another stack than ``software``: still applied, and said so."""
    if measured_on is None or software is None or measured_on.key == software.key:
        return None
    return f"override measured on another software stack ({measured_on}), applied on {software}"


def untuned(problem: Problem, hardware: Hardware, unmeasured: Unmeasured = "baseline"
            ) -> tuple[Match, Decomposition, str]:
    """What answers when nothing measured does, and why: the baseline, or where the caller asks for it
    (``unmeasured="costmodel"``) the cost model's choice (the baseline where the device kind has no figures).

    On a platform whose XLA decomposes collective matmuls itself (its windowed einsum: TPU, GPU) the baseline a
    step would run unmeasured is the product as written (``method="xla"``): cmtune's own baseline runs in a
    ``shard_map`` that XLA's windowed einsum does not touch, so answering it would undo what XLA does there."""
    if unmeasured == "costmodel":
        from collective_matmul.planning.costmodel import model_choice, no_figures

        choice = model_choice(problem, hardware)
        if choice is not None:
            return "model", choice, f"{NOT_MEASURED}: the cost model's choice, as asked (unmeasured=costmodel)"
        return "baseline", Decomposition.baseline(), f"{NOT_MEASURED}, and {no_figures(hardware)}: the baseline"
    from collective_matmul.planning.xla_options import windowed_einsum

    if windowed_einsum(hardware.platform, "on") is not None:
        return ("baseline", Decomposition.xla(),
                f"{NOT_MEASURED}: the product as written, left to XLA (on {hardware.platform} XLA decomposes it "
                "itself at its threshold; unmeasured=costmodel asks for the cost model's choice instead)")
    return ("baseline", Decomposition.baseline(),
            f"{NOT_MEASURED}: the baseline (unmeasured=costmodel asks for the cost model's choice instead)")


def whole_op(decompositions: Mapping[str, Decomposition]) -> dict[str, tuple[Decomposition, str]]:
    """The slots of one op call whose answers must change so the op runs (``method="xla"`` is a choice for the
    whole op), with why: a forward left to XLA takes its backward with it; a backward slot left to XLA under a
    forward of cmtune's runs cmtune's default for that slot."""
    forward = decompositions["forward"]
    if forward.method == "xla":
        return {slot: (Decomposition.xla(), "the forward is left to XLA, and its backward with it")
                for slot, d in decompositions.items() if slot != "forward" and d.method != "xla"}
    defaults = {"grad_input": Decomposition.baseline(), "grad_weight": DEFAULT_GRAD_WEIGHT}
    return {slot: (defaults[slot], "left to XLA alone, but the forward is cmtune's: its default for the slot")
            for slot, d in decompositions.items() if slot != "forward" and d.method == "xla"}


def checked_unmeasured(unmeasured: str) -> Unmeasured:
    """``unmeasured`` if it is one of `UNMEASURED`.

    Raises:
        ValueError: if it is not.
    """
    if unmeasured not in UNMEASURED:
        raise ValueError(f"unmeasured must be one of {list(UNMEASURED)}, got {unmeasured!r}")
    return unmeasured


def weight_gradient(decomposition: Decomposition | None, match: str | None = "exact") -> Decomposition:
    """The config a weight gradient runs, from its look-up's answer: a ring only where one was measured
    to win (``decomposition`` from a measured ``match``); otherwise, and where the measured winner is the
    baseline, the fused baseline (what autodiff of the baseline does: no second gather).  The cost model
    does not know `fuse`, so its choice is not taken here."""
    if decomposition is not None and decomposition.method == "xla":
        return decomposition  # the whole op is XLA's (`whole_op`)
    if decomposition is None or match not in MEASURED or decomposition == Decomposition.baseline():
        return DEFAULT_GRAD_WEIGHT
    return decomposition
