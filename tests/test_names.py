"""One name, one meaning: the house's naming rules, read from the source (nothing is imported or run)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("collective_matmul", "tuner", "workers", "cmtune", "service")
MAX_PROGRAMS_LINES = 500  # collective_matmul/programs/: one concern a module


def _modules(*folders: str):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _type_names(tree: ast.Module) -> list[str]:
    """The classes and capitalised type aliases a module defines at its top level (constants in capitals aside)."""
    names = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.TypeAlias):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None) or node.name]
            names += [t.id for t in targets if isinstance(t, ast.Name) and t.id.lstrip("_")[:1].isupper()
                      and not t.id.isupper()]
    return names


def test_no_type_is_defined_in_two_modules():
    defined = defaultdict(list)
    for module, tree in _modules(*PACKAGES):
        for name in _type_names(tree):
            defined[name].append(module)
    twice = {name: modules for name, modules in defined.items() if len(modules) > 1}
    assert not twice, f"defined in more than one module (give each its own name): {twice}"


def test_no_function_is_named_like_a_class():
    named = [f"{module}:{node.name}" for module, tree in _modules(*PACKAGES) for node in tree.body
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name[:1].isupper()]
    assert not named, f"functions named like classes: {named}"


def test_no_unittest_outside_tests():
    users = []
    for module, tree in _modules(*PACKAGES, "bench", "examples"):
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name == "unittest" or name.startswith("unittest.") for name in names):
                users.append(module)
    assert not users, f"unittest imported outside tests/: {users}"


@pytest.mark.parametrize("module", sorted(p.relative_to(ROOT).as_posix()
                                          for p in (ROOT / "collective_matmul" / "programs").rglob("*.py")))
def test_programs_modules_are_small(module):
    lines = len((ROOT / module).read_text().splitlines())
    assert lines <= MAX_PROGRAMS_LINES, f"{module} has {lines} lines: split it by concern"


def test_architecture_names_every_module():
    """docs/architecture.md names every module of the packages (by its file name)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [module for module, _ in _modules(*PACKAGES)
               if not module.endswith(("__init__.py", "__main__.py")) and Path(module).name not in text]
    assert not missing, f"docs/architecture.md does not name: {missing}"
