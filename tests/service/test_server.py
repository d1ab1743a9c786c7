"""A real uvicorn server: concurrency, a real measurement over HTTP, migrations, start-up checks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func, inspect, select

from cmtune.launcher import running_server
from cmtune.service import migrate
from cmtune.service.db import Database
from cmtune.service.main import SchemaOutOfDate, create_app
from cmtune.service.models import Token
from cmtune.service.settings import Settings
from cmtune.service.store import SqlStore
from cmtune.workers.measure import OpSession
from collective_matmul import Decomposition, Problem
from collective_matmul.planning.problem import Software
from collective_matmul.wire import MeasurementProtocol
from tests.cli import bare, says
from tests.service.conftest import HARDWARE, PROBLEM, create_tokens, register, reset_postgres, run_trial

ROOT = Path(__file__).resolve().parents[2]


def admin_token(url: str) -> str:
    return create_tokens(url, ["admin"])["admin"]


def test_32_concurrent_leases_never_share_a_trial(database_url):
    token = admin_token(database_url)
    # four studies with eight proposals ready each: 32 trials to claim at once
    with running_server(database_url=database_url, extra_env={"CMTUNE_READY_PROPOSALS": "8"}) as server:
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        for m in (256, 512, 1024, 2048):  # four studies, so asks run in parallel across studies too
            body = {"problem": PROBLEM | {"m": m}, "hardware": HARDWARE, "budget": {"trials": 40}}
            assert client.post("/v1/studies", json=body).status_code == 201
        workers = [register(client, f"w{i}") for i in range(32)]

        def lease(worker):
            with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"},
                              timeout=60) as c:
                response = c.post(f"/v1/workers/{worker}/lease", headers=worker.headers)
                return response.status_code, response.json() if response.status_code == 200 else None

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lease, workers))
        assert all(status == 200 for status, _ in results), results
        trial_ids = [body["trial"]["id"] for _, body in results]
        assert len(set(trial_ids)) == 32
        per_study = {}
        for _, body in results:
            key = (body["trial"]["study_id"], body["trial"]["decomposition"]["method"],
                   str(body["trial"]["decomposition"]))
            assert key not in per_study, f"candidate leased twice: {key}"
            per_study[key] = body["trial"]["id"]


def test_blocking_routes_run_on_the_configured_number_of_threads(tmp_path):
    from anyio import to_thread
    from fastapi.testclient import TestClient

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", request_threads=3))
    with TestClient(app) as client:  # runs the app's lifespan, as uvicorn does
        assert client.portal.call(lambda: to_thread.current_default_thread_limiter().total_tokens) == 3


def test_real_measurement_round_trip_over_http(tmp_path):
    """A real server, a real measurement on 8 virtual devices, reported and confirmed."""
    url = f"sqlite:///{tmp_path / 'e2e.sqlite'}"
    token = admin_token(url)
    with running_server(database_url=url) as server:
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        body = {"problem": PROBLEM, "hardware": HARDWARE, "budget": {"trials": 3}, "repeats": 3, "confirm_top": 1}
        study_id = client.post("/v1/studies", json=body).json()["studies"][0]["id"]
        worker = register(client, "local", software=Software.detect().model_dump())  # what it measures on
        sessions = {}
        while (response := worker.post(f"/v1/workers/{worker}/lease")).status_code == 200:
            grant = response.json()
            task = grant["trial"]
            protocol = MeasurementProtocol.model_validate(task["protocol"])
            key = (task["problem"]["m"], protocol.seed)
            session = sessions.setdefault(key, OpSession(Problem.model_validate(task["problem"]), protocol=protocol))
            results = [session.measure(Decomposition.model_validate(d), protocol).model_dump(mode="json")
                       for d in task["decompositions"]]
            payload = {"lease_id": grant["lease"]["id"]}
            payload |= {"measurement": results[0]} if task["kind"] == "search" else {"measurements": results}
            assert worker.post(f"/v1/trials/{task['id']}/result", json=payload).status_code == 200
        study = client.get(f"/v1/studies/{study_id}").json()
        assert study["state"] == "completed", study
        answer = client.get("/v1/configs", params={**PROBLEM, "platform": "cpu", "device_kind": "cpu"}).json()
        assert answer["match"] == "exact" and answer["note"]  # no stack named: the newest, and told so
        assert answer["software"] == Software.detect().model_dump()


def test_migrations_upgrade_and_downgrade_on_an_empty_database(database_url):
    engine = create_engine(database_url)
    migrate.downgrade(engine, "base")
    assert migrate.current_revision(engine) is None
    assert "studies" not in inspect(engine).get_table_names()
    migrate.upgrade(engine)
    assert migrate.is_current(engine)
    assert {"studies", "trials", "leases", "workers", "tuned_configs", "tokens"} <= set(
        inspect(engine).get_table_names())
    engine.dispose()


def test_serve_refuses_an_out_of_date_postgres_schema(pg_url):
    reset_postgres(pg_url)
    with pytest.raises(SchemaOutOfDate, match="run 'cmtune db upgrade'"):
        create_app(Settings(database_url=pg_url))
    run = subprocess.run([sys.executable, "-m", "cmtune", "serve", "--port", "1"], cwd=ROOT,
                         env={"CMTUNE_DATABASE_URL": pg_url, "PATH": "/usr/bin:/bin"} | _python_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and says(run, "cmtune db upgrade")
    up = subprocess.run([sys.executable, "-m", "cmtune", "db", "upgrade"], cwd=ROOT,
                        env={"CMTUNE_DATABASE_URL": pg_url} | _python_env(), capture_output=True, text=True)
    assert up.returncode == 0, up.stderr
    create_app(Settings(database_url=pg_url)).state.cmtune.store.db.dispose()


def test_sqlite_file_is_upgraded_by_serve_and_auth_off_stays_on_loopback(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh' / 'cmtune.sqlite'}"
    app = create_app(Settings(database_url=url))
    assert migrate.is_current(app.state.cmtune.store.db.engine)
    app.state.cmtune.store.db.dispose()
    run = subprocess.run([sys.executable, "-m", "cmtune", "serve", "--host", "0.0.0.0"], cwd=ROOT,
                         env={"CMTUNE_DATABASE_URL": url, "CMTUNE_AUTH": "off"} | _python_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "refusing to listen on 0.0.0.0 with CMTUNE_AUTH=off" in " ".join(
        (run.stdout + run.stderr).replace("│", " ").split())


def test_token_cli_stores_only_a_hash(tmp_path):
    url = f"sqlite:///{tmp_path / 'tok.sqlite'}"
    run = subprocess.run([sys.executable, "-m", "cmtune", "token", "create", "--role", "reader"], cwd=ROOT,
                         env={"CMTUNE_DATABASE_URL": url} | _python_env(), capture_output=True, text=True)
    token = run.stdout.strip()
    assert run.returncode == 0 and token.startswith("cmt_")
    db = Database(url)
    with SqlStore(db).read() as tx:
        assert tx.tokens.find(token).role == "reader"
        stored = tx.connection.scalar(select(Token.hash))
        assert stored != token and token not in stored
    db.dispose()


def _python_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH", "JAX_PLATFORMS",
                                                        "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}


def test_token_value_from_a_secret_is_idempotent(tmp_path):
    url = f"sqlite:///{tmp_path / 'secret.sqlite'}"
    secret = "cmt_" + "x" * 40
    env = {"CMTUNE_DATABASE_URL": url} | _python_env()
    for _ in range(2):
        run = subprocess.run([sys.executable, "-m", "cmtune", "token", "create", "--role", "worker",
                              "--value", secret], cwd=ROOT, env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
    short = subprocess.run([sys.executable, "-m", "cmtune", "token", "create", "--role", "worker",
                            "--value", "short"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert short.returncode != 0 and says(short, "at least 24 characters")
    db = Database(url)
    with SqlStore(db).read() as tx:
        assert tx.tokens.find(secret).role == "worker"
        assert tx.connection.scalar(select(func.count()).select_from(Token)) == 1
    db.dispose()


@pytest.mark.slow  # several server processes started (8 s)
def test_a_revoked_token_stops_working_on_every_server_process(tmp_path):
    url = f"sqlite:///{tmp_path / 'revoke.sqlite'}"
    reader = create_tokens(url, ["reader"])["reader"]
    env = os.environ | {"CMTUNE_DATABASE_URL": url}
    with running_server(database_url=url, workers=2, extra_env={"CMTUNE_TOKEN_CACHE_SECONDS": "1"}) as server:
        def statuses() -> set[int]:  # fresh connections, so both processes answer some of them
            return {httpx.get(f"{server.url}/v1/studies", headers={"Authorization": f"Bearer {reader}"}).status_code
                    for _ in range(24)}

        assert statuses() == {200}  # checked, and cached by both processes
        listed = subprocess.run([sys.executable, "-m", "cmtune", "token", "list"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and "test-reader" in listed.stdout and reader not in listed.stdout
        token_id = next(line.split("│")[1].strip() for line in listed.stdout.splitlines() if "test-reader" in line)
        revoked = subprocess.run([sys.executable, "-m", "cmtune", "token", "revoke", token_id], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=60)
        assert revoked.returncode == 0, revoked.stderr
        time.sleep(1.5)
        assert statuses() == {401}
        missing = subprocess.run([sys.executable, "-m", "cmtune", "token", "revoke", "999"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=60)
        assert missing.returncode == 1 and "does not exist" in missing.stdout


def test_status_shows_the_step_measured_against_the_estimate(tmp_path):
    url = f"sqlite:///{tmp_path / 'status.sqlite'}"
    tok = create_tokens(url, ["admin", "worker", "reader"])
    with running_server(database_url=url) as server:
        admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['admin']}"}, timeout=30)
        admin.post("/v1/studies", json={"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}},
                                        "hardware": HARDWARE, "budget": {"trials": 2}, "confirm_top": 1})
        worker = register(httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['worker']}"},
                                       timeout=30))
        while run_trial(worker, bounds_s=(0.5e-3, 0.3e-3, 1e-3)) is not None:
            pass
        # a worker of a new jax: the configs are re-confirmed on it, one done here, the others waiting
        upgraded = register(httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['worker']}"},
                                         timeout=30), "upgraded", software={"jax": "0.11.0", "jaxlib": "0.11.0"})
        run_trial(upgraded)
        token_file = tmp_path / "reader.token"
        token_file.write_text(tok["reader"] + "\n")  # the token stays out of every argv

        def status(*args):
            env = {k: v for k, v in os.environ.items() if k != "CMTUNE_TOKEN"}
            return subprocess.run([sys.executable, "-m", "cmtune", "status", "--server", server.url, *args],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)

        run = status("--token-file", str(token_file))
        unreadable = status("--token-file", str(tmp_path / "missing.token"))
    assert unreadable.returncode != 0 and says(unreadable, "cannot read") and says(unreadable, "missing.token")
    assert run.returncode == 0, run.stderr
    assert says(run, "step:tiny") and says(run, "submitted models")
    assert says(run, "1.25x")  # the synthetic step: 1.0 s as written, 0.8 s tuned
    assert says(run, "hidden") and says(run, "communication") and says(run, "500 µs")  # the bounds
    assert says(run, "hides 56% of the hideable time")  # a ring at 0.72 of the baseline, the bound at half
    assert says(run, "re-confirmations on a new software stack")
    # the column "re-confirmed on" and the one done; the others wait for a worker of the new stack
    assert bare(run.stdout).count("re-confirmed") >= 2 and says(run, "waiting")
    assert says(run, "jax 0.11.0, jaxlib 0.11.0") and says(run, "software stacks online")


@pytest.mark.slow  # discovery in a subprocess beside a server (6 s)
def test_submit_a_users_step_discovered_here_to_a_real_server(tmp_path):
    url = f"sqlite:///{tmp_path / 'submit.sqlite'}"
    token = admin_token(url)
    with running_server(database_url=url) as server:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"CMTUNE_TOKEN": token}
        run = subprocess.run([sys.executable, "-m", "cmtune", "submit", "--server", server.url, "--step",
                              "tests/steps/linen_mlp.py:linen_step", "--name", "my_linen", "--trials", "2"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        (summary,) = admin.get("/v1/submissions").json()
        sub = admin.get(f"/v1/submissions/{summary['id']}").json()
    assert sub["name"] == "my_linen" and sub["hardware_key"] == "cpu:cpu:4:1/8"  # a ring of 4 of the 8-device mesh
    roles = {role for entry in sub["entries"] for role in entry["roles"]}
    assert {"Model/layer0/up", "Model/layer1/down.grad_input", "Model/layer0/up.grad_weight"} <= roles
    assert len(sub["entries"]) == 3 and says(run, "study") and says(run, "submission")


def test_submit_a_model_twice_joins_and_the_service_says_what_does_not_fit(tmp_path):
    """The model's problems are derived once, by the service: the command sends the shape and the mesh, and
    prints what the service answered (a second submission joins the first; a shape that does not shard gets
    the service's reason)."""
    url = f"sqlite:///{tmp_path / 'twice.sqlite'}"
    token = admin_token(url)
    with running_server(database_url=url) as server:
        env = os.environ | {"CMTUNE_TOKEN": token}

        def submit(*args, hardware=("--platform", "cpu")):
            return subprocess.run([sys.executable, "-m", "cmtune", "submit", "--server", server.url, "--trials", "2",
                                   "--model", "tiny", *hardware, *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=120, env=env)

        unknown = submit("--mesh", "data=1,model=8", hardware=())  # no worker says what the hardware is
        first, second = submit("--mesh", "data=1,model=8"), submit("--mesh", "data=1,model=8")
        unfit = submit("--mesh", "data=1,model=7")
    assert unknown.returncode == 1 and says(unknown, "no worker is registered") and says(unknown, "--platform cpu")
    assert first.returncode == 0 and says(first, "submission 1") and says(first, "step:tiny"), first.stdout
    assert second.returncode == 0 and says(second, "joined submission 1"), second.stdout
    assert unfit.returncode != 0 and says(unfit, "tiny qkv: allgather_matmul: m=512 is not divisible by axis_size=7")
    assert not says(unfit, "pydantic")


def test_migrations_take_a_url_with_a_percent_sign(tmp_path):
    """Alembic's config interpolates "%": an encoded password or socket path in the URL must survive it."""
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{tmp_path / 'fifty%25.sqlite'}")
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) is not None and (tmp_path / "fifty%.sqlite").exists()
    engine.dispose()


def test_submit_with_a_compile_screen_sends_it_and_the_study_keeps_it(tmp_path):
    """`cmtune submit --screen` compiles every candidate here (CPU devices: every ring synchronous) and the study on
    the screened devices' hardware carries the verdicts."""
    url = f"sqlite:///{tmp_path / 'screen.sqlite'}"
    token = admin_token(url)
    with running_server(database_url=url) as server:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"CMTUNE_TOKEN": token}
        run = subprocess.run([sys.executable, "-m", "cmtune", "submit", "--server", server.url, "--problem",
                              "ag:256x128x256:float32:4", "--screen", "--devices", "virtual:4", "--trials", "2"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        (study,) = admin.get("/v1/studies").json()["items"]
    assert run.returncode == 0, run.stdout + run.stderr
    screen = study["settings"]["screen"]
    assert study["hardware_key"] == "cpu:cpu:4:1" and len(screen) == 32
    assert {s["overlap"] for s in screen} == {"synchronous"}  # CPU's collectives are synchronous
    assert says(run, "compile screen: 0 of 32 forms overlap, timed first; after them: 32 synchronous")
    assert says(run, "study 1: allgather_matmul:256x128x256:float32:4 (2 trials, screened: 0 of 32 forms overlap")
