"""The wire package: small modules, one import path for every name, no JAX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import collective_matmul.wire as wire

PACKAGE = Path(wire.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))
MAX_LINES = 400


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_every_module_of_the_wire_package_is_under_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines < MAX_LINES, f"{path.name} has {lines} lines: split it by the kind of type it holds"


def test_the_wire_package_imports_no_jax():
    code = ("import sys, collective_matmul.wire; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "[]"


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "__init__.py"], ids=lambda p: p.name)
def test_every_public_name_of_a_module_is_imported_from_the_package(path):
    defined = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    hidden = {"agrees", "check_ratio", "check_rounds"}  # the validators' own checks (wire.stats)
    public = {name for name in defined if not name.startswith("_")} - hidden
    assert public <= set(wire.__all__), f"not exported by collective_matmul.wire: {sorted(public - set(wire.__all__))}"
    assert all(hasattr(wire, name) for name in wire.__all__)
