"""`python -m cmtune.service serve|token|db`: the service alone."""

from cmtune.service.cli import app

app(prog_name="cmtune")
