"""`cmtune` with a deadlock planted on purpose: one process of a group skips the collectives of one trial.

The first time process ``$CMTUNE_TEST_SKIPPER`` (default 1) is handed a trial (and ``$CMTUNE_TEST_MARKER`` does
not exist yet), it creates the marker and returns at once instead of running it, so the other waits forever in
the trial's first collective: the hang a watchdog must end (process 0's when 1 skips, the follower's when 0
does).  Everything else is the real command.
Run as ``python -m tests.workers.hanging_job <cmtune arguments>``; a group re-runs this same
module, so every process of it is planted.
"""

import os
import sys
from pathlib import Path

from cmtune.workers import runner as local

run = local.LocalRunner.run


def planted(self, task):
    marker = Path(os.environ["CMTUNE_TEST_MARKER"])
    if os.environ.get("CMTUNE_PROCESS_ID") == os.environ.get("CMTUNE_TEST_SKIPPER", "1") and not marker.exists():
        marker.write_text(f"skipped trial {task.id}\n")
        from collective_matmul.wire import Status

        return local.failed(task, Status.ERROR, "skipped on purpose")
    return run(self, task)


local.LocalRunner.run = planted

from cmtune.cli import main  # noqa: E402

sys.argv[0] = "cmtune"
main()
