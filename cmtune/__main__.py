"""`python -m cmtune`: the `cmtune` command."""

from cmtune.cli import main

main()
