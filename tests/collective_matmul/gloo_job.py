"""One process of a 2-process gloo cluster: run ring and baseline ops, check against numpy.

Launched by `test_multiprocess.py` through `workers.cluster.launch`; prints one JSON line.
"""

import json

from cmtune.workers.cluster import ClusterSpec, join

join(ClusterSpec.from_env())

import jax  # noqa: E402
import numpy as np  # noqa: E402

from cmtune.workers.measure import MeasurementProtocol, OpSession, default_program, ring_mesh  # noqa: E402
from collective_matmul import Decomposition, Problem  # noqa: E402
from collective_matmul.ops.collective import input_shardings  # noqa: E402

mesh = ring_mesh()
report = {"process": jax.process_index(), "devices": jax.device_count(), "local": jax.local_device_count()}
rng = np.random.default_rng(0)
for collective, (m, k, n) in [("allgather_matmul", (64, 32, 48)), ("matmul_reduce_scatter", (64, 48, 32))]:
    problem = Problem(collective=collective, m=m, k=k, n=n, dtype="float32", axis_size=8)
    x_np = rng.standard_normal((m, k)).astype(np.float32)
    w_np = rng.standard_normal((k, n)).astype(np.float32)
    expected = x_np.astype(np.float64) @ w_np.astype(np.float64)
    sx, sw = input_shardings(collective, mesh, "ring")
    x = jax.make_array_from_callback(x_np.shape, sx, lambda idx, a=x_np: a[idx])
    w = jax.make_array_from_callback(w_np.shape, sw, lambda idx, a=w_np: a[idx])
    for config in (Decomposition.baseline(), Decomposition(direction="bidirectional", chunks=2, unroll=1)):
        out = jax.jit(default_program(problem, config, mesh, "ring"))(x, w)
        worst = max(
            float(np.abs(np.asarray(shard.data, np.float64) - expected[shard.index]).max())
            for shard in out.addressable_shards
        )
        report[f"{collective}/{config.id}"] = worst
    # the measurement protocol across processes: barrier per run, slowest process counts
    session = OpSession(problem, protocol=MeasurementProtocol(warmup=1, repeats=3))
    measured = session.measure(Decomposition(chunks=2))
    report[f"{collective}/measure"] = measured.model_dump(mode="json")
print(json.dumps(report))
