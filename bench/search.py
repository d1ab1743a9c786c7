"""Benchmark: how many trials each search strategy needs to find a near-best decomposition.

    python bench/search.py                 # 8 problems, 8 virtual devices
    python bench/search.py --seeds 5 --repeats 5

1. Every problem's whole space is timed exhaustively (the tuner's protocol, real devices).
2. The tuner (cost-model order + TPE), plain Optuna TPE (random startup of 10) and random
   search then run against those recorded measurements (replay: every strategy sees the same
   numbers, so the comparison is of the strategies, not of the noise), once per seed, until the
   space is exhausted.  For each: the trials needed until the best ring decomposition found is
   within 3% of the exhaustive best ring decomposition (the baseline, always timed first, is
   counted as a trial but is not the target: on hardware where it wins, every strategy would
   "find" it at trial 1).
3. The tuner with a budget of a quarter of the space picks a config; it is then timed again,
   live, against the baseline (15 interleaved runs): the speedup a user would get.
4. The cost model's ranking is compared with the measured one (Spearman rank correlation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBLEMS = [
    "allgather_matmul:512x256x1024:float32:8",
    "allgather_matmul:1024x512x1024:float32:8",
    "allgather_matmul:2048x256x2048:float32:8",
    "allgather_matmul:512x512x1024:bfloat16:8",
    "matmul_reduce_scatter:512x1024x256:float32:8",
    "matmul_reduce_scatter:1024x1024x512:float32:8",
    "matmul_reduce_scatter:2048x2048x256:float32:8",
    "matmul_reduce_scatter:512x1024x512:bfloat16:8",
]
STRATEGIES = {
    "cmtune": dict(sampler="auto"),
    "optuna-tpe": dict(sampler="tpe", seed_with_model=False, startup=10),
    "random": dict(sampler="random"),
}


class Replay:
    """A runner that answers from recorded measurements."""

    def __init__(self, recorded):
        self.recorded = recorded

    def run(self, problem, configs, protocol):
        return [self.recorded[c] for c in configs]

    def agree(self, flag):
        return flag


def trials_to_within(trials, best_ratio: float, tolerance: float = 0.03) -> int:
    best = float("inf")
    for i, m in enumerate(trials, 1):
        if m.ok and m.decomposition.method == "ring":
            best = min(best, m.ratio)
        if best <= best_ratio * (1 + tolerance):
            return i
    return len(trials) + 1


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        r = [0.0] * len(values)
        for position, index in enumerate(order):
            r[index] = float(position)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", nargs="+", default=PROBLEMS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "search.json"))
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import optuna

    from cmtune.tuner.local import LocalRunner
    from cmtune.tuner.measure import Protocol
    from cmtune.tuner.search import SearchSettings, tune
    from cmtune.tuner.sweep import sweep
    from collective_matmul import Decomposition, Problem
    from collective_matmul.costmodel import calibrate_cpu, estimate

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    profile = calibrate_cpu()
    protocol = Protocol(repeats=args.repeats)
    rows, per_problem = [], []
    for spec in args.problems:
        problem = Problem.parse(spec)
        started = time.perf_counter()
        measured = sweep(problem, protocol=protocol)
        sweep_s = time.perf_counter() - started
        recorded = {m.decomposition: m for m in measured}
        ok = [m for m in measured if m.ok]
        best_overall = min(ok, key=lambda m: m.ratio)
        best = min((m for m in ok if m.decomposition.method == "ring"), key=lambda m: m.ratio)
        space = len(measured)
        needed = {}
        for name, kwargs in STRATEGIES.items():
            counts = []
            for seed in range(args.seeds):
                result = tune(problem, Replay(recorded), profile,
                              settings=SearchSettings(seed=seed, **kwargs), protocol=protocol)
                counts.append(trials_to_within(result.trials, best.ratio))
            needed[name] = counts
        # the tuner at a quarter of the space, confirmed live
        budget = max(4, -(-space // 4))
        chosen = tune(problem, Replay(recorded), profile, settings=SearchSettings(max_trials=budget))
        contenders = [c.decomposition for c in sorted(
            (m for m in chosen.trials if m.ok and m.decomposition.method == "ring"), key=lambda m: m.ratio)[:3]]
        live = LocalRunner().run(problem, [Decomposition.baseline(), *contenders],
                                 protocol.model_copy(update={"repeats": 15}))
        winner = min((m for m in live if m.ok), key=lambda m: m.ratio)
        rho = spearman([estimate(problem, m.decomposition, profile) for m in ok],
                       [m.candidate.median_s for m in ok])
        per_problem.append(dict(
            problem=problem.key, space=space, sweep_s=sweep_s, best=best.decomposition.id,
            best_speedup=1 / best.ratio, best_overall=best_overall.decomposition.id,
            best_overall_speedup=1 / best_overall.ratio, needed=needed, budget=budget,
            tuned=winner.decomposition.id, tuned_speedup=1 / winner.ratio,
            tuned_speedup_iqr=winner.speedup_iqr, spearman=rho,
        ))
        print(json.dumps(per_problem[-1]), file=sys.stderr, flush=True)
        rows.extend(m.model_dump(mode="json") for m in measured)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"problems": per_problem, "measurements": rows}))
    print(report(per_problem, args, profile))


def report(per_problem, args, profile) -> str:
    lines = [
        f"{len(per_problem)} problems, {args.seeds} seeds per strategy, {args.repeats} interleaved runs "
        "per trial; trials needed to come within 3% of the exhaustive best ring decomposition "
        "(median over seeds):\n",
        "| problem | space | best ring (speedup) | cmtune | optuna TPE | random | tuned at 1/4 budget "
        "| live speedup (IQR) | cost-model rank corr. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in per_problem:
        n = {k: statistics.median(v) for k, v in p["needed"].items()}
        lines.append(
            f"| `{p['problem']}` | {p['space']} | `{p['best']}` ({p['best_speedup']:.2f}x) | {n['cmtune']:.0f} "
            f"| {n['optuna-tpe']:.0f} | {n['random']:.0f} | `{p['tuned']}` | {p['tuned_speedup']:.2f}x "
            f"(±{p['tuned_speedup_iqr'] / 2:.2f}) | {p['spearman']:.2f} |"
        )
    med = {k: statistics.median([statistics.median(p["needed"][k]) for p in per_problem]) for k in STRATEGIES}
    frac = {k: statistics.median([statistics.median(p["needed"][k]) / p["space"] for p in per_problem])
            for k in STRATEGIES}
    lines.append("")
    lines.append("Median over problems: " + ", ".join(
        f"{k} {med[k]:.1f} trials ({frac[k]:.0%} of the space)" for k in STRATEGIES))
    lines.append(f"Median cost-model rank correlation: "
                 f"{statistics.median(p['spearman'] for p in per_problem):.2f}; profile: {profile.source}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
