"""The worker daemon as real processes against a real server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cmtune.launcher import running_server, stop, wait_ready
from cmtune.workers.cluster import free_port
from tests.service.conftest import create_tokens

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = {"collective": "allgather_matmul", "m": 256, "k": 64, "n": 128, "dtype": "float32", "axis_size": 8}


def hardware(processes: int = 1) -> dict:
    return {"platform": "cpu", "device_kind": "cpu", "device_count": 8, "process_count": processes}


def tokens(url: str) -> dict[str, str]:
    return create_tokens(url, ("admin", "worker"))


def start_worker(server: str, token: str, *extra: str, log: Path) -> subprocess.Popen:
    """A real `cmtune worker`, its token in the environment (never on a command line)."""
    return subprocess.Popen(
        [sys.executable, "-m", "cmtune", "worker", "--server", server, "--poll-seconds", "0.2",
         "--heartbeat-seconds", "0.5", *extra],
        cwd=ROOT, stdout=open(log, "a"), stderr=subprocess.STDOUT,
        env=os.environ | {"JAX_PLATFORMS": "cpu", "CMTUNE_TOKEN": token},
    )


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def study_state(api: httpx.Client, study_id: int) -> dict:
    return api.get(f"/v1/studies/{study_id}").json()


def create_study(api: httpx.Client, *, processes: int = 1, trials: int = 3) -> int:
    body = {"problem": PROBLEM, "hardware": hardware(processes), "budget": {"trials": trials}, "repeats": 3,
            "confirm_top": 1}
    response = api.post("/v1/studies", json=body)
    assert response.status_code == 201, response.text
    return response.json()["studies"][0]["id"]


@pytest.mark.slow  # a worker daemon against a real server to a stored config (10 s)
def test_worker_tunes_a_problem_to_a_stored_config(tmp_path):
    url = f"sqlite:///{tmp_path / 'w.sqlite'}"
    tok = tokens(url)
    with running_server(database_url=url) as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['admin']}"}, timeout=30)
        study_id = create_study(api)
        worker = start_worker(server.url, tok["worker"], "--devices", "virtual:8", "--exit-when-idle",
                              log=tmp_path / "worker.log")
        try:
            wait_for(lambda: study_state(api, study_id)["state"] == "completed", 240, "the study to complete")
            assert worker.wait(timeout=60) == 0
        finally:
            stop(worker)
        log = (tmp_path / "worker.log").read_text()
        assert "registered as worker" in log and "unregistered worker" in log
        assert log.count(" vs baseline ") >= 3  # one line per trial with its result
        answer = api.get("/v1/configs", params={**PROBLEM, "platform": "cpu", "device_kind": "cpu"}).json()
        assert answer["match"] == "exact"
        assert api.get("/v1/workers").json() == []  # unregistered


@pytest.mark.slow  # a worker killed and its lease waited out (8 s)
def test_killed_worker_loses_no_trial(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.sqlite'}"
    tok = tokens(url)
    with running_server(database_url=url, extra_env={"CMTUNE_LEASE_SECONDS": "3"}) as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['admin']}"}, timeout=30)
        study_id = create_study(api, trials=4)
        first = start_worker(server.url, tok["worker"], "--devices", "virtual:8", "--heartbeat-seconds", "60",
                             log=tmp_path / "first.log")
        wait_for(lambda: any(w["current_trial_id"] for w in api.get("/v1/workers").json()), 120,
                 "the first worker to hold a trial")
        first.send_signal(signal.SIGKILL)  # a hard crash in the middle of a trial
        first.wait()
        # no --exit-when-idle: the killed worker's trial only comes back when its lease expires
        second = start_worker(server.url, tok["worker"], "--devices", "virtual:8", log=tmp_path / "second.log")
        try:
            wait_for(lambda: study_state(api, study_id)["state"] == "completed", 240, "the study to complete")
        finally:
            stop(second)
        trials = api.get(f"/v1/studies/{study_id}/trials").json()
        assert all(t["state"] == "completed" or (t["state"] == "failed" and t["message"]) for t in trials)
        assert any(t["attempts"] == 2 for t in trials)  # the killed worker's trial was leased again
        search = [t["decomposition_id"] for t in trials if t["kind"] == "search"]
        assert len(search) == len(set(search)) == 4  # nothing timed or counted twice


@pytest.mark.slow  # a server stopped and started under a running worker (9 s)
def test_service_restart_mid_study(tmp_path):
    url = f"sqlite:///{tmp_path / 'r.sqlite'}"
    tok = tokens(url)
    port = free_port()
    env = os.environ | {"CMTUNE_DATABASE_URL": url, "CMTUNE_AUTH": "token"}
    command = [sys.executable, "-m", "cmtune", "serve", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker = None
    try:
        wait_ready(base, server, 60)
        api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {tok['admin']}"}, timeout=30)
        study_id = create_study(api, trials=5)
        worker = start_worker(base, tok["worker"], "--devices", "virtual:8", "--exit-when-idle",
                              log=tmp_path / "worker.log")
        wait_for(lambda: study_state(api, study_id)["trials_done"] >= 2, 180, "two finished trials")
        stop(server)
        time.sleep(2)  # the worker meets a dead service and backs off
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        wait_ready(base, server, 60)
        wait_for(lambda: study_state(api, study_id)["state"] == "completed", 240, "the study to complete")
        assert "service unreachable" in (tmp_path / "worker.log").read_text()
    finally:
        if worker is not None:
            stop(worker)
        stop(server)


@pytest.mark.slow
def test_two_process_worker_group_completes_a_study(tmp_path):
    url = f"sqlite:///{tmp_path / 'g.sqlite'}"
    tok = tokens(url)
    with running_server(database_url=url) as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['admin']}"}, timeout=30)
        study_id = create_study(api, processes=2)
        group = start_worker(server.url, tok["worker"], "--devices", "processes:2", "--local-devices", "4",
                             "--exit-when-idle", log=tmp_path / "group.log")
        try:
            wait_for(lambda: study_state(api, study_id)["state"] == "completed", 300, "the study to complete")
            assert group.wait(timeout=120) == 0
        finally:
            stop(group)
        tuned = study_state(api, study_id)["tuned"]
        assert tuned["hardware"]["process_count"] == 2
        assert tuned["compute_s"] > 0 and tuned["communication_s"] > 0 and tuned["reason"]  # both processes timed
        confirm = api.get(f"/v1/studies/{study_id}/trials").json()[-1]  # the bounds rounds together
        assert confirm["kind"] == "confirm" and confirm["bounds"]["status"] == "ok"


RING_PROBLEMS = {4: {**PROBLEM, "axis_size": 4}, 2: {**PROBLEM, "collective": "matmul_reduce_scatter", "axis_size": 2}}


@pytest.mark.slow
def test_a_slice_worker_tunes_the_rings_of_part_of_it_and_training_code_on_that_layout_finds_them(tmp_path):
    """Tensor parallelism 4 (and 2) on an 8-device slice: problems of rings of 4 and 2 submitted to the slice's
    hardware are tuned by its 2x4-device worker, every ring at once, keyed by the ring and the slice; `Tuned` on a
    ``data=2, model=4`` (``data=4, model=2``) mesh of 8 devices finds them exact, from the server and a bundle."""
    import jax

    from collective_matmul import Problem, Tuned
    from collective_matmul.client.tuned import ring_hardware

    url = f"sqlite:///{tmp_path / 'rings.sqlite'}"
    tok = tokens(url)
    with running_server(database_url=url) as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['admin']}"}, timeout=30)
        ids = {}
        for size, problem in RING_PROBLEMS.items():
            body = {"problem": problem, "hardware": hardware(processes=2), "budget": {"trials": 2}, "repeats": 3,
                    "confirm_top": 1}
            response = api.post("/v1/studies", json=body)
            assert response.status_code == 201, response.text
            (study,) = response.json()["studies"]
            assert study["hardware_key"] == f"cpu:cpu:{size}:1/8"
            ids[size] = study["id"]
        group = start_worker(server.url, tok["worker"], "--devices", "processes:2x4", "--exit-when-idle",
                             log=tmp_path / "group.log")
        try:
            wait_for(lambda: all(study_state(api, i)["state"] in ("completed", "failed") for i in ids.values()), 300,
                     "both studies to end")
            assert group.wait(timeout=120) == 0
        finally:
            stop(group)
        for size, study_id in ids.items():
            study = study_state(api, study_id)
            assert study["state"] == "completed", study
            assert (study["tuned"]["hardware"]["device_count"], study["tuned"]["hardware"]["slice_devices"]) == \
                (size, 8)
            confirm = api.get(f"/v1/studies/{study_id}/trials").json()[-1]  # its bounds rounds, as the ring ran them
            assert confirm["kind"] == "confirm" and confirm["bounds"]["status"] == "ok"
            measured = confirm["bounds"]["hardware"]
            assert (measured["device_count"], measured["process_count"], measured["slice_devices"]) == (size, 1, 8)
        bundle = tmp_path / "rings.json"
        bundle.write_text(api.get("/v1/bundles").text)
        reader = create_tokens(url, ("reader",))["reader"]
        for size, problem in RING_PROBLEMS.items():
            mesh = jax.make_mesh((8 // size, size), ("data", "model"))
            where = ring_hardware(mesh, "model")
            assert where.identity().key == f"cpu:cpu:{size}:1/8"
            for tuned, source in ((Tuned(server.url, token=reader), "server"), (Tuned(bundle=bundle), "bundle")):
                found = tuned.lookup(Problem(**problem), where)
                assert (found.match, found.origin) == ("exact", source), found


@pytest.mark.slow
def test_demo_runs_to_its_tables_and_stops_everything_on_sigterm(tmp_path):
    """The README's demo path on the tiny preset (the real demo model takes ~6 minutes): a 2-process worker
    tunes every problem, the step is measured, both tables print; SIGTERM then stops the server and worker."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "cmtune", "demo", "--model", "tiny", "--trials", "2", "--repeats", "3",
         "--keep-serving", "--data-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not any("serving at" in line for line in lines):
            line = demo.stdout.readline()
            if not line and demo.poll() is not None:
                break
            lines.append(line)
        text = "".join(lines)
        assert "serving at" in text, text[-3000:]
        assert "tuned collective matmuls of tiny on cpu:cpu:8:2" in text
        assert "mlp_up, mlp_down.grad_input" in text
        assert "the whole training step of tiny, measured" in text and "over the step as written" in text
        assert "timed again after the decision" in text  # the reported speedup is not the deciding rounds
        assert "estimated from the ops" in text
        assert "communication" in text and "hidden" in text  # every problem's bounds, and why in the caption
        assert "/docs" in text and "/ui/submissions/1#token=cmt_" in text
        url = next(word for line in lines if "serving at" in line for word in line.split() if word.startswith("http"))
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=60) == 0
    finally:
        stop(demo)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/healthz", timeout=2)
    assert "demo-worker" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_a_signal_passed_on_by_a_launcher_is_not_a_second_signal(monkeypatch):
    """A signal to a worker group's process group reaches each process twice at once (from the sender and
    from its launcher): the daemon finishes its trial; only a second signal a while later gives it back now."""
    from cmtune.workers import daemon

    worker = daemon.WorkerDaemon("http://127.0.0.1:9", None)
    clock = [100.0]
    monkeypatch.setattr(daemon.time, "monotonic", lambda: clock[0])
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker.install_signal_handlers()
        signal.raise_signal(signal.SIGTERM)
        clock[0] += 0.05
        signal.raise_signal(signal.SIGTERM)  # the launcher's echo of the same stop
        assert worker.state.stop.is_set() and not worker.state.abort.is_set()
        clock[0] += 5
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # a user who means it
        assert worker.state.abort.is_set()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
