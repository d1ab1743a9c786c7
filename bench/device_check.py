"""The checks only an accelerator can answer, in one short run on one node (GPU or TPU host).

    bench/device_check.sh                      # writes device_check.jsonl and prints its tables (< 8 min)
    .venv/bin/python bench/device_check.py --quick --out /tmp/x.jsonl    # the same on this host's CPU devices

Per op family (all-gather matmul, matmul reduce-scatter, weight gradient), one problem sized for the devices
(bfloat16, a ring of every local device up to 8): the baseline, XLA's own windowed einsum where the backend has
one (``method="xla"``), and the cost model's first rings, each compiled, checked against the baseline and timed
by the measurement protocol (its calls per sample chosen at warm-up for the platform), with the schedule's
overlap verdict of each beside its measured speedup: a ring the verdict calls serialised should not win, one
that overlaps and still loses says the link or the matmul is the limit.  Every measurement is one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = {"allgather_matmul": (8192, 4096, 16384), "matmul_reduce_scatter": (8192, 16384, 4096),
            "allgather_grad_weight": (8192, 4096, 16384)}
QUICK = {"allgather_matmul": (512, 256, 512), "matmul_reduce_scatter": (512, 512, 256),
         "allgather_grad_weight": (512, 256, 512)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("device_check.jsonl"))
    parser.add_argument("--rings", type=int, default=6, help="the cost model's first rings timed per problem")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small shapes on CPU devices (this script's own test)")
    args = parser.parse_args()
    import jax

    if args.quick:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    from rich.console import Console

    from cmtune.report import sweep_table
    from cmtune.tuner.search import Searcher, SearchSettings
    from cmtune.workers.measure import OpSession, ring_mesh
    from collective_matmul import Decomposition, Problem
    from collective_matmul.planning.costmodel import profile_for
    from collective_matmul.planning.problem import Hardware
    from collective_matmul.wire import MeasurementProtocol

    console = Console()
    devices = jax.local_devices()[:8]
    ring = len(devices)
    platform = devices[0].platform
    hardware = Hardware.detect(devices)
    profile = profile_for(hardware)
    started = time.monotonic()
    console.print(f"{hardware.key}: {devices[0].device_kind} x {ring}, jax {jax.__version__}, profile "
                  f"{profile.name if profile else 'none (no cost-model figures)'}")
    with args.out.open("w") as out:
        for collective, (m, k, n) in (QUICK if args.quick else FAMILIES).items():
            problem = Problem(collective=collective, m=m, k=k, n=n, dtype="bfloat16", axis_size=ring)
            searcher = Searcher(problem, profile.name if profile else "generic", SearchSettings())
            rings = [c for c in searcher.by_model if c.method == "ring"][:args.rings]
            configs = [Decomposition.baseline(), *([Decomposition.xla()] if platform in ("tpu", "gpu") else []),
                       *rings]
            session = OpSession(problem, protocol=MeasurementProtocol(repeats=args.repeats), mesh=ring_mesh(devices))
            results = [session.measure(config) for config in configs]
            bounds = session.bounds()
            for record in [*results, bounds]:
                out.write(record.model_dump_json() + "\n")
            console.print(sweep_table(results, title=f"{problem.key} on {hardware.key}", bounds=bounds))
            verdicts = [(r.decomposition.id, r.overlap, r.speedup) for r in results if r.ok]
            console.print("verdict against the clock: " + json.dumps(verdicts))
    console.print(f"wrote {args.out} in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
