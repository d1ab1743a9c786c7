"""Benchmark the whole training step: tuned configs against what a user would otherwise run.

    python bench/step.py                                   # 3 block sizes, processes:2 and virtual:8 (~1 h)
    python bench/step.py --sizes demo --devices processes:2 --repeats 9
    python bench/step.py --example --devices processes:2x4 --runs 2   # the NNX GPT example, as a user runs it
    python bench/step.py --example wide_gpt_step --devices processes:2x4  # the same, heads of 128

``--example`` takes `examples/flax_nnx_gpt.py:gpt_step` (the demo preset's shapes) through the commands a
user runs: ``cmtune tune --step``, ``cmtune verify --step --decide`` (the step decision writes its
overrides into the bundle), then ``--runs`` fresh ``cmtune verify --step`` runs: the step as written
(GSPMD) against the drop-in with the tuned configs and overrides, and against the drop-in at the
baseline, interleaved round by round.  See `example_main`.

For every block size and device layout:

1. `cmtune tune --model <block> --mesh data=1,model=8 --devices <layout>` tunes every problem of the
   step (forward, input and weight gradients) and writes a bundle.
2. The step study, as a worker runs it: one `StepSession` times the step variants
   (`standard_variants`: plain autodiff, the all-baseline custom VJP, the op-tuned configs, the
   whole-step alternatives and the per-role ablation) and `step_decision` picks what runs; its
   overrides go into the bundle, as the service stores them.
3. A fresh confirmation in the same session, interleaved round-robin (slowest process per run),
   so the decision's own samples never grade it: ``as-written`` (the block as a user writes it
   without cmtune: GSPMD einsums, JAX's autodiff; the reference), ``baseline`` (the custom VJP,
   every role at the baseline), ``tuned`` (what cmtune runs: the op-tuned configs and the step
   decision's overrides), ``op-tuned`` (the per-problem winners alone), ``costmodel`` (each
   problem's cost-model favourite, no tuning) and ``always-ring`` (one fixed ring for every
   forward, input and weight gradient: what a user of XLA's size-threshold flag gets once a
   shape crosses it).
4. The op-level estimate (the op-tuned configs' time saved per layer, summed from the bundle's
   confirmation rounds) against the step as measured (all-baseline minus op-tuned).

Prints one markdown table (speedups: median of the paired per-round ratios to the step as written,
IQR in brackets) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    "small": dict(d_model=512, d_ff=1024, heads=8, head_dim=16, seq_len=512, global_batch=4),
    "demo": dict(d_model=1024, d_ff=2048, heads=8, head_dim=16, seq_len=512, global_batch=4),
    "large": dict(d_model=1536, d_ff=3072, heads=8, head_dim=32, seq_len=512, global_batch=4),
}
VARIANTS = ("as-written", "baseline", "tuned", "op-tuned", "costmodel", "always-ring")


def block_file(name: str, directory: Path) -> Path:
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"name": f"bench-{name}", "dtype": "float32", "layers": 1, **SIZES[name]}))
    return path


def tune(block: Path, devices: str, bundle: Path, trials: int, repeats: int) -> float:
    _, seconds = cmtune("tune", "--model", str(block), "--mesh", "data=1,model=8", "--devices", devices,
                        "--trials", str(trials), "--repeats", str(repeats), "--out", str(bundle))
    return seconds


def measure(block: Path, devices: str, bundle: Path, repeats: int, out: Path) -> None:
    """Run this file's `--step` mode on ``devices`` (a gloo group for processes:N)."""
    argv = [str(Path(__file__)), "--step", str(block), "--bundle", str(bundle), "--repeats", str(repeats),
            "--json", str(out)]
    kind, _, count = devices.partition(":")
    if kind == "processes":
        from cmtune.tuner.cluster import launch

        launch(int(count), argv, local_devices=8 // int(count), cwd=ROOT, timeout_s=3600)
    else:
        subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, env=os.environ | {"CMTUNE_VIRTUAL": count})


