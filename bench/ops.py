"""Benchmark: the baseline against every candidate decomposition, on real (virtual) devices.

    python bench/ops.py                       # 8 virtual devices, then a 2-process gloo cluster
    python bench/ops.py --devices virtual:8   # one mode only
    python bench/ops.py --repeats 9 --problems 'ag:512x256x1024:float32:8'

Per problem: every valid decomposition is timed against the baseline with the tuner's protocol
(warm-up, then candidate and baseline alternately, ``--repeats`` runs each; the speedup is the
median of the paired baseline/candidate ratios, with its interquartile range), then the problem's
bounds (the local matmul alone, the collective alone and the baseline, in turn each round;
`collective_matmul.wire.bounds`).  Writes every measurement and the bounds as JSON lines under
bench/results/ and prints a Markdown summary: the best candidate, and the compute, communication,
bound and hidden fraction it reached, with the reason in words.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBLEMS = [
    "allgather_matmul:512x256x1024:float32:8",
    "allgather_matmul:2048x1024x2048:float32:8",
    "allgather_matmul:1024x512x2048:bfloat16:8",
    "matmul_reduce_scatter:512x1024x256:float32:8",
    "matmul_reduce_scatter:2048x2048x1024:float32:8",
    "matmul_reduce_scatter:1024x2048x512:bfloat16:8",
]


def run_mode(args) -> None:
    """Run the sweep in this process (or as one process of a launched group)."""
    from cmtune.workers.cluster import ClusterSpec, join

    cluster = ClusterSpec.from_env()
    if cluster is not None:
        join(cluster)
    else:
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
    import jax

    from cmtune.workers.measure import MeasurementProtocol, OpSession
    from cmtune.workers.sweep import sweep
    from collective_matmul import Problem

    protocol = MeasurementProtocol(repeats=args.repeats, warmup=args.warmup)
    lines = []
    for spec in args.problems:
        problem = Problem.parse(spec)
        started = time.perf_counter()
        session = OpSession(problem, protocol=protocol)
        results = sweep(problem, protocol=protocol, session=session)
        lines.extend(m.model_dump_json() for m in results)
        lines.append(session.bounds().model_dump_json())  # every process: the bounds rounds are SPMD too
        if jax.process_index() == 0:
            print(f"{problem.key}: {len(results)} candidates in {time.perf_counter() - started:.0f}s",
                  file=sys.stderr, flush=True)
    if jax.process_index() == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


def summarize(path: Path, mode: str) -> str:
    from cmtune.report import bounds_of
    from cmtune.workers.measure import Measurement
    from collective_matmul.wire import BoundsMeasurement
    from collective_matmul.wire.bounds import verdict

    rows: list[Measurement] = []
    bounds: dict[str, BoundsMeasurement] = {}
    for line in path.read_text().splitlines():
        if not line:
            continue
        if "decomposition" in json.loads(line):
            rows.append(Measurement.model_validate_json(line))
        else:
            b = BoundsMeasurement.model_validate_json(line)
            bounds[b.problem.key] = b
    by_problem: dict[str, list[Measurement]] = {}
    for m in rows:
        by_problem.setdefault(m.problem.key, []).append(m)
    out = [
        f"\n### {mode}: {rows[0].hardware.key} (jax {rows[0].hardware.jax_version}), "
        f"{rows[0].protocol.repeats} interleaved runs per candidate\n",
        "| problem | baseline median (IQR) | baseline vs itself | best candidate | best speedup (IQR) "
        "| worst speedup | faster than baseline | candidates | compute | communication | bound | hidden fraction "
        "| why |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, results in by_problem.items():
        ok = [m for m in results if m.ok and m.decomposition.method == "ring"]
        base = next(m for m in results if m.decomposition.method == "baseline")
        best = min(ok, key=lambda m: m.ratio)
        worst = max(ok, key=lambda m: m.ratio)
        faster = sum(1 for m in ok if m.ratio < 1 and (1 / m.ratio - 1) > _half_spread(m))
        medians = [m.baseline.median_s for m in results if m.baseline]
        b = bounds_of(bounds.get(key))
        # the best ring's own paired ratio against the baseline of its rounds, the bound against the bounds rounds'
        words = verdict(b, best.ratio, ring=True) if best.ratio < 1 else verdict(b, 1.0, ring=False,
                                                                                  best_ring_ratio=best.ratio)
        cells = ([f"{v * 1e3:.2f} ms" for v in (b.compute_s, b.communication_s, b.bound_s)] if b
                 else [str(bounds[key].status) if key in bounds else "-"] * 3)
        out.append(
            f"| `{key}` | {statistics.median(medians) * 1e3:.2f} ms ({base.baseline.iqr_s * 1e3:.2f}) "
            f"| {1 / base.ratio:.2f}x | `{best.decomposition.id}` | {1 / best.ratio:.2f}x "
            f"(±{_half_spread(best):.2f}) | {1 / worst.ratio:.2f}x | {faster} of {len(ok)} "
            f"| {len(results)} ({len(results) - len(ok) - 1} failed) | {' | '.join(cells)} "
            f"| {_fraction(b, best)} | {words} |"
        )
    return "\n".join(out)


def _fraction(bounds, best) -> str:
    """The best ring's hidden fraction, 0 where no ring beat the baseline ("-": nothing to hide, or no bounds)."""
    from collective_matmul.wire.bounds import hidden_fraction

    ring = best.ratio < 1
    fraction = hidden_fraction(bounds, best.ratio if ring else 1.0, ring=ring)
    return "-" if fraction is None else f"{fraction:.0%}"


def _half_spread(m) -> float:
    """Half the IQR of the speedup, to first order from the ratio's IQR."""
    return m.speedup_iqr / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="both", choices=["both", "virtual:8", "processes:2"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--problems", nargs="+", default=PROBLEMS)
    parser.add_argument("--out", default=None, help="JSON lines file (one mode only)")
    parser.add_argument("--run-here", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_here:
        return run_mode(args)
    from cmtune.workers.cluster import launch

    modes = ["virtual:8", "processes:2"] if args.devices == "both" else [args.devices]
    summary = []
    for mode in modes:
        out = Path(args.out or ROOT / "bench" / "results" / f"ops-{mode.replace(':', '')}.jsonl")
        argv = [str(Path(__file__).resolve()), "--run-here", "--repeats", str(args.repeats),
                "--warmup", str(args.warmup), "--out", str(out), "--problems", *args.problems]
        started = time.perf_counter()
        if mode == "virtual:8":
            subprocess.run([sys.executable, *argv], check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        else:
            results = launch(2, argv, local_devices=4, timeout_s=7200)
            sys.stderr.write(results[0].stderr)
        print(f"{mode}: {time.perf_counter() - started:.0f}s", file=sys.stderr)
        summary.append(summarize(out, "8 virtual devices, 1 process" if mode == "virtual:8"
                                 else "2 processes x 4 devices, gloo on loopback"))
    print("\n".join(summary))
    print(json.dumps({"modes": modes, "problems": args.problems}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/ops-*.result.jsonl

    with recorded("ops", runs="interleaved rounds of candidate and baseline per candidate (--repeats, --warmup)"):
        main()
