"""Short programs timed right: the paired ratio of two ~50-200 µs programs, one call per sample against K calls.

    .venv/bin/python bench/short_programs.py                 # 8 virtual CPU devices, ~2 min
    .venv/bin/python bench/short_programs.py --runs 12 --problem ag:256x64x128:float32:8

A projection on an accelerator takes 50-500 µs, the same order as a dispatch and a barrier: timed one call per
sample, host noise decides a ratio.  The measurement protocol times K calls back to back per sample, K chosen at
warm-up so a sample lasts 50 times the overhead, at most 20 calls on CPU (`cmtune.workers.measure.
calls_per_sample`).  This times one pair (the problem's baseline and a ring) in interleaved runs, each run both
ways (one call, then K, then one, ...), and prints, per protocol, the median paired ratio of every run and their
spread (max - min and IQR over runs), with the mean within-run IQR.  On CPU devices the same dispatch cost is there
to see.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", default="ag:64x32x64:float32:8")
    parser.add_argument("--ring", default="xla", help="the other program (default: the product as written, the "
                                                       "baseline's twin: the ratio's noise floor)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    from cmtune.workers.measure import OpSession
    from collective_matmul import Decomposition, Problem
    from collective_matmul.wire import MeasurementProtocol

    problem, ring = Problem.parse(args.problem), Decomposition.from_id(args.ring)
    session = OpSession(problem)
    runs: dict[str, list] = {"one call": [], "K calls": []}
    started = time.monotonic()
    for i in range(args.runs):
        order = ("one call", "K calls") if i % 2 == 0 else ("K calls", "one call")
        for name in order:
            protocol = MeasurementProtocol(repeats=args.repeats, warmup=3, calls=1 if name == "one call" else None)
            runs[name].append(session.measure(ring, protocol))
    overhead = session.overhead_s
    print(f"{time.strftime('%Y-%m-%d')}, {problem.key}: {args.ring} against the baseline on 8 virtual CPU devices, "
          f"{args.runs} runs of {args.repeats} paired samples each protocol, interleaved "
          f"({time.monotonic() - started:.0f} s); a barrier and a dispatch cost {overhead * 1e6:.0f} µs here\n")
    print("| protocol | calls per sample | baseline per call (median) | paired ratio, median of runs "
          "| spread over runs (max - min) | IQR over runs | mean within-run IQR |")
    print("|---|---|---|---|---|---|---|")
    for name, measured in runs.items():
        ratios = [m.ratio for m in measured]
        q = statistics.quantiles(ratios, n=4, method="inclusive")
        print(f"| {name} | {measured[0].candidate.calls} | "
              f"{statistics.median(m.baseline.median_s for m in measured) * 1e6:.0f} µs | "
              f"{statistics.median(ratios):.3f} | {max(ratios) - min(ratios):.3f} | {q[2] - q[0]:.3f} | "
              f"{statistics.mean(m.ratio_iqr for m in measured):.3f} |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/short_programs-*.result.jsonl

    with recorded("short_programs", runs="--runs runs of --repeats paired samples per protocol, interleaved"):
        main()
