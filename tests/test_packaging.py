"""pyproject.toml: the version has one source, and a wheel holds every file of the parts, built without a warning."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import cmtune

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# source folder -> where it installs (pyproject.toml [tool.setuptools.package-dir])
INSTALLED_AS = {folder: package.replace(".", "/")
                for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items()}


def test_the_version_is_pyprojects():
    assert cmtune.__version__ == PYPROJECT["project"]["version"], "a stale install: run make (or pip install -e .)"


def source_files() -> list[str]:
    """The files of the checkout, tracked or new (what a clone holds once committed), ignored ones left out."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [name for name in listed if (ROOT / name).is_file()]


def test_a_wheel_holds_every_file_of_the_parts_and_builds_without_a_warning(tmp_path):
    checkout = tmp_path / "checkout"
    for name in source_files():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, checkout / name)
    # in an isolated build environment, as a fresh clone's install: pip fetches setuptools as for `make`
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", str(checkout), "--no-deps", "-w", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "BuildBackendWarning" not in run.stdout + run.stderr  # how pip shows a warning of setuptools
    (wheel,) = tmp_path.glob("cmtune-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"{INSTALLED_AS[name.split('/')[0]]}/{name.split('/', 1)[1]}" for name in source_files()
                if name.split("/")[0] in INSTALLED_AS}
    assert {"cmtune/service/dashboard/index.html", "cmtune/migrations/script.py.mako"} <= expected
    assert expected <= held, f"missing from the wheel: {sorted(expected - held)}"
