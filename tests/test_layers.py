"""The package structure: one namespace, imports that only point down, and a server without JAX.

Layers, from the bottom: `collective_matmul` (the ops library and the wire contract) imports
nothing of ours; `cmtune.migrations` nothing either; `cmtune.tuner` (what the service runs: the
engine, the stores, the searches) only the library, and never JAX; `cmtune.workers` (what runs on
devices) the tuner and the library; `cmtune.service` the tuner, the library and the migrations; the
root `cmtune` package (the command lines, the demo) may import every part.  A folder says which
deployable runs a file: `tuner/` and `service/` the service, `workers/` a JAX host.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject.toml [tool.setuptools.package-dir])
PACKAGES = {"collective_matmul": "collective_matmul", "migrations": "cmtune.migrations", "tuner": "cmtune.tuner",
            "workers": "cmtune.workers", "service": "cmtune.service", "cmtune": "cmtune"}
ALLOWED = {
    "collective_matmul": {"collective_matmul"},
    "cmtune.migrations": {"cmtune.migrations"},
    "cmtune.tuner": {"collective_matmul", "cmtune.tuner"},
    "cmtune.workers": {"collective_matmul", "cmtune.tuner", "cmtune.workers"},
    "cmtune.service": {"collective_matmul", "cmtune.tuner", "cmtune.service", "cmtune.migrations"},
    "cmtune": set(PACKAGES.values()),
}
OURS = ("collective_matmul", "cmtune", "service", "tuner", "workers", "migrations")


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in OURS}


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to (the longest matching package)."""
    return max((p for p in PACKAGES.values() if module == p or module.startswith(p + ".")), key=len)


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_imports_point_down_and_use_the_namespace(folder):
    package = PACKAGES[folder]
    for path in sorted((ROOT / folder).rglob("*.py")):
        for module in imports_of(path):
            first = module.split(".")[0]
            assert first in ("collective_matmul", "cmtune"), (
                f"{path.relative_to(ROOT)} imports {module!r}: installed code is under cmtune.* "
                f"(write cmtune.{module})")
            assert layer_of(module) in ALLOWED[package], (
                f"{path.relative_to(ROOT)} ({package}) imports {module}: an import that points up or sideways")


def test_nothing_under_tuner_imports_jax():
    """The tuner is what the service runs: no file of it imports JAX, at its top or inside a function."""
    for path in sorted((ROOT / "tuner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("jax", "jaxlib", "flax") for n in names), (
                f"{path.relative_to(ROOT)} imports {names}: what needs JAX lives in workers/")


def test_the_root_package_is_the_only_one_to_know_every_part():
    root_imports = set().union(*(imports_of(p) for p in (ROOT / "cmtune").rglob("*.py")))
    assert {layer_of(m) for m in root_imports} >= {"cmtune.tuner", "cmtune.workers", "cmtune.service"}


def test_the_service_process_imports_no_jax(tmp_path):
    """The app, its routers, the engine and the store load without JAX (the service image has none)."""
    code = ("import sys; from cmtune.service.main import create_app; "
            "from cmtune.service.settings import Settings;"
            "import cmtune.cli, cmtune.serving;"
            f"app = create_app(Settings(database_url='sqlite:///{tmp_path / 'x.sqlite'}'));"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=os.environ | {"CMTUNE_AUTH": "off"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_a_running_server_has_no_jax_mapped(tmp_path):
    """A real `cmtune serve` process, after serving look-ups and a study: no jaxlib in its memory."""
    import httpx

    from cmtune.launcher import running_server
    from tests.service.conftest import HARDWARE, PROBLEM, create_tokens

    url = f"sqlite:///{tmp_path / 'nojax.sqlite'}"
    admin = create_tokens(url, ["admin"])["admin"]
    with running_server(database_url=url) as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {admin}"})
        assert api.post("/v1/studies", json={"problem": PROBLEM, "hardware": HARDWARE}).status_code == 201
        assert api.get("/v1/configs", params={**PROBLEM, "platform": "cpu", "device_kind": "cpu"}).json()["match"]
        maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    assert "jaxlib" not in maps and "xla_extension" not in maps
