"""One process of a 2-process `cmtune tune`, with this process's clocks perturbed on purpose.

Launched by test_multiprocess_tune.py through `cmtune.workers.cluster.launch`.  Process 1's
``time.perf_counter`` and ``time.monotonic`` run at a different rate (still monotonic, as real
clocks are), so any decision taken from a local timing would differ between the processes
(and their SPMD programs would diverge and hang).  Every process writes the trials it ran, in
order, to ``$CMTUNE_TEST_OUT.<pid>``.
"""

import json
import os
import random
import sys
import time

from cmtune.workers.cluster import ClusterSpec

spec = ClusterSpec.from_env()
if spec.process_id == 1:
    real_perf, real_mono = time.perf_counter, time.monotonic
    start_perf, start_mono = real_perf(), real_mono()
    rate = 3 + random.Random(1).random()  # every interval this process measures is 3-4x too long
    time.perf_counter = lambda: start_perf + (real_perf() - start_perf) * rate
    time.monotonic = lambda: start_mono + (real_mono() - start_mono) * rate

from cmtune.tuning import app  # noqa: E402
from cmtune.workers import runner as local  # noqa: E402

ran = []
run = local.LocalRunner.run


def recording(self, task):
    ran.append([task.problem.key, [d.id for d in task.decompositions]])
    return run(self, task)


local.LocalRunner.run = recording
try:
    app(sys.argv[1:], prog_name="cmtune", standalone_mode=False)
finally:
    with open(f"{os.environ['CMTUNE_TEST_OUT']}.{spec.process_id}", "w") as out:
        json.dump(ran, out)
