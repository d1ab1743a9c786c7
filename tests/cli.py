"""Running the `cmtune` command in tests, and reading what it said whatever the terminal's width.

Rich wraps text at the terminal's width (typer's error box on stderr always; tables on a terminal), and folds
a word longer than a line (a pytest ``tmp_path``) across lines.  Assertions go through `says`, which
compares without whitespace or box characters, so a test passes at 80 columns as at 250 (`.ci/run` runs
the suite with ``COLUMNS=80``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BOX = re.compile(r"[\s│┃─━╭╮╰╯┌┐└┘├┤┬┴┼═║╔╗╚╝]+")


def cmtune(*args: str, timeout: float = 600, env: dict[str, str] | None = None,
           cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m cmtune ARGS`` in a subprocess, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "cmtune", *args], cwd=cwd, text=True, capture_output=True,
                          timeout=timeout, env=env)


def flat(text: str) -> str:
    """Rich output as one line of words (tables wrap and box their cells)."""
    return " ".join(text.replace("│", " ").replace("┃", " ").split())


def bare(text: str) -> str:
    """``text`` without whitespace and box characters: what rich printed, however it wrapped."""
    return _BOX.sub("", text)


def says(run: subprocess.CompletedProcess | str, phrase: str) -> bool:
    """Whether a command's output (stdout and stderr) holds ``phrase``, however rich wrapped or boxed it."""
    text = run if isinstance(run, str) else run.stdout + run.stderr
    return bare(phrase) in bare(text)
