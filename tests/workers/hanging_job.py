"""`cmtune` with a deadlock planted on purpose: process 1 of a group skips the collectives of one trial.

The first time process 1 is handed a trial (and ``$CMTUNE_TEST_MARKER`` does not exist yet), it
creates the marker and returns at once instead of running it, so process 0 waits forever in the
trial's first collective: the hang the watchdog must end.  Everything else is the real command.
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
    if os.environ.get("CMTUNE_PROCESS_ID") == "1" and not marker.exists():
        marker.write_text(f"skipped trial {task.id}\n")
        return []
    return run(self, task)


local.LocalRunner.run = planted

from cmtune.cli import main  # noqa: E402

sys.argv[0] = "cmtune"
main()
