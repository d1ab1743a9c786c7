"""The `cmtune` command: one root over the command groups, one module each.

`cmtune.tuning` (tune, bench, problems, verify on local devices; their `--step` paths in
`cmtune.steps`), `cmtune.worker` (worker), `cmtune.serving` (serve, token, db), `cmtune.submit`
(submit, status: clients of the REST API, needing neither the service nor JAX), `cmtune.gpus`
(gpu-card: the cards of compiles without a GPU) and `cmtune.demo`;
what they share is in `cmtune.common` (the console, the server and token options).  Each group's
module imports only Typer and `cmtune.common` at its top, so `cmtune --help` runs on every host.
"""

from __future__ import annotations

from typing import Annotated

import typer

from cmtune import demo, gpus, serving, submit, tuning, worker

# markdown: the help's paragraphs reflow to the terminal (Rich markup mode keeps the source's line breaks, and
# takes "[gpu]" for a style)
app = typer.Typer(help="Tune collective matmul decompositions on real devices.", no_args_is_help=True,
                  rich_markup_mode="markdown")
for group in (demo, submit, tuning, worker, serving, gpus):
    app.add_typer(group.app)

VERBOSE = typer.Option("--verbose", "-v", help="log everything, the full validation errors of a bad file included")


def main() -> None:
    app(prog_name="cmtune")


@app.callback()
def _root(verbose: Annotated[bool, VERBOSE] = False) -> None:
    if verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
