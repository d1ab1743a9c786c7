"""Time variants of a stored step search side by side: its fixed settings, its choices, and edits of them.

    python bench/step.py --sizes large --devices processes:2 --repeats 9     # writes <dir>/large-processes2.step.json
    python bench/step_variants.py <dir>/large-processes2.step.json --devices processes:2 --repeats 15 \\
        always-ring tuned-ring-fill r4-mlp_up-tuned 'r4-mlp_up-tuned+mlp_down.grad_weight=baseline' \\
        'r4-mlp_up-tuned+*.grad_weight=baseline'

A variant is a name the record's rounds timed (``always-ring``, ``r4-mlp_up-tuned``, ...), then any
number of edits ``+<role>.<slot>=<what>``: ``<role>.<slot>`` a role's slot as
`collective_matmul.planning.models.slot_label` names it (``mlp_up`` or ``mlp_up.forward`` the forward,
``mlp_up.grad_input``, ``mlp_up.grad_weight``), ``<role>`` one of the block's roles or ``*`` (every
role), ``<what>`` ``baseline`` (the fused baseline for a weight gradient), ``ring`` (the fixed ring)
or another recorded variant's name (that slot as it runs it).  The step as written is the
reference; the variants are timed in interleaved rounds, each in its own order, slowest process
per run (`cmtune.workers.step.block_session`), as bench/step.py times them.

Prints one line per variant: its time over the step as written, and over the first variant
(paired by round: quartiles), and whether it is faster than the first in 3 of 4 rounds
(`cmtune.tuner.paired.faster`, the step search's rule).  The question it answers: how large a
gain over a fixed setting is there to find in the neighbourhood of the search's choice, against
the spread of a round on these devices.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]


def recorded(record: dict) -> dict:
    """Every named variant of a bench/step.py record (its search rounds, grading and confirmation) -> its configs."""
    from collective_matmul import OpConfigs

    named = {}
    measurements = [*record["rounds"], record.get("grading") or {"variants": []}, record["confirmed"]]
    for measurement in measurements:
        for variant in measurement["variants"]:
            if variant.get("configs"):
                named.setdefault(variant["name"], {role: OpConfigs.model_validate(c)
                                                   for role, c in variant["configs"].items()})
    return named


def parse_variant(spec: str, named: dict) -> dict:
    """``NAME[+role.slot=what]...`` as per-role configs (see the module).

    Raises:
        SystemExit: naming a variant, role, slot or value the record does not have, with what it has.
    """
    from cmtune.tuner.variants import FIXED_RING
    from collective_matmul.planning.decomposition import DEFAULT_GRAD_WEIGHT, Decomposition
    from collective_matmul.planning.models import SLOTS, parse_slot_label

    base, *edits = spec.split("+")
    if base not in named:
        raise SystemExit(f"{spec!r}: no variant {base!r} in the record; it has {', '.join(sorted(named))}")
    setting = dict(named[base])
    for edit in edits:
        target, _, what = edit.partition("=")
        role, slot = parse_slot_label(target)
        roles = list(setting) if role == "*" else [role]
        if not what or any(r not in setting for r in roles):
            raise SystemExit(f"{spec!r}: {edit!r} is not <role>.<slot>=<what> with a role of {sorted(setting)} "
                             f"or '*', a slot of {SLOTS}, and baseline, ring or a recorded variant")
        for r in roles:
            if what == "baseline":
                value = DEFAULT_GRAD_WEIGHT if slot == "grad_weight" else Decomposition.baseline()
            elif what == "ring":
                value = FIXED_RING
            elif what in named and r in named[what]:
                value = getattr(named[what][r], slot)
            elif what in named:
                raise SystemExit(f"{spec!r}: {what!r} runs no configs of {r!r}")
            else:
                raise SystemExit(f"{spec!r}: {what!r} is neither baseline, ring nor a recorded variant")
            setting[r] = setting[r].model_copy(update={slot: value})
    return setting


def worker(args) -> None:
    """One process of the measurement (every process of a group runs this, SPMD)."""
    from step import join_devices, laid_out_session

    join_devices()
    import jax

    from cmtune.tuner.paired import faster, ratio_quartiles
    from cmtune.workers.step import fixed_sources
    from collective_matmul.planning.models import TransformerBlock

    record = json.loads(Path(args.record).read_text())
    named = recorded(record)
    variants = {spec: parse_variant(spec, named) for spec in args.variants}
    _, session = laid_out_session(TransformerBlock.model_validate(record["confirmed"]["block"]), args.repeats)
    result = session.measure(fixed_sources({"as-written": None, **variants}))
    if jax.process_index() != 0:
        return
    first = args.variants[0]
    print(f"{record['confirmed']['block']['name']}, {args.repeats} interleaved rounds; time over the step as written "
          f"({result.variant('as-written').timing.median_s * 1e3:.0f} ms) and over {first}, paired by round:")
    for spec in args.variants:
        variant = result.variant(spec)
        if not variant.ok:
            print(f"  {spec}: {variant.status} {variant.message}")
            continue
        q = ratio_quartiles(result, spec, first)
        ahead = "" if spec == first else f"; faster than {first} in 3 of 4 rounds: " + (
            "yes" if faster(result, spec, first) is not None else "no")
        print(f"  {spec}: {variant.ratio:.3f} of as written; {q[1]:.3f} of {first} (IQR {q[0]:.3f}-{q[2]:.3f})"
              + ahead, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", help="a step record of bench/step.py (<dir>/<size>-<devices>.step.json)")
    parser.add_argument("variants", nargs="+", help="NAME[+role.slot=what]...; the first is the one compared against")
    parser.add_argument("--devices", default="processes:2", help="processes:N or virtual:8")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    named = recorded(json.loads(Path(args.record).read_text()))
    for spec in args.variants:  # bad input fails here, before any process starts
        parse_variant(spec, named)
    from step import run_on

    run_on(args.devices, [str(Path(__file__)), "--worker", "--devices", args.devices, "--repeats", str(args.repeats),
                          str(Path(args.record).resolve()), *args.variants], echo=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/step-*.result.jsonl

    with recorded("step", runs="interleaved rounds of each variant beside a copy of a fixed setting"):
        main()
