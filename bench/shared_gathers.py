"""One gather for every projection that reads it: the Llama example's tuned step with sharing on and off.

    .venv/bin/python bench/shared_gathers.py                       # processes:2x4, tune + 2 fresh verify runs
    .venv/bin/python bench/shared_gathers.py --runs 3 --repeats 9 --step tiny_llama_step --devices virtual:8

Takes `examples/flax_linen_llama.py` (separate q/k/v, SwiGLU gate/up/down, ``nn.scan`` over ``nn.remat``,
``kernel_axes``, AdamW; ``data=2, model=4``) through the commands a user runs: ``cmtune tune --step``, then
``--runs`` fresh ``cmtune verify --step`` runs, each interleaving, round by round, the step as written (GSPMD,
the reference), the drop-in at the baseline, the drop-in with the tuned configs (sharing each normed activation's
gather: `collective_matmul.ops.share`) and ``tuned-no-share`` (the same configs, every projection gathering for
itself).  One row per run: the step as written's median, each variant's speedup over it and sharing's over
not sharing (medians of the per-round paired ratios, IQR in brackets).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.step import cmtune, speedup  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", default="llama_step", help="a step spec of examples/flax_linen_llama.py")
    parser.add_argument("--devices", default="processes:2x4")
    parser.add_argument("--trials", type=int, default=4, help="tuning trials per problem")
    parser.add_argument("--runs", type=int, default=2, help="fresh verify runs")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds per verify run")
    args = parser.parse_args()
    from collective_matmul.wire import StepMeasurement

    spec = f"examples/flax_linen_llama.py:{args.step}"
    directory = Path(tempfile.mkdtemp(prefix="cmtune-bench-share-"))
    bundle = directory / "tuned.json"
    _, tune_s = cmtune("tune", "--step", spec, "--devices", args.devices, "--trials", str(args.trials),
                       "--repeats", "5", "--out", str(bundle))
    rows = []
    for run in range(args.runs):
        record = directory / f"verify-{run}.json"
        out, verify_s = cmtune("verify", "--step", spec, "--devices", args.devices, "--bundle", str(bundle),
                               "--repeats", str(args.repeats), "--json", str(record))
        result = StepMeasurement.model_validate_json(record.read_text())
        if run == 0:
            print(next((line for line in out.splitlines() if "gather(s) shared" in line), "no gather shared"))
        rows.append(f"| {run + 1} | {result.variant('as-written').timing.median_s * 1e3:.0f} ms "
                    f"| {speedup(result, 'baseline')} | {speedup(result, 'tuned')} "
                    f"| {speedup(result, 'tuned-no-share')} | {speedup(result, 'tuned', 'tuned-no-share')} "
                    f"| {verify_s:.0f} s |")
        print(rows[-1], flush=True)
    print(f"\n{os.cpu_count()} CPUs, {spec} on {args.devices}, {args.repeats} interleaved rounds per variant; "
          f"tuning {args.trials} trials per problem ({tune_s:.0f} s)\n")
    print("| run | as written (GSPMD) | drop-in, baseline | tuned, sharing | tuned, no sharing | sharing vs not "
          "| verify |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"bundle and step records: {directory}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/step-*.result.jsonl

    with recorded("step", runs="fresh cmtune verify --step runs (--runs) x interleaved rounds (--repeats)"):
        main()
