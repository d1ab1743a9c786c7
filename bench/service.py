"""Benchmark the service on a real uvicorn server: config look-ups and the lease/report cycle.

    python bench/service.py                                   # SQLite
    CMTUNE_TEST_DATABASE_URL=postgresql+psycopg://... python bench/service.py   # and PostgreSQL

1. Look-ups: 64 keep-alive connections (raw asyncio HTTP/1.1 in this process) send
   ``GET /v1/configs`` for a mix of exact, nearest and model answers: closed loop (as fast as
   answered) for the throughput, then paced at 1000 requests/s (latency counted from each
   request's due time) for the latency at the target load; three rounds each.
2. Lease + report: 32 simulated workers (threads), each looping lease -> synthetic result ->
   report over many studies; cycles/s, and every lease checked for duplicates (a trial held by
   two workers at once, or one candidate of a study leased twice).
3. The cached `Tuned.lookup` in-process: nanoseconds per call (timeit, 7 rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

HARDWARE = {"platform": "cpu", "device_kind": "cpu", "device_count": 8, "process_count": 1}


def prepare(url: str) -> str:
    from collective_matmul import Decomposition, Hardware, Problem
    from collective_matmul.bundle import TunedConfig
    from service import migrate
    from service import repository as repo
    from service.db import Database

    db = Database(url)
    migrate.downgrade(db.engine, "base") if migrate.current_revision(db.engine) else None
    migrate.upgrade(db.engine)
    with db.session(write=True) as session:
        _, token = repo.create_token(session=session, name="bench", role="admin")
        for m in (256, 512, 1024, 2048, 4096, 8192):
            for collective in ("allgather_matmul", "matmul_reduce_scatter"):
                problem = Problem(collective=collective, m=m, k=1024, n=1024, dtype="bfloat16", axis_size=8)
                repo.upsert_tuned(session=session, study_id=None, config=TunedConfig(
                    problem=problem, hardware=Hardware(**HARDWARE), time_s=1e-3, baseline_s=1.2e-3, speedup=1.2,
                    decomposition=Decomposition(direction="bidirectional", chunks=2, accumulate=None)))
    db.dispose()
    return token


def lookup_params(i: int) -> dict:
    kind = i % 3
    m = (256, 512, 1024, 2048)[i % 4] * (3 if kind == 1 else 1)  # exact, nearest, or another hardware
    return {"collective": "allgather_matmul", "m": m, "k": 1024, "n": 1024, "dtype": "bfloat16", "axis_size": 8,
            "platform": "cpu", "device_kind": "cpu" if kind != 2 else "cpu-b"}


async def lookup_load(url: str, token: str, seconds: float, *, concurrency: int = 64,
                      rate: float | None = None) -> dict:
    """GET /v1/configs over ``concurrency`` keep-alive connections (raw asyncio HTTP/1.1).

    ``rate=None``: closed loop, as fast as the server answers.  ``rate=R``: open loop, request i
    is due at ``i / R`` seconds and its latency counts from then (no coordinated omission).
    """
    host, port = url.removeprefix("http://").split(":")
    paths = [f"/v1/configs?{urlencode(lookup_params(i))}" for i in range(24)]
    latencies: list[float] = []
    errors = 0
    ticket = 0
    started = time.perf_counter()
    deadline = started + seconds

    async def connection(worker: int) -> None:
        nonlocal errors, ticket
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while True:
                i = ticket
                ticket += 1
                due = started + i / rate if rate else time.perf_counter()
                if due >= deadline:
                    return
                if rate and due > time.perf_counter():
                    await asyncio.sleep(due - time.perf_counter())
                request = (f"GET {paths[i % len(paths)]} HTTP/1.1\r\nHost: {host}\r\n"
                           f"Authorization: Bearer {token}\r\n\r\n")
                writer.write(request.encode())
                status_line = await reader.readline()
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - due)
                errors += not status_line.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()

    await asyncio.gather(*(connection(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"rps": len(latencies) / elapsed, "p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3, "requests": len(latencies), "errors": errors}


def lease_load(url: str, token: str, seconds: float, workers: int = 32) -> dict:
    from collective_matmul import Decomposition, Hardware, Problem
    from tuner.measure import Measurement, Timing

    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for m in range(8, 8 * 41, 8):  # 40 studies x 49 candidates
            body = {"problem": {"collective": "allgather_matmul", "m": m * 8, "k": 64, "n": 64, "dtype": "bfloat16",
                                "axis_size": 8}, "hardware": HARDWARE, "budget": {"trials": 49}, "confirm_top": 0}
            client.post("/v1/studies", json=body).raise_for_status()
        ids = [client.post("/v1/workers", json={"name": f"sim{i}", "hardware": HARDWARE}).json()["id"]
               for i in range(workers)]
    hw = Hardware(**HARDWARE)
    held: dict[int, int] = {}
    leased_candidates: set[tuple] = set()
    duplicates = cycles = failures = 0
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def run(worker_id: int) -> None:
        nonlocal duplicates, cycles, failures
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            while time.perf_counter() < deadline:
                response = c.post(f"/v1/workers/{worker_id}/lease")
                if response.status_code != 200:
                    failures += response.status_code != 204
                    continue
                grant = response.json()
                trial = grant["trial"]
                with lock:
                    if trial["id"] in held:
                        duplicates += 1
                    held[trial["id"]] = worker_id
                    if trial["kind"] == "search":
                        key = (trial["study_id"], str(trial["decomposition"]))
                        duplicates += key in leased_candidates
                        leased_candidates.add(key)
                problem = Problem.model_validate(trial["problem"])
                records = [Measurement(problem=problem, decomposition=Decomposition.model_validate(d), hardware=hw,
                                       status="ok", candidate=Timing.of([1e-3]), baseline=Timing.of([1e-3]),
                                       ratio=1.0, ratio_iqr=0.0).model_dump(mode="json")
                           for d in trial["decompositions"]]
                body = {"lease_id": grant["lease"]["id"]}
                body |= {"measurement": records[0]} if trial["kind"] == "search" else {"measurements": records}
                with lock:
                    held.pop(trial["id"], None)
                reply = c.post(f"/v1/trials/{trial['id']}/result", json=body)
                with lock:
                    cycles += reply.status_code == 200
                    failures += reply.status_code != 200

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"cycles_per_s": cycles / (time.perf_counter() - started), "cycles": cycles,
            "duplicates": duplicates, "failures": failures}


def cached_client_lookup() -> dict:
    from collective_matmul import Hardware, Problem, Tuned

    tuned = Tuned()
    problem = Problem(collective="allgather_matmul", m=1024, k=1024, n=1024, dtype="bfloat16", axis_size=8)
    hw = Hardware(**HARDWARE)
    tuned.lookup(problem, hw)
    n = 200_000
    rounds = [t / n * 1e6 for t in timeit.repeat(lambda: tuned.lookup(problem, hw), number=n, repeat=7)]
    return {"median_us": statistics.median(rounds), "min_us": min(rounds), "max_us": max(rounds)}


def run_backend(name: str, url: str, seconds: float, workers: int) -> dict:
    from service.launcher import running_server

    token = prepare(url)
    with running_server(database_url=url, extra_env={"CMTUNE_CONFIG_CACHE_SECONDS": "2"},
                        workers=workers) as server:
        asyncio.run(lookup_load(server.url, token, 2))  # warm-up (connections, caches), not recorded
        closed = [asyncio.run(lookup_load(server.url, token, seconds)) for _ in range(3)]
        paced = []
        for _ in range(3):
            before = config_buckets(server.url) if workers == 1 else None
            result = asyncio.run(lookup_load(server.url, token, seconds, rate=1000))
            if before is not None:  # each worker process keeps its own histogram
                result["server_p99_ms"] = bucket_quantile(before, config_buckets(server.url), 0.99) * 1e3
            paced.append(result)
        lease = lease_load(server.url, token, seconds)
    return {"backend": f"{name}, {workers} process{'es' if workers > 1 else ''}", "closed": closed,
            "paced": paced, "lease": lease}


def config_buckets(url: str) -> dict[float, float]:
    """Cumulative counts of the service's own latency histogram for GET /v1/configs."""
    buckets: dict[float, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("cmtune_http_request_seconds_bucket") and 'route="/v1/configs"' in line:
            bound = line.split('le="')[1].split('"')[0]
            buckets[float(bound)] = buckets.get(float(bound), 0.0) + float(line.rsplit(" ", 1)[1])
    return buckets


def bucket_quantile(before: dict, after: dict, q: float) -> float:
    """Upper bound of the histogram bucket holding quantile ``q`` of the requests in between."""
    counts = {b: after[b] - before.get(b, 0.0) for b in sorted(after)}
    total = counts[float("inf")]
    return next(b for b, c in counts.items() if c >= q * total)


def _spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    gc.collect()
    gc.freeze()  # this process imports JAX: keep its heap out of full collections while measuring
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--sqlite", default=str(Path(tempfile.gettempdir()) / "cmtune-bench-service.sqlite"))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="server processes (cmtune serve --workers), one run each")
    args = parser.parse_args()
    Path(args.sqlite).unlink(missing_ok=True)
    backends = [("sqlite", f"sqlite:///{args.sqlite}")]
    if os.environ.get("CMTUNE_TEST_DATABASE_URL"):
        backends.append(("postgresql", os.environ["CMTUNE_TEST_DATABASE_URL"]))
    results = [run_backend(name, url, args.seconds, workers) for name, url in backends for workers in args.workers]
    client = cached_client_lookup()
    print(f"{os.cpu_count()} CPUs, {args.seconds:.0f} s per round, 3 rounds, 64 connections; "
          "median of rounds (min-max)\n")
    print("| backend | load | look-ups/s | p50 | p99 | p99 inside the service | errors |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        for load, label in (("closed", "closed loop (max)"), ("paced", "paced at 1000/s")):
            rounds = r[load]
            cells = [_spread([x[f] for x in rounds], fmt) for f, fmt in
                     (("rps", "{:.0f}"), ("p50_ms", "{:.1f} ms"), ("p99_ms", "{:.1f} ms"))]
            inside = (f"<= {statistics.median(x['server_p99_ms'] for x in rounds):g} ms"
                      if "server_p99_ms" in rounds[0] else "-")
            print(f"| {r['backend']} | {label} | {' | '.join(cells)} | {inside} "
                  f"| {sum(x['errors'] for x in rounds)} |")
    print("\n| backend | lease+report cycles/s (32 workers) | cycles | failed | duplicate leases |")
    print("|---|---|---|---|---|")
    for r in results:
        lease = r["lease"]
        print(f"| {r['backend']} | {lease['cycles_per_s']:.1f} | {lease['cycles']} | {lease['failures']} "
              f"| {lease['duplicates']} |")
    print(f"\ncached `Tuned.lookup`: {client['median_us']:.2f} µs median of 7 rounds "
          f"({client['min_us']:.2f}-{client['max_us']:.2f})")


if __name__ == "__main__":
    main()
