"""`python -m cmtune.workers worker ...`: the worker alone (what a worker group re-runs)."""

import typer

from cmtune.workers.cli import app

root = typer.Typer(no_args_is_help=True)


@root.callback()
def _workers() -> None:
    """The worker daemon (a group of one command, so that `worker` is named as with `cmtune`)."""


root.add_typer(app)
root(prog_name="cmtune")
