"""The predictor of compiled programs (`collective_matmul.programs.predict`) against published hardware measurements.

    .venv/bin/pip install -e '.[gpu,tpu]'
    .venv/bin/python bench/predict.py          # seconds here: five compiles, nothing run

Each row compiles a program for devices that are not here (an H100 node by XLA's GPU compiler, a v5e slice by
XLA's TPU compiler), predicts its time from the compiled schedule, and sets it beside a time someone measured on
that hardware and published:

- JAX's Mosaic GPU collective-matmul page (``docs/pallas/gpu/collective_matmul.md``), its NCCL all-gather +
  cuBLAS column: float16, A of 1024 rows per device all-gathered, B of 4096 x 4096 per device, the product as
  written (``all_gather(a) @ b``): 147 / 290 / 565 µs on 2 / 4 / 8 H100s; and one local 1024x4096x4096 float16
  product, about 43 µs;
- *How to Scale Your Model* (jax-ml scaling-book, ``sharding.md``): bf16[2048, 8192] all-gathered over Y=4 of a
  {X:8, Y:4} v5e mesh, 680 µs measured (their own theory: 560 µs).

The inputs, none fitted to these rows (`collective_matmul.planning.costmodel.PROFILES`, each figure with its
source): H100 989 TFLOP/s dense fp16/bf16 and 3.35 TB/s HBM (NVIDIA's datasheet), NVLink 450 GB/s one way per GPU
through NVSwitch (the datasheet's 900 GB/s both ways), 8 µs per ring hop and 5 µs per collective (cmtune's own
round figures), cuBLAS at 0.75 of the peak (a round general figure for large Hopper GEMMs); v5e 1.97e14 bf16
FLOP/s, 8.1e11 B/s HBM and 4.5e10 B/s one way per ICI link (the scaling book's figures), an axis of 4 being a line
(no wraparound below 16: one link into its ends), 5 µs per hop.  Predicted, never measured: the table's figures
are the cost model's (its name in the table), beside the published measurements.  A predicted time is the whole
compiled program's: on v5e XLA copies the gathered array once more after the all-gather (its layout), which the
prediction prices (bytes over HBM) and the published figure may not include.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-32")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

GOAL = 0.15  # issue 49: each row within 15%
MOSAIC = "Mosaic GPU collective matmul page, NCCL all-gather + cuBLAS"
SCALING = "How to Scale Your Model, sharding.md"


def gpu_product(devices: int) -> str:
    """``all_gather(a) @ b`` on ``devices`` H100s as written (the page's shapes), compiled."""
    from cmtune.workers.aot import CompileSession, plain_program
    from cmtune.workers.measure import ring_mesh_of
    from collective_matmul import Problem
    from collective_matmul.programs import gpus

    problem = Problem.parse(f"ag:{1024 * devices}x4096x{4096 * devices}:float16:{devices}")
    mesh = ring_mesh_of(gpus.gpu_devices("h100", 1, devices), devices)
    session = CompileSession(problem, mesh)
    return _compile(plain_program(problem, mesh, session.axis), session.args, mesh)


def local_product() -> str:
    """One 1024x4096x4096 float16 product on one H100, compiled."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from collective_matmul.programs import gpus
    from collective_matmul.programs.topology import mesh_of

    mesh = mesh_of(gpus.gpu_devices("h100", 1, 1), (1,), ("d",))
    args = [jax.ShapeDtypeStruct(shape, jnp.float16, sharding=NamedSharding(mesh, P()))
            for shape in ((1024, 4096), (4096, 4096))]
    return _compile(lambda a, b: a @ b, args, mesh)


def tpu_gather(topology: str) -> str:
    """bf16[2048, 8192] all-gathered over Y=4 of an {X:8, Y:4} mesh of ``topology``, compiled."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from collective_matmul.programs.topology import mesh_of, tpu_devices

    mesh = mesh_of(tpu_devices(topology), (8, 4), ("X", "Y"))
    gather = jax.shard_map(lambda x: jax.lax.all_gather(x, "Y", tiled=True), mesh=mesh, in_specs=P("Y"),
                           out_specs=P(), check_vma=False)
    args = [jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P("Y")))]
    return _compile(gather, args, mesh)


def _compile(fn, args, mesh) -> str:
    import jax

    from collective_matmul.programs.gpus import compile_options

    options = compile_options(mesh.devices.flat)
    return jax.jit(fn).lower(*args).compile(compiler_options=options or None).as_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tpu-topology", default="v5e:8x4", help="a v5e slice with an {X:8, Y:4} mesh")
    args = parser.parse_args()
    from collective_matmul.planning.costmodel import PROFILES
    from collective_matmul.programs.predict import predict

    rows = [(f"{MOSAIC}: {d} H100s, fp16 all_gather(a[1024,4096]) @ b[4096,4096]", lambda d=d: gpu_product(d),
             "h100-nvlink", {2: 147e-6, 4: 290e-6, 8: 565e-6}[d]) for d in (2, 4, 8)]
    rows.append((f"{MOSAIC}: one H100, local fp16 1024x4096x4096 product", local_product, "h100-nvlink", 43e-6))
    rows.append((f"{SCALING}: v5e ({args.tpu_topology}), all-gather bf16[2048,8192] over Y=4 of {{X:8, Y:4}}",
                 lambda: tpu_gather(args.tpu_topology), "tpu-v5e", 680e-6))
    print("| program | cost model | predicted (µs) | communication / overlapped (µs, predicted) | published (µs) "
          f"| error | within {GOAL:.0%} |")
    print("|---|---|---|---|---|---|---|")
    for label, compile_, profile, published in rows:
        started = time.perf_counter()
        got = predict(compile_(), PROFILES[profile])
        error = got.seconds / published - 1
        hidden = got.overlapped_share
        comm = f"{got.comm_s * 1e6:,.0f} / {hidden:.0%}" if hidden is not None else "none"
        print(f"| {label} | {got.cost_model} | {got.seconds * 1e6:,.0f} | {comm} | {published * 1e6:,.0f} "
              f"| {error:+.1%} | {'yes' if abs(error) <= GOAL else 'no'} |", flush=True)
        if got.unpriced:
            print(f"  unpriced: {', '.join(got.unpriced)}", file=sys.stderr)
        print(f"  ({time.perf_counter() - started:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/predict-predict.result.jsonl

    with recorded("predict", runs="one compile per program, nothing run: predicted times beside published "
                                  "measurements", note="Inputs: " + " ".join(__doc__.split("The inputs, ")[1].split())):
        main()
