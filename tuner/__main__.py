"""`python -m cmtune.tuner`: the tuner's commands alone (what a process group re-runs)."""

from cmtune.tuner.cli import app

app(prog_name="cmtune")