def step_main(block_path: str, bundle: str, repeats: int, out: str) -> None:
    """One process of the step measurement (every process of a group runs this, SPMD: the decision
    is a function of the measurement, which every process holds whole)."""
    from cmtune.tuner.cluster import ClusterSpec, DeviceSpec, configure

    configure(DeviceSpec("virtual", int(os.environ.get("CMTUNE_VIRTUAL", "8"))) if ClusterSpec.from_env() is None
              else DeviceSpec("auto"))
    import jax

    from cmtune.tuner.engine import step_decision
    from cmtune.tuner.step import StepSession, standard_variants, step_layout
    from cmtune.tuner.variants import ring_everywhere
    from collective_matmul import AS_WRITTEN, Bundle, FixedConfigs, Tuned, configs_per_role, ring_hardware
    from collective_matmul.models import MeshSpec, TransformerBlock
    from collective_matmul.wire import Protocol

    block = TransformerBlock.model_validate_json(Path(block_path).read_text())
    layout = step_layout(block, MeshSpec.parse("data=1,model=8"), jax.devices())
    where = dict(mesh=layout.mesh, axis=layout.axis, batch_axis=layout.batch_axis)
    op_tuned = configs_per_role(Tuned(bundle=bundle), layout.block, **where)
    session = StepSession(layout.block, layout.mesh, axis=layout.axis, batch_axis=layout.batch_axis,
                          protocol=Protocol(repeats=repeats, warmup=2))
    decided = session.measure(standard_variants(op_tuned))
    decision = step_decision(decided, op_tuned)
    variants = {
        "as-written": AS_WRITTEN,
        "baseline": FixedConfigs(),
        "tuned": FixedConfigs(op_tuned | decision.overrides),
        "op-tuned": FixedConfigs(op_tuned),
        "costmodel": FixedConfigs(configs_per_role(Tuned(), layout.block, **where)),
        "always-ring": FixedConfigs(ring_everywhere()),
    }
    confirmed = session.measure(variants)
    if jax.process_index() == 0:
        tuned = Bundle.load(bundle)
        for override in decision.role_overrides(block.name, ring_hardware(layout.mesh, layout.axis)):
            tuned.add_override(override)
        tuned.save(bundle)
        Path(out).write_text(json.dumps({"decided": decided.model_dump(mode="json"), "decision": decision.variant,
                                         "summary": decision.summary,
                                         "confirmed": confirmed.model_dump(mode="json")}))


def estimate_saved(block: Path, bundle: Path) -> float:
    """Time saved per layer by the tuned configs, by the ops' confirmation rounds (baseline - tuned)."""
    from collective_matmul.bundle import Bundle
    from collective_matmul.models import MeshSpec, TransformerBlock, role_problems

    configs = Bundle.load(bundle)
    saved = 0.0
    for slots in role_problems(TransformerBlock.model_validate_json(block.read_text()),
                               MeshSpec.parse("data=1,model=8")).values():
        for problem in slots.values():
            entry = next((c for c in configs.configs if c.problem == problem), None)
            saved += (entry.baseline_s - entry.time_s) if entry is not None else 0.0
    return saved


def speedup(result, name: str) -> str:
    q = result.paired(name, result.reference)
    if q is None:
        return f"{result.variant(name).status}"
    return f"{1 / q[1]:.2f}x ({1 / q[2]:.2f}-{1 / q[0]:.2f})"


EXAMPLES = {"gpt_step": "d_model 1024, d_ff 2048, 8 heads of 16 (the demo preset's shapes), 2 layers",
            "wide_gpt_step": "d_model 1024, d_ff 2048, 8 heads of 128, 2 layers",
            "one_layer_gpt_step": "d_model 1024, d_ff 2048, 8 heads of 16, one layer"}


def cmtune(*args: str) -> tuple[str, float]:
    """Run a ``cmtune`` command; its output and seconds."""
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "cmtune", *args], cwd=ROOT, capture_output=True, text=True,
                         env=os.environ | {"COLUMNS": "250"})
    if run.returncode != 0:
        raise RuntimeError(f"cmtune {' '.join(args)} failed:\n{run.stdout[-4000:]}\n{run.stderr[-3000:]}")
    return run.stdout, time.monotonic() - started


