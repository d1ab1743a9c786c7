"""Compile every candidate of a few problems for TPU topologies (XLA's TPU compiler, libtpu) or GPU nodes (XLA's
GPU compiler, JAX's CUDA plugin), nothing run.

    .venv/bin/pip install -e '.[tpu]'
    .venv/bin/python bench/tpu_compile.py                          # v4:2x2x1, v5e:2x2, v5p:2x2x1 (~15 min here)
    .venv/bin/python bench/tpu_compile.py --topologies v5p:2x2x2 --problems ag:8192x4096x16384:bfloat16:8
    .venv/bin/python bench/tpu_compile.py --fsdp                   # FSDP's weight rings (wk, wn, rsw)
    .venv/bin/pip install -e '.[gpu]'
    .venv/bin/python bench/tpu_compile.py --topologies gpu:h100:1x4 gpu:b200:1x4   # GPU nodes (~4 min here)

A topology is a TPU slice's name, or ``gpu:CARD:HxD`` (`--devices`' grammar).
Per topology and problem, a table row: how long a ring candidate took to compile (median, min-max), how many
ring candidates' schedules overlap every permute with a product, part of them, or none
(`collective_matmul.programs.schedule`), the memory per device (min-max), and what the product as written compiles to:
XLA's windowed einsum at its default (a loop of permutes, or the plain collective) and its verdict.  These are
compiles, not timings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

PROBLEMS = ["ag:4096x2048x8192:bfloat16:4", "rs:4096x8192x2048:bfloat16:4", "gw:4096x2048x8192:bfloat16:4"]
# --fsdp: the weight on the ring (gathered on K, on N, and the weight gradient reduce-scattered), the same products
FSDP_PROBLEMS = ["wk:4096x2048x8192:bfloat16:4", "wn:4096x2048x8192:bfloat16:4", "rsw:4096x2048x8192:bfloat16:4"]
TOPOLOGIES = ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1"]


def row(topology: str, key: str) -> str:
    from cmtune.workers.aot import compile_all
    from cmtune.workers.cluster import DeviceSpec
    from cmtune.workers.measure import ring_mesh_of
    from collective_matmul import Problem
    from collective_matmul.planning.space import candidates

    problem = Problem.parse(key)
    spec = DeviceSpec.parse(topology if topology.startswith("gpu:") else f"tpu:{topology}")
    devices = spec.compiled_devices()
    started = time.monotonic()
    records = compile_all(problem, ring_mesh_of(devices, problem.axis_size),
                          candidates(problem, platform=devices[0].platform))
    wall = time.monotonic() - started
    default = records[0]
    rings = [r for r in records if r.decomposition.method == "ring"]
    compiled = [r for r in rings if r.status == "compiled"]
    seconds = [r.compile_s for r in compiled]
    memory = [r.memory_bytes / 2**20 for r in compiled if r.memory_bytes]
    verdicts = {v: sum(r.overlap == v for r in compiled) for v in ("overlaps", "partly", "serialised")}
    failed = len(rings) - len(compiled)
    xla = default.overlap_note if default.overlap != "no permutes" else "the plain collective (no loop)"
    counted = f"{len(rings)} ({failed} failed)" if failed else f"{len(rings)}"
    return (f"| {topology} ({len(devices)} devices) | {problem.key} | {counted} "
            f"| {statistics.median(seconds):.1f} s ({min(seconds):.1f}-{max(seconds):.1f}) "
            f"| {verdicts['overlaps']} / {verdicts['partly']} / {verdicts['serialised']} "
            f"| {min(memory):.0f}-{max(memory):.0f} MiB | {xla} | {wall:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", nargs="+", default=TOPOLOGIES)
    parser.add_argument("--problems", nargs="+", default=None, help=f"default: {' '.join(PROBLEMS)}")
    parser.add_argument("--fsdp", action="store_true", help=f"FSDP's families: {' '.join(FSDP_PROBLEMS)}")
    args = parser.parse_args()
    args.problems = args.problems or (FSDP_PROBLEMS if args.fsdp else PROBLEMS)
    import importlib.metadata

    import jax

    gpu = [t.startswith("gpu:") for t in args.topologies]
    compilers = [f"{name} {importlib.metadata.version(name)}"
                 for name, wanted in (("libtpu", not all(gpu)), ("jax-cuda12-plugin", any(gpu))) if wanted]
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, jax {jax.__version__}, {', '.join(compilers)}; "
          "compiled, not timed\n")
    print("| topology | problem | ring candidates | compile (median, min-max) | overlaps / partly / serialised "
          "| memory per device | as written, XLA's windowed einsum at its default | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for topology in args.topologies:
        for key in args.problems:
            print(row(topology, key), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/tpu_compile-*.result.jsonl

    gpus = [arg for arg in sys.argv[1:] if arg.startswith("gpu:")]
    note = ("Cards' target configs from JAX's CUDA plugin; cuBLAS GEMMs (no autotuning without a GPU), XLA's "
            "windowed einsum on one stream, the latency-hiding scheduler on (docs/deploy.md); each ring step "
            "fenced (collective_matmul.ops.ring._Ring.fence)." if gpus else "")
    question = "gpu_compile" if gpus else "tpu_compile"
    with recorded(question, note=note, bench=f"{question}_fsdp" if "--fsdp" in sys.argv else None,
                  runs="one compile per candidate (every ring of each problem's space), one run; compiled, not "
                       "measured"):
        main()
