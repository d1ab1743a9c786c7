"""Benchmark: how many trials each search strategy needs to find a near-best decomposition, and what warm
start saves.

    python bench/search.py                                  # 10 problems + the demo preset's 9, 8 virtual devices
    python bench/search.py --seeds 5 --repeats 5
    python bench/search.py --replay bench/results/search.json   # the same analysis from recorded sweeps
    python bench/search.py --problems ag:64x8x8:float32:8 ag:128x8x8:float32:8 --demo-model tiny \\
        --seeds 1 --repeats 1 --no-live                     # a smoke run

1. Every problem's whole space is timed exhaustively (the tuner's protocol, real devices), or read back
   from an earlier run's JSON (``--replay``).
2. The study engine then runs over those recorded measurements (a replay: every strategy sees the same
   numbers, so the comparison is of the strategies, not of the noise), once per seed, until the space is
   exhausted: the tuner's default (the static cost-model profile of the platform, then TPE), the tuner
   with warm start, plain Optuna TPE (random startup of 10) and random search.  For each: the trials
   (the baseline, always first, included) until the best ring found is within 3% of the exhaustive best
   ring (the baseline is not the target: where it wins, every strategy would "find" it at trial 1).
   Warm start: every other problem of the run is taken as tuned (its study at the default budget,
   unseeded, replayed), and the problem's seeds are those `cmtune.tuner.warm.seeds` takes from them.
3. With the default budget and stop rule, with and without warm start: the trials a study spends,
   why it stopped, and how far its tuned config is from the exhaustive best (baseline included).
4. The demo preset, tuned problem after problem as `cmtune tune --model demo` does (each seeded from
   the ones before it) with the demo's budget of 4 trials: the total trials with and without.
5. The tuner's choice at the default budget is timed again, live, against the baseline (15
   interleaved runs): the speedup a user would get (``--no-live`` skips it).
6. The cost model's ranking is compared with the measured one (Spearman rank correlation).
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

PROBLEMS = [  # families of the same collective and dtype, so that each problem has tuned neighbours
    "allgather_matmul:512x256x1024:float32:8",
    "allgather_matmul:1024x512x1024:float32:8",
    "allgather_matmul:2048x256x2048:float32:8",
    "allgather_matmul:512x512x1024:bfloat16:8",
    "allgather_matmul:1024x512x1024:bfloat16:8",
    "matmul_reduce_scatter:512x1024x256:float32:8",
    "matmul_reduce_scatter:1024x1024x512:float32:8",
    "matmul_reduce_scatter:2048x2048x256:float32:8",
    "matmul_reduce_scatter:512x1024x512:bfloat16:8",
    "matmul_reduce_scatter:1024x1024x512:bfloat16:8",
]
STRATEGIES = {
    "cmtune": dict(sampler="auto"),
    "cmtune+warm": dict(sampler="auto", warm=True),
    "optuna-tpe": dict(sampler="tpe", seed_with_model=False, startup=10),
    "random": dict(sampler="random"),
}
DEMO_TRIALS = 4  # `cmtune demo`'s budget per problem
TOLERANCE = 0.03


class Replay:
    """A runner that answers every trial from recorded measurements (`cmtune.workers.runner.Runner`)."""

    def __init__(self, recorded):
        self.recorded = recorded  # problem key -> decomposition -> Measurement

    def run(self, task):
        from collective_matmul.wire import result_of

        return result_of(task.kind, [self.recorded[task.problem.key][c] for c in task.decompositions])


def replayed(recorded, problem, hardware, settings):
    """One study of ``problem`` to its end over the recorded measurements (the engine, an in-memory store)."""
    from cmtune.workers.local import LocalTuner
    from collective_matmul.wire import MeasurementProtocol

    return LocalTuner(Replay(recorded)).tune(problem, hardware, settings, MeasurementProtocol(repeats=1))


def trials_to_within(trials, best_ratio: float, tolerance: float = TOLERANCE) -> int:
    """Trials (in order, the baseline included) until the best ring so far is within ``tolerance`` of
    ``best_ratio``; one more than there are if never."""
    best = float("inf")
    for i, t in enumerate(trials, 1):
        if t.ratio is not None and t.decomposition.method == "ring":
            best = min(best, t.ratio)
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


def demo_problems(model: str):
    from collective_matmul.planning.models import PRESETS, MeshSpec, model_problems

    return [mp.problem for mp in model_problems(PRESETS[model], MeshSpec(axes={"data": 1, "model": 8}))]


def record(specs, args):
    """Problem key -> decomposition -> Measurement: swept here, or read back from ``--replay``."""
    from collective_matmul.wire import Measurement

    if args.replay:
        rows = json.loads(Path(args.replay).read_text())["measurements"]
        recorded: dict = {}
        for row in rows:
            m = Measurement.model_validate(row)
            recorded.setdefault(m.problem.key, {})[m.decomposition] = m
        missing = [p.key for p in specs if p.key not in recorded]
        if missing:
            raise SystemExit(f"{args.replay} has no sweep of {missing}: run without --replay to time them")
        return recorded, {}
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from cmtune.workers.sweep import sweep
    from collective_matmul.wire import MeasurementProtocol

    recorded, sweep_s = {}, {}
    for problem in specs:
        started = time.perf_counter()
        recorded[problem.key] = {m.decomposition: m for m in sweep(problem,
                                                                   protocol=MeasurementProtocol(repeats=args.repeats))}
        sweep_s[problem.key] = time.perf_counter() - started
        print(f"swept {problem.key} in {sweep_s[problem.key]:.0f} s", file=sys.stderr, flush=True)
    return recorded, sweep_s


def ratio_of(measured, decomposition) -> float:
    """What the recorded sweep says ``decomposition`` costs, relative to the baseline (the baseline: 1)."""
    m = measured[decomposition]
    return 1.0 if decomposition.method == "baseline" else m.ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", nargs="+", default=PROBLEMS)
    parser.add_argument("--demo-model", default="demo", help="preset tuned problem after problem ('' skips it)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--replay", help="an earlier run's JSON: no timing, the same analysis")
    parser.add_argument("--live", action=argparse.BooleanOptionalAction, default=True,
                        help="time each tuned choice again, live (not with --replay)")
    parser.add_argument("--warm-agreement", type=float, help="the stop rule's tolerance (default: SearchSettings')")
    parser.add_argument("--warm-patience", type=int, help="trials after an agreeing seed (default: SearchSettings')")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "search.json"))
    args = parser.parse_args()
    rule = {name: value for name, value in (("warm_agreement", args.warm_agreement),
                                             ("warm_patience", args.warm_patience)) if value is not None}

    import optuna

    from cmtune.tuner.search import SearchSettings
    from cmtune.tuner.search_studies import profile_name_for, study_settings
    from cmtune.tuner.warm import seeds
    from collective_matmul import Problem
    from collective_matmul.planning.costmodel import PROFILES, estimate, no_figures, profile_for

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    problems = [Problem.parse(spec) for spec in args.problems]
    demo = demo_problems(args.demo_model) if args.demo_model else []
    specs = list({p.key: p for p in [*problems, *demo]}.values())
    recorded, sweep_s = record(specs, args)
    if not args.replay:  # the sweeps first: what the analysis below does can be redone from them (--replay)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"measurements": [m.model_dump(mode="json") for by in recorded.values()
                                                               for m in by.values()]}))
    hardware = next(iter(next(iter(recorded.values())).values())).hardware.identity()
    profile = profile_name_for(hardware)
    shown = profile if profile_for(hardware) is not None else f"{profile} ({no_figures(hardware)})"

    # every problem tuned as a study would tune it alone: the neighbours of the others
    alone = {p.key: replayed(recorded, p, hardware, study_settings(p, hardware)) for p in specs}
    known = {key: outcome.known() for key, outcome in alone.items()}

    def warm_seeds(problem):
        return seeds(problem, hardware, [k for key, k in known.items() if k is not None and key != problem.key])

    per_problem = []
    for problem in specs:
        measured = recorded[problem.key]
        ok = [m for m in measured.values() if m.ok]
        best_overall = min(ok, key=lambda m: ratio_of(measured, m.decomposition))
        best = min((m for m in ok if m.decomposition.method == "ring"), key=lambda m: m.ratio)
        warm = warm_seeds(problem)
        needed = {}
        for name, options in STRATEGIES.items():
            options = dict(options)
            if options.pop("warm", False):
                if not warm:
                    continue
                options.update(seeds=warm, warm_patience=None)  # the order alone: run to exhaustion
            needed[name] = [trials_to_within(replayed(recorded, problem, hardware, SearchSettings(
                seed=seed, profile=profile, **options)).search, best.ratio) for seed in range(args.seeds)]
        budgeted = {}
        for name, chosen in (("cold", ()), ("warm", warm)):
            outcome = alone[problem.key] if not chosen else replayed(
                recorded, problem, hardware, study_settings(problem, hardware, seeds=chosen).model_copy(update=rule))
            tuned = outcome.tuned.decomposition if outcome.tuned else None
            budgeted[name] = dict(trials=len(outcome.search), stop=outcome.study.stop_reason, tuned=tuned and tuned.id,
                                  regret=ratio_of(measured, tuned) / ratio_of(measured, best_overall.decomposition)
                                  - 1 if tuned else None)
        rho = spearman([estimate(problem, m.decomposition, PROFILES[profile]) for m in ok],
                       [m.candidate.median_s for m in ok])
        entry = dict(problem=problem.key, space=len(measured), sweep_s=sweep_s.get(problem.key),
                     best=best.decomposition.id, best_speedup=1 / best.ratio,
                     best_overall=best_overall.decomposition.id,
                     best_overall_speedup=1 / ratio_of(measured, best_overall.decomposition),
                     seeds=[s.model_dump(mode="json") for s in warm], needed=needed, budgeted=budgeted,
                     spearman=rho, demo=problem in demo, listed=problem in problems)
        if args.live and not args.replay:
            entry.update(live(problem, alone[problem.key], args))
        per_problem.append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)

    demo_run = tune_in_turn(recorded, demo, hardware, rule) if demo else None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "problems": per_problem, "demo": demo_run, "profile": profile, "stop_rule": rule,
        "measurements": [m.model_dump(mode="json") for by in recorded.values() for m in by.values()]}))
    print(report(per_problem, demo_run, args, shown))


def tune_in_turn(recorded, problems, hardware, rule: dict) -> dict:
    """``problems`` tuned one after the other at the demo's budget, as `cmtune tune` does: each seeded from the
    studies before it (warm, with the stop ``rule``'s settings) or not (cold); the trials each spent and what it
    chose."""
    from cmtune.tuner.search_studies import study_settings
    from cmtune.tuner.warm import seeds
    from cmtune.workers.local import LocalTuner
    from collective_matmul.wire import MeasurementProtocol

    out = {}
    for name in ("cold", "warm"):
        tuner, outcomes = LocalTuner(Replay(recorded)), []
        for problem in problems:
            known = [k for k in (o.known() for o in outcomes) if k is not None]
            chosen = seeds(problem, hardware, known) if name == "warm" else ()
            settings = study_settings(problem, hardware, trials=DEMO_TRIALS, seeds=chosen).model_copy(update=rule)
            outcomes.append(tuner.tune(problem, hardware, settings, MeasurementProtocol(repeats=1)))
        out[name] = [dict(problem=o.study.problem.key, trials=len(o.search), stop=o.study.stop_reason,
                          tuned=o.tuned.decomposition.id if o.tuned else None, seeds=len(o.study.settings.seeds))
                     for o in outcomes]
    return out


def live(problem, outcome, args) -> dict:
    """The tuned study's confirmation set timed again on the devices (15 interleaved runs): what a user gets."""
    from cmtune.workers.runner import LocalRunner
    from collective_matmul.wire import MeasurementProtocol, TrialKind, TrialTask

    contenders = [c for c in outcome.trials if c.kind == TrialKind.CONFIRM]
    configs = list(contenders[-1].decompositions) if contenders else [outcome.tuned.decomposition]
    task = TrialTask(id=0, study_id=0, kind=TrialKind.CONFIRM, problem=problem, decomposition=None,
                     decompositions=configs, protocol=MeasurementProtocol(repeats=15))
    result = LocalRunner().run(task)  # a confirmation: its measurements, then the problem's bounds
    winner = min((m for m in result.measurements if m.ok), key=lambda m: m.ratio)
    return dict(tuned=winner.decomposition.id, tuned_speedup=1 / winner.ratio, tuned_speedup_iqr=winner.speedup_iqr)


def _median(values) -> float:
    return statistics.median(values) if values else float("nan")


def report(per_problem, demo_run, args, profile) -> str:
    lines = [
        f"{len(per_problem)} problems, {args.seeds} seeds per strategy; trials (the baseline included) to come "
        f"within {TOLERANCE:.0%} of the exhaustive best ring decomposition (median over seeds); warm start: the "
        "other problems of the run tuned at the default budget:\n",
        "| problem | space | best ring (speedup) | cmtune | cmtune + warm start | optuna TPE | random | seeds from "
        "| cost-model rank corr. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in per_problem:
        n = {k: _median(v) for k, v in p["needed"].items()}
        warm = f"{n['cmtune+warm']:.0f}" if "cmtune+warm" in n else "-"
        sources = ", ".join(dict.fromkeys(s["neighbour"].split(":")[1] for s in p["seeds"])) or "-"
        lines.append(f"| `{p['problem']}` | {p['space']} | `{p['best']}` ({p['best_speedup']:.2f}x) "
                     f"| {n['cmtune']:.0f} | {warm} | {n['optuna-tpe']:.0f} | {n['random']:.0f} | {sources} "
                     f"| {p['spearman']:.2f} |")
    seeded = [p for p in per_problem if "cmtune+warm" in p["needed"]]
    med = {k: _median([_median(p["needed"][k]) for p in seeded]) for k in STRATEGIES}
    lines.append("")
    lines.append(f"Median over the {len(seeded)} problems with tuned neighbours: " + ", ".join(
        f"{k} {med[k]:.1f} trials" for k in STRATEGIES))
    lines.append(f"Median cost-model rank correlation: {_median([p['spearman'] for p in per_problem]):.2f}; "
                 f"profile: {profile}")
    lines += ["", "At the default budget and stop rule, without and with warm start (regret: the tuned config's "
              "recorded time over the exhaustive best's, baseline included, minus 1):\n",
              "| problem | trials cold | trials warm | stopped by (warm) | tuned cold (regret) | tuned warm (regret) "
              "| live speedup (IQR) |", "|---|---|---|---|---|---|---|"]
    for p in per_problem:
        cold, warm = p["budgeted"]["cold"], p["budgeted"]["warm"]
        live_text = (f"{p['tuned_speedup']:.2f}x (±{p['tuned_speedup_iqr'] / 2:.2f})" if "tuned_speedup" in p
                     else "-")
        lines.append(f"| `{p['problem']}` | {cold['trials']} | {warm['trials']} | {warm['stop']} "
                     f"| `{cold['tuned']}` ({_pct(cold['regret'])}) | `{warm['tuned']}` ({_pct(warm['regret'])}) "
                     f"| {live_text} |")
    cold_total = sum(p["budgeted"]["cold"]["trials"] for p in per_problem)
    warm_total = sum(p["budgeted"]["warm"]["trials"] for p in per_problem)
    lines.append("")
    lines.append(f"Trials in all: {cold_total} cold, {warm_total} warm; median regret "
                 f"{_pct(_median([p['budgeted']['cold']['regret'] or 0 for p in per_problem]))} cold, "
                 f"{_pct(_median([p['budgeted']['warm']['regret'] or 0 for p in per_problem]))} warm")
    if demo_run:
        lines += ["", f"The {args.demo_model} preset tuned problem after problem ({DEMO_TRIALS} trials each), "
                  "each seeded from those before it:\n",
                  "| problem | trials cold | trials warm (seeds) | stopped by (warm) | tuned cold | tuned warm |",
                  "|---|---|---|---|---|---|"]
        for cold, warm in zip(demo_run["cold"], demo_run["warm"], strict=True):
            lines.append(f"| `{cold['problem']}` | {cold['trials']} | {warm['trials']} ({warm['seeds']}) "
                         f"| {warm['stop']} | `{cold['tuned']}` | `{warm['tuned']}` |")
        lines.append("")
        lines.append(f"Total: {sum(r['trials'] for r in demo_run['cold'])} trials cold, "
                     f"{sum(r['trials'] for r in demo_run['warm'])} warm")
    return "\n".join(lines)


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.1%}"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/search-*.result.jsonl

    with recorded("search", runs="5 seeds per strategy, 5 interleaved runs per trial"):
        main()