def example_main(args) -> None:
    """The NNX GPT example through the user's commands: tune, verify --decide, then fresh verify runs.

    Prints one markdown row per fresh run: the step as written (its median), the drop-in at the
    baseline and with the tuned configs (speedups: median of the paired per-round ratios to the
    step as written, IQR in brackets), each variant's compile seconds, and the decision.
    """
    from collective_matmul.wire import StepMeasurement

    devices = args.devices[0] if args.devices != ["processes:2", "virtual:8"] else "processes:2x4"
    name = args.example
    if name not in EXAMPLES:
        raise SystemExit(f"--example: one of {sorted(EXAMPLES)}")
    example = f"examples/flax_nnx_gpt.py:{name}"
    directory = Path(tempfile.mkdtemp(prefix="cmtune-bench-example-"))
    bundle = directory / "tuned.json"
    _, tune_s = cmtune("tune", "--step", example, "--devices", devices, "--trials", str(args.trials),
                       "--repeats", "5", "--out", str(bundle))
    decided = directory / "decided.json"
    out, decide_s = cmtune("verify", "--step", example, "--devices", devices, "--bundle", str(bundle), "--decide",
                           "--repeats", str(args.repeats), "--json", str(decided))
    decision = next((line for line in out.splitlines() if line.startswith("decision:")), "decision: -")
    rows = []
    for run in range(args.runs):
        fresh = directory / f"fresh-{run}.json"
        _, verify_s = cmtune("verify", "--step", example, "--devices", devices, "--bundle", str(bundle),
                             "--repeats", str(args.repeats), "--json", str(fresh))
        result = StepMeasurement.model_validate_json(fresh.read_text())
        compiles = " / ".join(f"{v.compile_s:.1f}" for v in result.variants)
        rows.append(f"| {run + 1} | {devices} | {result.variant('as-written').timing.median_s * 1e3:.0f} ms "
                    f"| {speedup(result, 'baseline')} | {speedup(result, 'tuned')} | {compiles} | {verify_s:.0f} s |")
        print(rows[-1], flush=True)
    print(f"\n{os.cpu_count()} CPUs, {example} ({EXAMPLES[name]}, seq 512, batch 4, "
          f"float32, AdamW), {args.repeats} interleaved rounds per variant; tuning: {args.trials} trials per problem "
          f"({tune_s:.0f} s), decision {decide_s:.0f} s\n")
    print("| run | devices | as written (GSPMD) | drop-in, baseline | drop-in, tuned "
          "| compile s (as written / baseline / tuned) | verify |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{decision}\nbundle and step records: {directory}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,demo,large")
    parser.add_argument("--devices", nargs="+", default=["processes:2", "virtual:8"])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9, help="rounds of the step variants")
    parser.add_argument("--example", nargs="?", const="gpt_step", default=None,
                        help="the NNX GPT example instead of the blocks: gpt_step (default), wide_gpt_step or "
                             "one_layer_gpt_step")
    parser.add_argument("--runs", type=int, default=2, help="with --example: fresh verify runs after the decision")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--bundle", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        return step_main(args.step, args.bundle, args.repeats, args.json)
    if args.example:
        return example_main(args)
    from collective_matmul.wire import StepMeasurement

    directory = Path(tempfile.mkdtemp(prefix="cmtune-bench-step-"))
    rows, notes = [], []
    for devices in args.devices:
        for name in args.sizes.split(","):
            block = block_file(name, directory)
            stem = f"{name}-{devices.replace(':', '')}"
            bundle, out = directory / f"{stem}.bundle.json", directory / f"{stem}.step.json"
            tune_s = tune(block, devices, bundle, args.trials, 5)
            started = time.monotonic()
            measure(block, devices, bundle, args.repeats, out)
            record = json.loads(out.read_text())
            result = StepMeasurement.model_validate(record["confirmed"])
            tuned, base = result.variant("op-tuned"), result.variant("baseline")
            measured = (base.timing.median_s - tuned.timing.median_s) if tuned.ok and base.ok else None
            compiles = " / ".join(f"{result.variant(v).compile_s:.1f}" if result.variant(v).compile_s else "-"
                                  for v in VARIANTS)
            rows.append(
                f"| {name} ({SIZES[name]['d_model']}/{SIZES[name]['d_ff']}) | {devices} "
                f"| {result.variant('as-written').timing.median_s * 1e3:.0f} ms | {record['decision']} "
                + "".join(f"| {speedup(result, v)} " for v in VARIANTS[1:])
                + f"| {estimate_saved(block, bundle) * 1e3:.0f} ms | "
                + (f"{measured * 1e3:.0f} ms" if measured is not None else "-")
                + f" | {compiles} | {tune_s:.0f} s + {time.monotonic() - started:.0f} s |")
            notes.append(f"- {name}, {devices}: the step decision: {record['summary']}")
            print(rows[-1], flush=True)
    print(f"\n{os.cpu_count()} CPUs, {args.repeats} interleaved rounds per variant, float32, seq 512, batch 4, "
          f"data=1,model=8; tuning: {args.trials} trials per problem\n")
    print("| block (d_model/d_ff) | devices | as written (GSPMD) | step decision | all-baseline custom VJP | tuned "
          "| op-tuned | cost model | always ring | saved/layer estimated | saved/layer measured (op-tuned) "
          "| compile s (each variant) | tune + step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n" + "\n".join(notes))
    print(f"\nbundles (with the step decision's overrides) and step records: {directory}")


if __name__ == "__main__":
    main()
