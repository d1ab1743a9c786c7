"""Stored benchmark results: one JSON-lines file per question and bench under bench/results/.

The files are `<question>-<bench>.result.jsonl` (committed); the raw sweeps the benches also
write there (ops-*.jsonl, search.json) stay uncommitted.

A bench calls `record(question, rows, command=..., runs=...)` when it finishes; the machine, the
date, the commit and the software are filled in here.  `python bench/report.py` renders
docs/benchmarks.md from these files, one table per question.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("CMTUNE_BENCH_RESULTS", ROOT / "bench" / "results"))

QUESTIONS = {
    "ops": "ops against the baseline",
    "search": "trials to a near-best config",
    "step": "the step against the step as written",
    "short_programs": "K calls per sample",
    "service": "the service's rates",
    "tpu_compile": "TPU compiles (compiled, not measured)",
    "gpu_compile": "GPU compiles (compiled, not measured)",
    "predict": "predicted times against published measurements (predicted, not measured here)",
}


def machine() -> str:
    """This host in words, e.g. "2-core x86_64 VM, 24 GiB, no accelerator"."""
    cores = os.cpu_count() or 0
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f", {round(pages / 2**30)} GiB"
    except (ValueError, OSError, AttributeError):
        memory = ""
    return f"{cores}-core {platform.machine()}{memory}, {_accelerator()}"


def _accelerator() -> str:
    try:
        import jax  # noqa: PLC0415

        kinds = {d.platform for d in jax.devices()}
    except Exception:  # noqa: BLE001 - no JAX or no backend: say so, never fail a bench
        return "accelerator unknown"
    return "no accelerator" if kinds <= {"cpu"} else "+".join(sorted(kinds))


def commit() -> str:
    """The checked-out commit, with "+" when the tree has changes; "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def software() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        jax = f"jax {version('jax')}, "
    except Exception:  # noqa: BLE001
        jax = ""
    return f"{jax}Python {platform.python_version()}"


def record(question: str, rows: list[list[Any]], *, command: str | None = None, runs: str,
           columns: list[str], title: str = "", bench: str | None = None, note: str = "",
           append: bool = False, results: Path | None = None, **fields: Any) -> Path:
    """Write one table's record for `question`; returns the file written.

    Args:
        question: a key of QUESTIONS (the file is
            bench/results/<question>-<bench>.result.jsonl; `bench` defaults to the script's name).
        rows: the table's cells, one list per row (numbers as measured: medians with spread).
        command: how to reproduce it; defaults to this process's command line.
        runs: the run count in words ("7 interleaved runs per candidate").
        columns: the table's headers, one per cell of a row.
        append: add to the file (several tables of one run) instead of replacing it.
        fields: machine, date, commit or software, to override what is detected.
    """
    if question not in QUESTIONS:
        raise ValueError(f"unknown question {question!r}; one of {sorted(QUESTIONS)}")
    if any(len(row) != len(columns) for row in rows):
        raise ValueError("every row needs one cell per column")
    bench = bench or Path(sys.argv[0]).stem
    entry = {
        "question": question,
        "title": title,
        "bench": bench,
        "script": Path(sys.argv[0]).name,  # the bench that wrote it (several write under names of their own)
        "command": command or " ".join([".venv/bin/python", *sys.argv]),
        "machine": fields.pop("machine", None) or machine(),
        "date": fields.pop("date", None) or datetime.date.today().isoformat(),
        "commit": fields.pop("commit", None) or commit(),
        "software": fields.pop("software", None) or software(),
        "runs": runs,
        "columns": list(columns),
        "rows": [[str(cell) for cell in row] for row in rows],
        "note": note,
        **fields,
    }
    folder = results or RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{question}-{bench}.result.jsonl"
    with path.open("a" if append else "w") as out:
        out.write(json.dumps(entry, ensure_ascii=False) + "\n")
    return path


def load(results: Path | None = None) -> list[dict[str, Any]]:
    """Every stored record, in the order of QUESTIONS, then file name, then line."""
    folder = results or RESULTS
    order = list(QUESTIONS)
    entries = []
    for path in sorted(folder.glob("*.result.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                entries.append(json.loads(line))
    return sorted(entries, key=lambda e: order.index(e["question"]))


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The Markdown tables in `text`: (headers, rows) for each header, separator and rows."""
    found, lines = [], text.splitlines()

    def split(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    i = 0
    while i + 1 < len(lines):
        head, sep = lines[i].strip(), lines[i + 1].strip()
        if head.startswith("|") and sep.startswith("|---"):
            j, rows = i + 2, []
            while j < len(lines) and lines[j].strip().startswith("|"):
                rows.append(split(lines[j]))
                j += 1
            found.append((split(head), rows))
            i = j
        else:
            i += 1
    return found


class _Tee(io.TextIOBase):
    def __init__(self, out):
        self.out, self.seen = out, io.StringIO()

    def write(self, text: str) -> int:
        self.seen.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def recorded(question: str, *, runs: str, keep: list[str] | None = None, bench: str | None = None,
             note: str = "", results: Path | None = None) -> Iterator[None]:
    """Record every Markdown table a bench prints inside the block, one record per table.

    A bench's `__main__` wraps its `main()` in this, so running it rewrites its result file.
    `keep` names the columns to store (by header, in that order; others are dropped); a
    table without them is left out.  Nothing is written if the block raises.
    """
    if "--run-here" in sys.argv:  # a bench's own child process: its parent records
        yield
        return
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    written = 0
    for headers, rows in tables(tee.seen.getvalue()):
        pick = list(range(len(headers)))
        if keep:
            if not all(name in headers for name in keep):
                continue
            pick = [headers.index(name) for name in keep]
        rows = [[row[i] if i < len(row) else "" for i in pick] for row in rows]
        record(question, rows, columns=[headers[i] for i in pick], runs=runs, bench=bench, note=note,
               append=written > 0, results=results)
        written += 1
