"""Real workers against a real server when trials cannot fit or hang: every trial ends, every study too."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cmtune.launcher import running_server, stop
from cmtune.workers.cluster import launch
from tests.service.conftest import create_tokens
from tests.workers.test_daemon import hardware, wait_for

ROOT = Path(__file__).resolve().parents[2]
HUGE = {"collective": "allgather_matmul", "m": 16777216, "k": 8192, "n": 8192, "dtype": "float32", "axis_size": 8}
SMALL = {"collective": "allgather_matmul", "m": 256, "k": 64, "n": 128, "dtype": "float32", "axis_size": 8}


def limited(gib: float):
    """A preexec_fn capping the child's address space (RLIMIT_AS): a machine of that size, not this one."""
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (int(gib * 2**30), int(gib * 2**30)))
    return apply


def submit(api: httpx.Client, problem: dict, **extra) -> httpx.Response:
    return api.post("/v1/studies", json={"problem": problem, "hardware": hardware(), "repeats": 3,
                                         "budget": {"trials": 3}, "confirm_top": 1} | extra)


@pytest.mark.slow  # a worker forked into an out-of-memory trial (10 s)
def test_a_trial_that_cannot_fit_is_a_result_and_the_worker_lives_on(tmp_path):
    url = f"sqlite:///{tmp_path / 'oom.sqlite'}"
    tok = create_tokens(url, ("admin", "worker"))
    with running_server(database_url=url) as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['admin']}"}, timeout=30)
        huge = submit(api, HUGE).json()["studies"][0]["id"]  # accepted: no worker has said what it holds yet
        small = submit(api, SMALL).json()["studies"][0]["id"]
        log = tmp_path / "worker.log"
        worker = subprocess.Popen(
            [sys.executable, "-m", "cmtune", "worker", "--server", server.url, "--devices", "virtual:8",
             "--poll-seconds", "0.2", "--heartbeat-seconds", "1", "--exit-when-idle"],
            cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, preexec_fn=limited(16),
            env=os.environ | {"JAX_PLATFORMS": "cpu", "CMTUNE_TOKEN": tok["worker"]})
        try:
            wait_for(lambda: api.get(f"/v1/studies/{small}").json()["state"] == "completed", 240,
                     "the small study to complete after the huge one")
            assert worker.wait(timeout=60) == 0  # it lived on, then left when idle
        finally:
            stop(worker)
        study = api.get(f"/v1/studies/{huge}").json()
        assert study["state"] == "failed", study
        trials = api.get(f"/v1/studies/{huge}/trials").json()
        assert trials[0]["status"] == "oom" and "GiB per device" in trials[0]["message"]
        assert "oom" in study["message"]
        # now that workers of this hardware have said how much memory a device has, it is refused up front
        again = submit(api, HUGE, force=True)
        assert again.status_code == 422 and "GiB per device" in again.text


@pytest.mark.slow
def test_a_hung_group_is_ended_restarted_and_its_trial_counted(tmp_path):
    """Process 1 skips a trial's collectives; process 0's watchdog ends the group, the supervisor starts it
    again, the lease expires (the attempt counts) and the trial runs again to a result."""
    url = f"sqlite:///{tmp_path / 'hang.sqlite'}"
    tok = create_tokens(url, ("admin", "worker"))
    env = {"CMTUNE_LEASE_SECONDS": "4", "CMTUNE_MAX_ATTEMPTS": "3"}
    with running_server(database_url=url, extra_env=env) as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tok['admin']}"}, timeout=30)
        study = submit(api, SMALL, timeout_s=2, hardware=hardware(2)).json()["studies"][0]["id"]
        log = tmp_path / "group.log"
        group = subprocess.Popen(
            [sys.executable, "-m", "tests.workers.hanging_job", "worker", "--server", server.url, "--restart",
             "--devices", "processes:2", "--local-devices", "4", "--poll-seconds", "0.2", "--heartbeat-seconds", "1",
             "--trial-grace-seconds", "6", "--exit-when-idle"],
            cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
            env=os.environ | {"CMTUNE_TOKEN": tok["worker"], "CMTUNE_TEST_MARKER": str(tmp_path / "planted")})
        try:
            wait_for(lambda: api.get(f"/v1/studies/{study}").json()["state"] == "completed", 400,
                     "the study to complete after the hang")
            assert group.wait(timeout=120) == 0
        finally:
            stop(group)
        text = log.read_text()
        assert (tmp_path / "planted").exists()
        assert "hung: no result after" in text and "starting it again" in text
        trials = api.get(f"/v1/studies/{study}/trials").json()
        assert all(t["state"] == "completed" for t in trials)
        assert max(t["attempts"] for t in trials) == 2  # the hung one: its lease expired, then it ran again


@pytest.mark.slow
def test_cmtune_tune_ends_a_hung_group_and_names_the_candidate(tmp_path):
    args = ["-m", "tests.workers.hanging_job", "tune", "--problem", "ag:256x64x128:float32:8", "--trials", "3",
            "--repeats", "3", "--timeout", "2", "--trial-grace-seconds", "6"]
    os.environ["CMTUNE_TEST_MARKER"] = str(tmp_path / "planted")
    try:
        with pytest.raises(RuntimeError) as failure:
            launch(2, args, local_devices=4, cwd=ROOT, timeout_s=300)
    finally:
        del os.environ["CMTUNE_TEST_MARKER"]
    message = str(failure.value)
    assert "process 0 exited 75" in message
    assert "allgather_matmul:256x64x128:float32:8: trial 1 (baseline) hung" in message


@pytest.mark.slow  # a planted hang on a 2-process group waits out its watchdog
def test_a_follower_hung_in_a_trial_ends_the_group_with_its_own_watchdog(tmp_path):
    """Process 0 skips a trial's collectives (its record returns at once and it goes on): process 1 waits in the
    trial's first collective, and its own watchdog ends it, with status 75 and the trial named, within the
    trial's deadline; the group ends with it."""
    args = ["-m", "tests.workers.hanging_job", "tune", "--problem", "ag:256x64x128:float32:8", "--trials", "3",
            "--repeats", "3", "--timeout", "2", "--trial-grace-seconds", "6"]
    os.environ |= {"CMTUNE_TEST_MARKER": str(tmp_path / "planted"), "CMTUNE_TEST_SKIPPER": "0"}
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as failure:
            launch(2, args, local_devices=4, cwd=ROOT, timeout_s=300)
    finally:
        del os.environ["CMTUNE_TEST_MARKER"], os.environ["CMTUNE_TEST_SKIPPER"]
    message = str(failure.value)
    assert "process 1 exited 75" in message and "(following process 0) hung" in message, message[-2000:]
    assert time.monotonic() - started < 120
