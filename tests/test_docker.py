"""docker/: the compose file and Dockerfiles agree with the code (no Docker engine here)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml

from cmtune.cli import app
from cmtune.service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
CLI = typer.main.get_command(app)
# variables read by the CLI (typer envvars) and by the service entrypoint script
CLI_ENV = {"CMTUNE_SERVER", "CMTUNE_TOKEN", "CMTUNE_NEW_TOKEN", "CMTUNE_ADMIN_TOKEN", "CMTUNE_WORKER_TOKEN",
           "CMTUNE_DB_WAIT_SECONDS"}


def cmtune_command(words: list[str]):
    """Resolve ``cmtune a b --opt`` to its click command, failing on an unknown one."""
    command = CLI
    for word in words:
        if word.startswith("-") or not hasattr(command, "commands"):
            break
        assert word in command.commands, f"'cmtune {' '.join(words)}': no subcommand {word!r}"
        command = command.commands[word]
    return command


def options_of(command) -> set[str]:
    return {opt for param in command.params for opt in getattr(param, "opts", [])}


def check_invocation(words: list[str]) -> None:
    command = cmtune_command(words)
    for word in words:
        if word.startswith("--"):
            assert word.split("=")[0] in options_of(command), f"'cmtune {' '.join(words)}': no option {word}"


def dockerfiles() -> list[Path]:
    return sorted(DOCKER.glob("*.Dockerfile"))


@pytest.mark.parametrize("dockerfile", dockerfiles(), ids=lambda p: p.name)
def test_dockerfile_copies_exist_and_entrypoints_are_real_commands(dockerfile):
    text = dockerfile.read_text()
    for source in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.M):
        for path in source.split():
            assert (ROOT / path).exists(), f"{dockerfile.name}: COPY {path} does not exist"
    entry = re.search(r"^ENTRYPOINT\s+(\[.*\])$", text, flags=re.M)
    assert entry, f"{dockerfile.name} has no ENTRYPOINT"
    words = yaml.safe_load(entry.group(1))
    if words[0] == "cmtune":
        check_invocation(words[1:])
    else:
        script = DOCKER / Path(words[0]).name
        assert script.exists() and os.access(script, os.X_OK), f"{script} missing or not executable"
    cmd = re.search(r"^CMD\s+(\[.*\])$", text, flags=re.M)
    if cmd and words[0] == "cmtune":
        check_invocation(words[1:] + yaml.safe_load(cmd.group(1)))
    for name in re.findall(r"\b(CMTUNE_[A-Z_]+)=", text):
        assert name.removeprefix("CMTUNE_").lower() in Settings.model_fields or name in CLI_ENV, name


def test_entrypoint_script_runs_real_commands():
    script = (DOCKER / "service-entrypoint.sh").read_text()
    lines = [line.strip() for line in script.splitlines() if "cmtune " in line and not line.strip().startswith("#")]
    assert lines
    for line in lines:
        words = shlex.split(line.replace("exec ", "").split(">")[0].replace("if ", ""))
        words = words[words.index("cmtune") + 1:]
        check_invocation([w for w in words if not w.startswith("$")])
    assert "db upgrade" in script and "serve" in script and "db wait" in script


def test_compose_services_builds_ports_and_environment_match():
    services = COMPOSE["services"]
    assert set(services) == {"postgres", "service", "worker"}
    for name, spec in services.items():
        if "build" in spec:
            assert (DOCKER / spec["build"]["context"] / spec["build"]["dockerfile"]).resolve().exists(), name
    service = services["service"]
    port = service["environment"]["CMTUNE_PORT"]
    assert service["ports"] == [f"{port}:{port}"]
    assert f":{port}/healthz" in " ".join(service["healthcheck"]["test"])
    assert f"EXPOSE {port}" in (DOCKER / "service.Dockerfile").read_text()
    assert services["worker"]["environment"]["CMTUNE_SERVER"] == f"http://service:{port}"
    # the service waits for a healthy database and the worker for a healthy service
    assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["service"]["condition"] == "service_healthy"
    url = service["environment"]["CMTUNE_DATABASE_URL"]
    pg = services["postgres"]["environment"]
    assert url == (f"postgresql+psycopg://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/"
                   f"{pg['POSTGRES_DB']}")
    for spec in services.values():
        for env in spec.get("environment", {}):
            if env.startswith("CMTUNE_"):
                assert env.removeprefix("CMTUNE_").lower() in Settings.model_fields or env in CLI_ENV, env
    worker_args = ["worker", *services["worker"]["command"]]
    check_invocation(worker_args)
    # whatever exits (a worker ending a hung trial) comes back
    assert services["worker"]["restart"] == services["service"]["restart"] == "unless-stopped"
    # the worker token the service registers is the one the worker sends
    assert services["worker"]["environment"]["CMTUNE_TOKEN"] == service["environment"]["CMTUNE_WORKER_TOKEN"]


def test_worker_image_accelerator_argument():
    text = (DOCKER / "worker.Dockerfile").read_text()
    assert "ARG ACCELERATOR=cpu" in text
    for flavour, package in (("tpu", "jax[tpu]"), ("cuda", "jax[cuda12]")):
        assert f"{flavour}) pip install --no-cache-dir '{package}'" in text
    assert COMPOSE["services"]["worker"]["build"]["args"]["ACCELERATOR"] == "cpu"


def test_check_invocation_catches_mistakes():
    with pytest.raises(AssertionError, match="no subcommand 'serv'"):
        check_invocation(["serv"])
    with pytest.raises(AssertionError, match="no option --device"):
        check_invocation(["worker", "--device", "auto"])


def _installed_by(dockerfile: str) -> set[str]:
    """The distributions a Dockerfile's `pip install '.[extras]'` brings from pyproject.toml (one level)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = re.search(r"pip install --no-cache-dir '\.\[([\w,]+)\]'", (DOCKER / dockerfile).read_text())
    assert extras, f"{dockerfile} does not install the project with its extras"
    requirements = list(project["dependencies"])
    for extra in extras.group(1).split(","):
        requirements += project["optional-dependencies"][extra]
    return {re.split(r"[\[<>=!~ ;]", r)[0].lower() for r in requirements}


def test_the_service_image_has_no_jax_and_the_worker_image_no_web_or_database_stack():
    service = _installed_by("service.Dockerfile")
    assert {"fastapi", "uvicorn", "sqlalchemy", "alembic", "psycopg"} <= service
    assert not {"jax", "jaxlib"} & service
    worker = _installed_by("worker.Dockerfile")
    assert "jax" in worker and "httpx" in worker
    assert not {"fastapi", "uvicorn", "sqlalchemy", "psycopg"} & worker
