"""Benchmark the whole training step: tuned configs against what a user would otherwise run.

    python bench/step.py                                   # 3 block sizes, processes:2 and virtual:8 (~1 h)
    python bench/step.py --sizes demo --devices processes:2 --repeats 9 --search-rounds 6
    python bench/step.py --sizes smoke --devices virtual:8 --trials 2 --repeats 2  # the code path, in a minute
    python bench/step.py --example --devices processes:2x4 --runs 2   # the NNX GPT example, as a user runs it
    python bench/step.py --example wide_gpt_step --devices processes:2x4  # the same, heads of 128
    python bench/step.py --example --parts --devices processes:2x4 --runs 1   # and where its gain goes
    python bench/step.py --example examples/fsdp_step.py:fsdp_step --devices processes:2x4  # plain-JAX FSDP
    python bench/step_variants.py <dir>/large-processes2.step.json always-ring ...  # a search's variants side by side

``--example`` takes `examples/flax_nnx_gpt.py:gpt_step` (the demo preset's shapes) through the commands a
user runs: ``cmtune tune --step``, ``cmtune verify --step --decide`` (the step decision writes its
overrides into the bundle), then ``--runs`` fresh ``cmtune verify --step`` runs: the step as written
(GSPMD) against the drop-in with the tuned configs and overrides, and against the drop-in at the
baseline, interleaved round by round.  See `example_main`.

For every block size and device layout:

1. `cmtune tune --model <block> --mesh data=1,model=8 --devices <layout>` tunes every problem of the
   step (forward, input and weight gradients) and writes a bundle.
2. The step study, as the service runs it: the step search (`cmtune.tuner.stepsearch`, process 0
   deciding) starts from the fixed settings (the op-tuned configs, the all-baseline custom VJP, the
   cost model's whole-step choice, tuned-ring-fill, always-ring), then improves role by role over
   each slot's candidates (the bundle's entries for the problem as the runners-up), within
   ``--search-rounds``; its choice goes into the bundle as per-role overrides, as the service
   stores them.  The wall time of its rounds after the first is its extra cost.
3. A fresh confirmation in the same session, interleaved in rounds, each round in its own order
   (slowest process per run), so the search's own samples never grade it: ``as-written`` (the block as a user writes it
   without cmtune: GSPMD einsums, JAX's autodiff; the reference), every fixed setting
   (``baseline``: the custom VJP with every role at the baseline; ``op-tuned``: the per-problem
   winners alone; ``costmodel``: each problem's cost-model favourite, no tuning; ``always-ring``:
   one fixed ring for every forward, input and weight gradient, what a user of XLA's
   size-threshold flag gets once a shape crosses it; ``tuned-ring-fill``: the op-tuned rings, the
   fixed ring where they left the baseline) and ``searched`` (what cmtune runs: the search's
   choice), and ``always-ring-copy``, always-ring again under another name: the spread of one
   program timed against itself, the noise floor every other column's difference is read against.
4. The op-level estimate (the op-tuned configs' time saved per layer, summed from the bundle's
   confirmation rounds) against the step as measured (all-baseline minus op-tuned).

Prints two markdown tables for docs/benchmarks.md: every setting's speedup against the step as
written (GSPMD) and against cmtune's ops at the baseline (median of the paired per-round ratios,
IQR in brackets), whether the searched step is ahead of every fixed setting in 3 of 4 paired rounds
and whether it is a combination no fixed setting has, and the search's rounds and extra wall time.
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
    "smoke": dict(d_model=64, d_ff=128, heads=8, head_dim=8, seq_len=64, global_batch=2),
    "small": dict(d_model=512, d_ff=1024, heads=8, head_dim=16, seq_len=512, global_batch=4),
    "demo": dict(d_model=1024, d_ff=2048, heads=8, head_dim=16, seq_len=512, global_batch=4),
    "large": dict(d_model=1536, d_ff=3072, heads=8, head_dim=32, seq_len=512, global_batch=4),
}
FIXED = ("baseline", "op-tuned", "costmodel", "always-ring", "tuned-ring-fill")  # the fixed settings
VARIANTS = ("as-written", *FIXED, "searched")
COPY = "always-ring-copy"  # always-ring again under another name: the spread of one program against itself


def block_file(name: str, directory: Path) -> Path:
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"name": f"bench-{name}", "dtype": "float32", "layers": 1, **SIZES[name]}))
    return path


def tune(block: Path, devices: str, bundle: Path, trials: int, repeats: int) -> float:
    _, seconds = cmtune("tune", "--model", str(block), "--mesh", "data=1,model=8", "--devices", devices,
                        "--trials", str(trials), "--repeats", str(repeats), "--out", str(bundle))
    return seconds


def run_on(devices: str, argv: list[str], *, echo: bool = False) -> None:
    """Run ``python argv...`` on ``devices``: a gloo group of N processes for processes:N (each with 8/N CPU
    devices; with ``echo``, process 0's output is shown as it comes), else one process of N virtual devices
    (virtual:N, its output shown)."""
    kind, _, count = devices.partition(":")
    if kind == "processes":
        from cmtune.workers.cluster import launch

        launch(int(count), argv, local_devices=8 // int(count), cwd=ROOT, timeout_s=3600, echo_first=echo)
    else:
        subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, env=os.environ | {"CMTUNE_VIRTUAL": count})


def join_devices() -> None:
    """In a process `run_on` started: join its group, or take its virtual devices."""
    from cmtune.workers.cluster import ClusterSpec, DeviceSpec, configure

    configure(DeviceSpec("virtual", int(os.environ.get("CMTUNE_VIRTUAL", "8"))) if ClusterSpec.from_env() is None
              else DeviceSpec("auto"))


def laid_out_session(block, repeats: int):
    """``(layout, session)``: ``block`` laid out on a data=1,model=8 mesh of this group's devices, and a step session
    timing it in ``repeats`` interleaved rounds."""
    import jax

    from cmtune.workers.step import block_session, step_layout
    from collective_matmul.planning.models import MeshSpec
    from collective_matmul.wire import MeasurementProtocol

    layout = step_layout(block, MeshSpec.parse("data=1,model=8"), jax.devices())
    return layout, block_session(layout.block, layout.mesh, axis=layout.axis, batch_axis=layout.batch_axis,
                                 protocol=MeasurementProtocol(repeats=repeats, warmup=2))


def measure(block: Path, devices: str, bundle: Path, repeats: int, out: Path, search: tuple[int, int]) -> None:
    """Run this file's `--step` mode on ``devices``."""
    run_on(devices, [str(Path(__file__)), "--step", str(block), "--bundle", str(bundle), "--repeats", str(repeats),
                     "--json", str(out), "--search-rounds", str(search[0]), "--round-variants", str(search[1])])


def step_main(block_path: str, bundle: str, repeats: int, out: str, rounds: int, per_round: int) -> None:
    """One process of the step measurement (every process of a group runs this, SPMD: process 0 holds the
    search and shares each round, `cmtune.workers.step_rounds.run_step_search`)."""
    from cmtune.workers.cluster import Group

    join_devices()
    import jax

    from cmtune.tuner.stepsearch import SearchSpace, StepSearch
    from cmtune.tuner.variants import cost_model_configs, ring_everywhere, ring_fill
    from cmtune.workers.overrides import measured_configs
    from cmtune.workers.step import fixed_sources
    from cmtune.workers.step_rounds import run_step_search
    from collective_matmul import Bundle, OpConfigs, Tuned
    from collective_matmul.block import configs_per_role
    from collective_matmul.client.tuned import ring_hardware
    from collective_matmul.planning.models import MeshSpec, TransformerBlock, role_problems
    from collective_matmul.wire import StepRound

    block = TransformerBlock.model_validate_json(Path(block_path).read_text())
    layout, session = laid_out_session(block, repeats)
    where = dict(mesh=layout.mesh, axis=layout.axis, batch_axis=layout.batch_axis)
    hardware = ring_hardware(layout.mesh, layout.axis).identity()
    problems = role_problems(block, MeshSpec.parse("data=1,model=8"))
    op_tuned = configs_per_role(Tuned(bundle=bundle), layout.block, **where)
    group = Group()
    search = None
    if group.leader:
        history = Bundle.load(bundle).configs
        space = SearchSpace.of(op_tuned, problems, hardware, measured=lambda p: measured_configs(history, p))
        search = StepSearch(space, rounds=rounds, per_round=per_round, model=block.name)
    started = time.monotonic()
    grading, searched = run_step_search(search, lambda variants: session.measure(fixed_sources(variants)),
                                        group=group, say=lambda line: print(line, flush=True))
    search_total_s = time.monotonic() - started
    message = None
    if group.leader:
        decision = search.decide(grading)
        message = StepRound(kind="grade", round=len(searched), variants={"searched": search.names[decision.variant]})
    choice = group.share(message, StepRound).variants["searched"]
    fixed = {"baseline": {role: OpConfigs() for role in op_tuned}, "op-tuned": op_tuned,
             "costmodel": cost_model_configs(problems, hardware), "always-ring": ring_everywhere(),
             "tuned-ring-fill": ring_fill(op_tuned)}
    confirmed = session.measure(fixed_sources({"as-written": None, **fixed, "searched": choice,
                                               COPY: fixed["always-ring"]}))
    if jax.process_index() == 0:
        tuned = Bundle.load(bundle)
        for override in decision.role_overrides(block.name, hardware):
            tuned.add_override(override)
        tuned.save(bundle)
        Path(out).write_text(json.dumps({
            "rounds": [r.model_dump(mode="json") for r in searched],
            "grading": grading.model_dump(mode="json") if grading is not None else None,
            "decision": decision.variant, "summary": decision.summary, "search_s": decision.record.search_s,
            "search_total_s": search_total_s, "new": all(choice != setting for setting in fixed.values()),
            "confirmed": confirmed.model_dump(mode="json")}))


def estimate_saved(block: Path, bundle: Path) -> float:
    """Time saved per layer by the tuned configs, by the ops' confirmation rounds (baseline - tuned)."""
    from collective_matmul.planning.models import MeshSpec, TransformerBlock, role_problems
    from collective_matmul.wire.bundle import Bundle

    configs = Bundle.load(bundle)
    saved = 0.0
    for slots in role_problems(TransformerBlock.model_validate_json(block.read_text()),
                               MeshSpec.parse("data=1,model=8")).values():
        for problem in slots.values():
            entry = next((c for c in configs.configs if c.problem == problem), None)
            saved += (entry.baseline_s - entry.time_s) if entry is not None else 0.0
    return saved


def speedup(result, name: str, against: str | None = None) -> str:
    """``name``'s speedup over ``against`` (default: the reference), median of the paired rounds and its IQR."""
    from cmtune.tuner.paired import ratio_quartiles

    q = ratio_quartiles(result, name, against or result.reference)
    if q is None:
        return f"{result.variant(name).status}"
    return f"{1 / q[1]:.2f}x ({1 / q[2]:.2f}-{1 / q[0]:.2f})"


EXAMPLES = {"gpt_step": "d_model 1024, d_ff 2048, 8 heads of 16 (the demo preset's shapes), 2 layers",
            "wide_gpt_step": "d_model 1024, d_ff 2048, 8 heads of 128, 2 layers",
            "one_layer_gpt_step": "d_model 1024, d_ff 2048, 8 heads of 16, one layer",
            # a plain-JAX FSDP step: the weights' shards on the ring (weight_allgather_matmul)
            "examples/fsdp_step.py:fsdp_step": "FSDP over 8: batch 16 x seq 256, d_model 1024, d_ff 2048, an MLP, "
                                               "float32, SGD"}


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
    example = name if ":" in name else f"examples/flax_nnx_gpt.py:{name}"
    directory = Path(tempfile.mkdtemp(prefix="cmtune-bench-example-"))
    bundle = directory / "tuned.json"
    _, tune_s = cmtune("tune", "--step", example, "--devices", devices, "--trials", str(args.trials),
                       "--repeats", "5", "--out", str(bundle))
    decided = directory / "decided.json"
    out, decide_s = cmtune("verify", "--step", example, "--devices", devices, "--bundle", str(bundle), "--decide",
                           "--repeats", str(args.repeats), "--json", str(decided))
    decision = next((line for line in out.splitlines() if line.startswith("decision:")), "decision: -")
    graded = against_fixed(StepMeasurement.model_validate_json(decided.read_text()), decision)
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
    shapes = EXAMPLES[name] if ":" in name else f"{EXAMPLES[name]}, seq 512, batch 4, float32, AdamW"
    print(f"\n{os.cpu_count()} CPUs, {example} ({shapes}), {args.repeats} interleaved rounds per variant; tuning: "
          f"{args.trials} trials per problem ({tune_s:.0f} s), decision {decide_s:.0f} s\n")
    print("| run | devices | as written (GSPMD) | drop-in, baseline | drop-in, tuned "
          "| compile s (as written / baseline / tuned) | verify |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{decision}\n{graded}")
    if args.parts:
        parts_table(bundle, devices, args.repeats, name, directory)
    print(f"bundle and step records: {directory}")


PARTS = {"blocks_sgd_step": "the blocks alone, MSE, SGD", "blocks_adamw_step": "the blocks alone, MSE, AdamW",
         "gpt_sgd_step": "the whole model, SGD"}


def parts_table(bundle: Path, devices: str, repeats: int, model: str, directory: Path) -> None:
    """Where the example's gain goes: each part of `bench/gpt_parts.py` as written and with the drop-in, with the
    example's bundle and its decision's overrides, one fresh ``cmtune verify --step`` each."""
    from collective_matmul.wire import StepMeasurement

    rows = []
    for part, what in PARTS.items():
        out = directory / f"part-{part}.json"
        _, verify_s = cmtune("verify", "--step", f"bench/gpt_parts.py:{part}", "--devices", devices, "--bundle",
                             str(bundle), "--name", model, "--repeats", str(repeats), "--json", str(out))
        result = StepMeasurement.model_validate_json(out.read_text())
        written, tuned = (result.variant(v).timing.median_s * 1e3 for v in ("as-written", "tuned"))
        rows.append(f"| `{part}` ({what}) | {written:.0f} ms | {speedup(result, 'baseline')} "
                    f"| {speedup(result, 'tuned')} | {written - tuned:.0f} ms | {verify_s:.0f} s |")
        print(rows[-1], flush=True)
    print(f"\nthe parts of {model} with its bundle (overrides of {model}), {repeats} interleaved rounds each\n")
    print("| part | as written (GSPMD) | drop-in, baseline | drop-in, tuned | medians' difference | verify |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


def against_fixed(result, decision: str) -> str:
    """The decision's grading rounds (``verify --decide``'s confirmation): the choice against each fixed setting, and
    whether it is ahead of every one in 3 of 4 paired rounds and a combination none of them has."""
    from cmtune.tuner.paired import faster, grading_rounds
    from cmtune.tuner.stepsearch import SEEDS

    chosen = decision.removeprefix("decision: ").split(": ")[0] if ": " in decision else None
    if chosen is None or not any(v.name == chosen for v in result.confirmation):
        return "the grading rounds did not time the choice"
    graded = grading_rounds(result, chosen)
    fixed = [v.name for v in graded.variants if v.name in SEEDS and v.name != chosen and v.ok]
    ahead = all(faster(graded, chosen, name) is not None for name in fixed)
    return (f"grading rounds, {chosen} against each fixed setting: "
            + ", ".join(f"{name} {speedup(graded, chosen, name)}" for name in fixed)
            + f"; ahead of every one in 3 of 4 rounds: {'yes' if ahead else 'no'}; a combination no fixed setting "
              f"has: {'yes' if chosen not in SEEDS else 'no'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,demo,large")
    parser.add_argument("--devices", nargs="+", default=["processes:2", "virtual:8"])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9, help="rounds of the step variants")
    parser.add_argument("--search-rounds", type=int, default=6, help="rounds of the step search, the seeds' included")
    parser.add_argument("--round-variants", type=int, default=3, help="changes of one role a search round times")
    parser.add_argument("--example", nargs="?", const="gpt_step", default=None,
                        help="the NNX GPT example instead of the blocks: gpt_step (default), wide_gpt_step or "
                             "one_layer_gpt_step")
    parser.add_argument("--runs", type=int, default=2, help="with --example: fresh verify runs after the decision")
    parser.add_argument("--parts", action="store_true",
                        help="with --example: also time the parts of bench/gpt_parts.py with the example's bundle")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--bundle", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        return step_main(args.step, args.bundle, args.repeats, args.json, args.search_rounds, args.round_variants)
    if args.example:
        return example_main(args)
    from cmtune.tuner.paired import faster
    from collective_matmul.wire import StepMeasurement

    directory = Path(tempfile.mkdtemp(prefix="cmtune-bench-step-"))
    rows, against_baseline, notes = [], [], []
    for devices in args.devices:
        for name in args.sizes.split(","):
            block = block_file(name, directory)
            stem = f"{name}-{devices.replace(':', '')}"
            bundle, out = directory / f"{stem}.bundle.json", directory / f"{stem}.step.json"
            tune_s = tune(block, devices, bundle, args.trials, 5)
            started = time.monotonic()
            measure(block, devices, bundle, args.repeats, out, (args.search_rounds, args.round_variants))
            record = json.loads(out.read_text())
            result = StepMeasurement.model_validate(record["confirmed"])
            tuned, base = result.variant("op-tuned"), result.variant("baseline")
            measured = (base.timing.median_s - tuned.timing.median_s) if tuned.ok and base.ok else None
            compiles = " / ".join(f"{result.variant(v).compile_s:.1f}" if result.variant(v).compile_s else "-"
                                  for v in VARIANTS)
            ahead = all(faster(result, "searched", v) is not None for v in FIXED)
            label = f"{name} ({SIZES[name]['d_model']}/{SIZES[name]['d_ff']})"
            extra = record["search_s"]
            rows.append(
                f"| {label} | {devices} | {result.variant('as-written').timing.median_s * 1e3:.0f} ms "
                f"| {record['decision']} " + "".join(f"| {speedup(result, v)} " for v in VARIANTS[1:])
                + f"| {'yes' if ahead else 'no'} | {speedup(result, COPY, 'always-ring')} "
                + f"| {'yes' if record['new'] else 'no'} "
                + (f"| {len(record['rounds'])} rounds, {extra:.0f} s " if extra is not None else "| - ")
                + f"| {estimate_saved(block, bundle) * 1e3:.0f} ms | "
                + (f"{measured * 1e3:.0f} ms" if measured is not None else "-")
                + f" | {compiles} | {tune_s:.0f} s + {time.monotonic() - started:.0f} s |")
            against_baseline.append(f"| {label} | {devices} | {base.timing.median_s * 1e3:.0f} ms "
                                    + "".join(f"| {speedup(result, v, against='baseline')} " for v in VARIANTS[2:])
                                    + "|")
            notes.append(f"- {name}, {devices}: the step search: {record['summary']}")
            print(rows[-1], flush=True)
    shapes = ", ".join(f"{n}: seq {SIZES[n]['seq_len']}, batch {SIZES[n]['global_batch']}"
                       for n in args.sizes.split(","))
    print(f"\n{os.cpu_count()} CPUs, {args.repeats} interleaved rounds per variant, float32 ({shapes}), "
          f"data=1,model=8; tuning: {args.trials} trials per problem; the step search: up to {args.search_rounds} "
          f"rounds of {args.round_variants} changes\n")
    print("Against the step as written (GSPMD):\n")
    print("| block (d_model/d_ff) | devices | as written (GSPMD) | search's choice | all-baseline custom VJP "
          "| op-tuned | cost model | always ring | tuned ring fill | searched | searched ahead of every fixed setting "
          "(3 of 4 rounds) | noise floor: always ring's copy against it | a combination no fixed setting has "
          "| search: rounds, extra wall time "
          "| saved/layer estimated | saved/layer measured (op-tuned) | compile s (each variant) | tune + step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nAgainst cmtune's ops at the baseline (the all-baseline custom VJP):\n")
    print("| block (d_model/d_ff) | devices | all-baseline | op-tuned | cost model | always ring | tuned ring fill "
          "| searched |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(against_baseline))
    print("\n" + "\n".join(notes))
    print(f"\nbundles (with the search's overrides) and step records: {directory}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/step-*.result.jsonl

    runs = "fresh rounds of every variant, interleaved (--repeats), slowest process per round"
    bench = "step" if "--example" not in sys.argv else "step_fsdp" if "examples/fsdp_step.py:fsdp_step" in sys.argv \
        else "step_example"  # each writes its own records
    with recorded("step", runs=runs, bench=bench):
        main()
