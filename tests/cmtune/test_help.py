"""`cmtune --help` and every group's and command's help read whole on an 80-column terminal: each summary is its
docstring's first paragraph, wrapped only where the line is full (never at the source's own line breaks)."""

from __future__ import annotations

import inspect
import re

import pytest
import typer.main
from typer.testing import CliRunner

from cmtune.cli import app

WIDTH = 80
_ROW = re.compile(r"^│ (\S+)(\s+)(\S.*?)\s*│$")  # a command's first line in a Commands panel


def _commands(group, path=()):
    """Every group and command under ``group``: ``(path, click command)``."""
    yield path, group
    for name, command in getattr(group, "commands", {}).items():
        yield from _commands(command, (*path, name))


COMMANDS = list(_commands(typer.main.get_command(app)))


def _help(path) -> str:
    run = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH)},
                             prog_name="cmtune")
    assert run.exit_code == 0, run.output
    return run.output


def _summary(command) -> str:
    """What a group lists for ``command``: its help's first paragraph, as one line (code marks rendered as style)."""
    return " ".join(inspect.cleandoc(command.help or "").split("\n\n")[0].replace("`", "").split())


def _wrapped_early(lines: list[str], width: int) -> list[str]:
    """The lines of one wrapped paragraph that end although the next line's first word would have fit."""
    return [line for line, after in zip(lines, lines[1:], strict=False)
            if after.split() and len(line.rstrip()) + 1 + len(after.split()[0]) <= width]


def _listed(output: str) -> dict[str, tuple[int, list[str]]]:
    """The Commands panel of a group's help: each command's summary column and its lines."""
    listed, current, column = {}, None, 0
    for line in output[output.index("─ Commands ─"):].splitlines()[1:]:
        if line.startswith("╰"):
            break
        if match := _ROW.match(line):
            current, column = match[1], len("│ ") + len(match[1]) + len(match[2])
            listed[current] = (column, [match[3]])
        else:
            listed[current][1].append(line[column:].rstrip("│").rstrip())
    return listed


def test_every_group_lists_its_commands_summaries_whole_and_wrapped_only_where_a_line_is_full():
    groups = [(path, group) for path, group in COMMANDS if getattr(group, "commands", None)]
    assert len(groups) >= 4  # the root, db, token, gpu-card
    for path, group in groups:
        listed = _listed(_help(path))
        assert set(listed) == set(group.commands), (path, listed)
        for name, (column, lines) in listed.items():
            assert " ".join(" ".join(lines).split()) == _summary(group.commands[name]), (path, name)
            assert not _wrapped_early(lines, WIDTH - column - 2), (path, name, lines)


@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=lambda path: " ".join(("cmtune", *path)))
def test_every_help_text_wraps_only_where_a_line_is_full(path):
    """The description under ``Usage``: its first paragraph the summary a group lists, each paragraph reflowed to
    the terminal."""
    lines = _help(path).splitlines()
    assert all(len(line) <= WIDTH for line in lines), path
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:")) + 1
    paragraphs, block = [], []
    for line in lines[start:next(i for i, line in enumerate(lines) if line.startswith("╭"))] + [""]:
        if line.strip():
            block.append(line.strip())
        elif block:
            paragraphs.append(block)
            block = []
    assert " ".join(" ".join(paragraphs[0]).split()) == _summary(dict(COMMANDS)[path]), (path, paragraphs)
    for block in paragraphs:
        assert not _wrapped_early(block, WIDTH - 2), (path, block)
