"""The package structure: one namespace, imports that only point down, and a server without JAX.

Layers, from the bottom.  The ops library `collective_matmul` imports nothing of ours; inside it,
`planning` (keys and planning) imports nothing else of it, `wire` (the contract, bundles, bounds,
the look-up order) only `planning`, `programs` (reading compiled programs) those two, `ops` (the
JAX ops) only `planning`, `client` (the `Tuned` client and the drop-ins) all of them, and the root
(the training API's face, the reference block, moved paths) every part.  `planning`, `wire` and
`programs` import no JAX when imported, and `wire` none at all.  Above the library:
`cmtune.migrations` nothing of ours; `cmtune.tuner` (what the service runs: the engine, the
stores, the searches) only the library's JAX-free parts, and never JAX; `cmtune.workers` (what
runs on devices) the tuner and the library; `cmtune.service` the tuner, the JAX-free library and
the migrations; the root `cmtune` package (the command lines, the demo) may import every part.  A
folder says which deployable runs a file: `tuner/` and `service/` the service, `workers/` a JAX host.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject.toml [tool.setuptools.package-dir]); a file belongs to
# the longest folder that holds it
PACKAGES = {"collective_matmul": "collective_matmul",
            "collective_matmul/planning": "collective_matmul.planning",
            "collective_matmul/wire": "collective_matmul.wire",
            "collective_matmul/programs": "collective_matmul.programs",
            "collective_matmul/ops": "collective_matmul.ops",
            "collective_matmul/client": "collective_matmul.client",
            "migrations": "cmtune.migrations", "tuner": "cmtune.tuner",
            "workers": "cmtune.workers", "service": "cmtune.service", "cmtune": "cmtune"}
LIBRARY = {p for p in PACKAGES.values() if p.startswith("collective_matmul")}
JAX_FREE = {"collective_matmul", "collective_matmul.planning", "collective_matmul.wire"}  # the root: its lazy face
ALLOWED = {
    "collective_matmul.planning": {"collective_matmul.planning"},
    "collective_matmul.wire": {"collective_matmul.planning", "collective_matmul.wire"},
    "collective_matmul.programs": {"collective_matmul.planning", "collective_matmul.wire",
                                   "collective_matmul.programs"},
    "collective_matmul.ops": {"collective_matmul.planning", "collective_matmul.ops"},
    "collective_matmul.client": LIBRARY - {"collective_matmul"},
    "collective_matmul": LIBRARY,
    "cmtune.migrations": {"cmtune.migrations"},
    "cmtune.tuner": JAX_FREE | {"cmtune.tuner"},
    "cmtune.workers": LIBRARY | {"cmtune.tuner", "cmtune.workers"},
    "cmtune.service": JAX_FREE | {"cmtune.tuner", "cmtune.service", "cmtune.migrations"},
    "cmtune": set(PACKAGES.values()),
}
OURS = ("collective_matmul", "cmtune", "service", "tuner", "workers", "migrations")


def imports_of(path: Path) -> set[str]:
    """The modules of ours ``path`` imports."""
    return {name for name in imports_of_any(path) if name.split(".")[0] in OURS}


def imports_of_any(path: Path) -> set[str]:
    """Every module ``path`` imports, ours or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to (the longest matching package)."""
    return max((p for p in PACKAGES.values() if module == p or module.startswith(p + ".")), key=len)


def package_of(path: Path) -> str:
    """The package a source file installs in (its longest folder in `PACKAGES`)."""
    rel = path.relative_to(ROOT).parent.as_posix()
    return PACKAGES[max((f for f in PACKAGES if rel == f or rel.startswith(f + "/")), key=len)]


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_imports_point_down_and_use_the_namespace(folder):
    package = PACKAGES[folder]
    files = [p for p in sorted((ROOT / folder).rglob("*.py")) if package_of(p) == package]
    assert files, folder
    for path in files:
        for module in imports_of(path):
            first = module.split(".")[0]
            assert first in ("collective_matmul", "cmtune"), (
                f"{path.relative_to(ROOT)} imports {module!r}: installed code is under cmtune.* "
                f"(write cmtune.{module})")
            assert layer_of(module) in ALLOWED[package], (
                f"{path.relative_to(ROOT)} ({package}) imports {module}: an import that points up or sideways")


def test_the_training_api_is_a_dozen_names_and_the_reference_block_is_not_one():
    import collective_matmul

    assert len(collective_matmul.__all__) <= 16
    assert {"Tuned", "Decomposition", "OpConfigs", "allgather_matmul", "matmul_reduce_scatter", "discover"} <= set(
        collective_matmul.__all__)
    assert not {"apply", "loss", "init_params", "train_step", "TransformerBlock"} & set(collective_matmul.__all__)
    for name in collective_matmul.__all__:
        assert getattr(collective_matmul, name) is not None, name


def test_the_jax_free_parts_of_the_library_import_no_jax():
    """`planning`, `wire` and `programs` (and the root's face) import without JAX; `wire` names it nowhere."""
    folders = ("collective_matmul/planning", "collective_matmul/wire", "collective_matmul/programs")
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for folder in folders for p in (ROOT / folder).rglob("*.py"))
    code = (f"import sys, collective_matmul; [__import__(m) for m in {modules!r}]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
    for path in sorted((ROOT / "collective_matmul" / "wire").rglob("*.py")):
        assert not any(n.split(".")[0] in ("jax", "jaxlib", "flax") for n in imports_of_any(path)), path


def test_the_modules_of_programs_import_each_other_without_a_cycle():
    """Inside `programs` too every import points down (discovery's package over `products` over `hlo`)."""
    folder = ROOT / "collective_matmul" / "programs"
    name_of = {p: ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in folder.rglob("*.py")}
    modules = set(name_of.values())
    edges: dict[str, set[str]] = {}
    for path, name in name_of.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                # ``from package import module`` imports that module; ``from module import name`` the module
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        edges[name] = found - {name}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"an import cycle in programs/: {' -> '.join((*path, name))}"
        if name not in done:
            for target in sorted(edges[name]):
                visit(target, (*path, name))
            done.add(name)

    for name in sorted(edges):
        visit(name, ())


def test_moved_paths_still_resolve_with_a_warning():
    """`collective_matmul.flax`, `.topology` and `collective_matmul.client.Tuned` work for one more release."""
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "for name in ('collective_matmul.flax', 'collective_matmul.topology'):\n"
            "    try:\n        __import__(name)\n    except DeprecationWarning as w:\n        print(w)\n"
            "import collective_matmul.client as c\n"
            "try:\n    c.Tuned\nexcept DeprecationWarning as w:\n    print(w)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "collective_matmul.flax moved to collective_matmul.client.flax: import it from there (the old path goes in the "
        "next release)",
        "collective_matmul.topology moved to collective_matmul.programs.topology: import it from there (the old path "
        "goes in the next release)",
        "collective_matmul.client.Tuned moved to collective_matmul.client.tuned.Tuned (collective_matmul.Tuned): the "
        "old path goes in the next release"]
    import warnings

    from collective_matmul.client import flax

    with warnings.catch_warnings():  # said above, in a fresh process
        warnings.simplefilter("ignore", DeprecationWarning)
        from collective_matmul.flax import dot_general
    assert dot_general is flax.dot_general


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
