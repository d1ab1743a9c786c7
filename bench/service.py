"""Benchmark the service on a real uvicorn server: config look-ups and the lease/report cycle.

    python bench/service.py                                   # SQLite
    CMTUNE_TEST_DATABASE_URL=postgresql+psycopg://... python bench/service.py   # and PostgreSQL

1. Look-ups: 64 keep-alive connections (raw asyncio HTTP/1.1 in this process) send
   ``GET /v1/configs`` for a mix of exact, nearest and model answers: closed loop (as fast as
   answered) for the throughput, then paced at 1000 requests/s (latency counted from each
   request's due time) for the latency at the target load; three rounds each.
2. Lease + report: 32 simulated workers (keep-alive connections, each with its own credential,
   raw asyncio HTTP/1.1 in this process), each looping lease -> synthetic result -> report over
   many studies kept open by a submitter (default sampler and budget, so every proposal is made
   during the run); three rounds: cycles/s, each request's median latency,
   and every lease checked for duplicates (a trial held by two workers at once, or one
   candidate of a study leased twice).  ``--lease-workers 1`` gives the cost of one cycle
   without contention.
3. The cached `Tuned.lookup` in-process: nanoseconds per call (timeit, 7 rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import itertools
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

HARDWARE = {"platform": "cpu", "device_kind": "cpu", "device_count": 8, "process_count": 1}


def prepare(url: str) -> str:
    from cmtune.service import migrate
    from cmtune.service.db import Database
    from cmtune.service.models import TokenRole
    from cmtune.service.store import SqlStore
    from collective_matmul import Decomposition, Hardware, Problem
    from collective_matmul.wire.bundle import TunedConfig

    db = Database(url)
    migrate.downgrade(db.engine, "base") if migrate.current_revision(db.engine) else None
    migrate.upgrade(db.engine)
    with SqlStore(db).write() as tx:
        _, token = tx.tokens.add(name="bench", role=TokenRole.ADMIN)
        for m in (256, 512, 1024, 2048, 4096, 8192):
            for collective in ("allgather_matmul", "matmul_reduce_scatter"):
                problem = Problem(collective=collective, m=m, k=1024, n=1024, dtype="bfloat16", axis_size=8)
                tx.save_tuned(TunedConfig(
                    problem=problem, hardware=Hardware(**HARDWARE), time_s=1e-3, baseline_s=1.2e-3, speedup=1.2,
                    decomposition=Decomposition(direction="bidirectional", chunks=2, accumulate=None)), study_id=None)
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


_STUDY_NUMBERS = itertools.count(1)  # across rounds: a problem that already has a study is not studied again
LEASE_PROBLEMS = [("allgather_matmul", "bfloat16"), ("matmul_reduce_scatter", "float32"),
                  ("matmul_reduce_scatter", "bfloat16")]  # 49, 25 and 49 candidates


def synthetic_ratio(config) -> float:
    """A smooth landscape, so that TPE has something to model (the baseline is 1)."""
    if config.method == "baseline":
        return 1.0
    return (0.8 + (0.1 if config.direction == "unidirectional" else 0) + 0.03 * abs(config.chunks - 2)
            + (0.04 if config.unroll != "full" else 0) + (0.02 if config.accumulate == "concat" else 0))


class Http:
    """One keep-alive HTTP/1.1 connection (raw asyncio: the load generator must not be the limit).

    ``reconnect_every``: open a new connection after that many requests.  The processes of
    ``cmtune serve --workers N`` share one listening socket and whichever is free accepts a new
    connection; 32 connections opened at once can all land on one process and leave the others
    idle, so simulated workers reconnect now and then, as they would behind a load balancer.
    """

    def __init__(self, url: str, headers: dict[str, str], reconnect_every: int | None = None):
        self.host, self.port = url.removeprefix("http://").split(":")
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader = self.writer = None
        self.reconnect_every, self.sent = reconnect_every, 0

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.headers}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        self.sent += 1
        if self.reconnect_every and self.sent % self.reconnect_every == 0:
            self.close()
        for _ in range(2):  # a connection that idled past the server's keep-alive is closed: open another
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))
            self.writer.write(head.encode() + body)
            if status_line := await self.reader.readline():
                break
            self.close()
        status = int(status_line.split()[1])
        length, close = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
            close |= name.lower() == b"connection" and value.strip().lower() == b"close"
        payload = await self.reader.readexactly(length)
        if close:
            self.close()
        return status, payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


def lease_load(url: str, token: str, seconds: float, workers: int = 32, active: int = 96,
               warmup: float = 3.0, lease_next: bool = True) -> dict:
    """32 simulated workers lease, report a synthetic result, lease again; studies keep coming.

    Each worker is one keep-alive connection with its own credential, sending what the worker
    daemon sends (the wire types' JSON): a result that also leases the worker's next trial
    (``lease_next``), or with ``lease_next=False`` a lease request and a result per cycle.
    Steady state: a submitter keeps ``active`` studies open by creating new ones (default sampler,
    budget and warm start: a study of a shape near those tuned before stops after a few trials) as
    others complete, so every proposal the engine makes is made inside the run, and only cycles
    after ``warmup`` seconds count.
    """
    return asyncio.run(_lease_load(url, token, seconds, workers, active, warmup, lease_next))


async def _lease_load(url: str, token: str, seconds: float, workers: int, active: int, warmup: float,
                      lease_next: bool) -> dict:
    from collective_matmul.wire import (
        WORKER_HEADER,
        HardwareIn,
        LeaseGranted,
        Measurement,
        Problem,
        ResultIn,
        ResultOut,
        StudyCreate,
        StudyPage,
        Timing,
        WorkerCreate,
        WorkerRegistered,
        result_of,
    )

    headers = {"Authorization": f"Bearer {token}"}
    hardware = HardwareIn(**HARDWARE)
    hw = hardware.to_hardware()
    admin = Http(url, headers)
    registered = []
    for i in range(workers):
        body = WorkerCreate(name=f"sim{i}", hardware=hardware).model_dump_json().encode()
        registered.append(WorkerRegistered.model_validate_json((await admin.request("POST", "/v1/workers", body))[1]))
    held: dict[int, int] = {}
    leased_candidates: set[tuple] = set()
    counts = {"cycles": 0, "duplicates": 0, "failures": 0, "studies": 0, "empty": 0}
    opened: list[int] = []  # open studies at each count of the submitter
    lease_s: list[float] = []
    result_s: list[float] = []
    started = time.perf_counter()
    counting_from, deadline = started + warmup, started + warmup + seconds

    async def submit_one(client: Http) -> None:
        i = next(_STUDY_NUMBERS)
        collective, dtype = LEASE_PROBLEMS[i % len(LEASE_PROBLEMS)]
        problem = Problem(collective=collective, m=64 * i, k=256, n=256, dtype=dtype, axis_size=8)
        body = StudyCreate(problem=problem, hardware=hardware).model_dump_json(exclude_none=True).encode()
        status, payload = await client.request("POST", "/v1/studies", body)
        if status != 201:
            raise RuntimeError(f"creating a study: {status} {payload[:300]!r}")
        counts["studies"] += time.perf_counter() >= counting_from

    async def submitter() -> None:
        """Keeps ``active`` studies open.  With warm start a study stops after a few trials (its seeds agree
        with its neighbours), so studies end dozens of times a second: 16 connections each create a study
        whenever the open ones, counted ten times a second (one request per open state, at once) plus those
        created since, fall short, with no pause between them (a submitter that counted, then created a
        batch, fell behind to a third of ``active`` and left workers without trials)."""
        clients = [Http(url, headers) for _ in range(16)]
        counters = [Http(url, headers) for _ in range(3)]
        estimate = {"open": 0, "created": 0}

        async def count(client: Http, state: str) -> int:
            _, payload = await client.request("GET", f"/v1/studies?state={state}&limit=1")
            return StudyPage.model_validate_json(payload).total

        async def counting() -> None:
            while time.perf_counter() < deadline:
                created_before = estimate["created"]
                open_studies = sum(await asyncio.gather(*(count(c, s) for c, s in zip(
                    counters, ("pending", "running", "confirming"), strict=True))))
                opened.append(open_studies)
                estimate["open"], estimate["created"] = open_studies, estimate["created"] - created_before
                await asyncio.sleep(0.1)

        async def creating(client: Http) -> None:
            while time.perf_counter() < deadline:
                if estimate["open"] + estimate["created"] >= active:
                    await asyncio.sleep(0.01)
                    continue
                estimate["created"] += 1
                await submit_one(client)

        await asyncio.gather(*(submit_one(c) for c in clients))  # the first studies before the workers start
        estimate["created"] = len(clients)
        await asyncio.gather(counting(), *(creating(c) for c in clients))
        for client in clients + counters:
            client.close()

    async def run(me: WorkerRegistered) -> None:
        worker_id = me.id
        client = Http(url, headers | {WORKER_HEADER: me.credential}, reconnect_every=10)
        grant = None  # leased with the last result, as the worker daemon does
        while (now := time.perf_counter()) < deadline:
            if grant is None:
                t0 = time.perf_counter()
                status, payload = await client.request("POST", f"/v1/workers/{worker_id}/lease")
                lease_s.append(time.perf_counter() - t0)
                if status != 200:
                    counts["failures"] += status != 204
                    counts["empty"] += status == 204
                    await asyncio.sleep(0.01)
                    continue
                grant = LeaseGranted.model_validate_json(payload)
            trial = grant.trial
            counts["duplicates"] += trial.id in held
            held[trial.id] = worker_id
            if trial.kind == "search":
                key = (trial.study_id, trial.decomposition.id)
                counts["duplicates"] += key in leased_candidates
                leased_candidates.add(key)
            results = [Measurement(problem=trial.problem, decomposition=d, hardware=hw, status="ok",
                                   candidate=Timing.of([1e-3 * synthetic_ratio(d)]), baseline=Timing.of([1e-3]),
                                   ratio=synthetic_ratio(d), ratio_iqr=0.0) for d in trial.decompositions]
            held.pop(trial.id, None)
            body = ResultIn.of(grant.lease.id, result_of(trial.kind, results), lease_next=lease_next) \
                .model_dump_json(exclude=None if lease_next else {"lease_next"}).encode()  # (servers before it)
            t0 = time.perf_counter()
            status, payload = await client.request("POST", f"/v1/trials/{trial.id}/result", body)
            result_s.append(time.perf_counter() - t0)
            if now >= counting_from and time.perf_counter() < deadline:
                counts["cycles"] += status == 200
            counts["failures"] += status != 200
            grant = ResultOut.model_validate_json(payload).next if status == 200 else None
        client.close()

    await asyncio.gather(submitter(), *(run(w) for w in registered))
    admin.close()
    return {"cycles_per_s": counts["cycles"] / seconds, **counts,
            "open_studies": statistics.median(opened) if opened else 0,
            "lease_p50_ms": statistics.median(lease_s) * 1e3, "result_p50_ms": statistics.median(result_s) * 1e3}


def lease_rounds(server_url: str, database_url: str, token: str, seconds: float, workers: int,
                 lease_next: bool = True) -> list[dict]:
    """Three recorded rounds after one unrecorded: the tables hold a running service's data, and
    their planner statistics are taken then (``ANALYZE``, as autovacuum does on a live database)."""
    lease_load(server_url, token, seconds / 2, workers, lease_next=lease_next)
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text("ANALYZE"))
    engine.dispose()
    return [lease_load(server_url, token, seconds, workers, lease_next=lease_next) for _ in range(3)]


def ask_cost(repeats: int = 50) -> dict:
    """Milliseconds per engine ask, by kind: a cost-model proposal and a TPE proposal (median)."""
    import random

    from cmtune.tuner.search import Finished, Searcher, SearchSettings
    from collective_matmul import Problem

    problem = Problem(collective="allgather_matmul", m=4096, k=256, n=256, dtype="bfloat16", axis_size=8)
    searcher = Searcher(problem, "cpu", SearchSettings())
    rng = random.Random(0)
    finished: list[Finished] = []
    for _ in range(10):  # baseline + 8 cost-model favourites + one: TPE from here on
        config = searcher.ask(finished)
        finished.append(Finished(config, synthetic_ratio(config) * rng.uniform(0.95, 1.05)))
    seeded = Searcher(problem, "cpu", SearchSettings())
    timings = {}
    for name, ask, history in (("cost model", seeded.ask, finished[:3]), ("TPE", searcher.ask, finished)):
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ask(history, [])
            samples.append((time.perf_counter() - t0) * 1e3)
        timings[name] = statistics.median(samples)
    return timings


def cached_client_lookup() -> dict:
    from collective_matmul import Hardware, Problem, Tuned

    tuned = Tuned()
    problem = Problem(collective="allgather_matmul", m=1024, k=1024, n=1024, dtype="bfloat16", axis_size=8)
    hw = Hardware(**HARDWARE)
    tuned.lookup(problem, hw)
    n = 200_000
    rounds = [t / n * 1e6 for t in timeit.repeat(lambda: tuned.lookup(problem, hw), number=n, repeat=7)]
    return {"median_us": statistics.median(rounds), "min_us": min(rounds), "max_us": max(rounds)}


def run_backend(name: str, url: str, seconds: float, workers: int, only: str | None = None,
                lease_workers: int = 32, lease_next: bool = True) -> dict:
    from cmtune.launcher import running_server

    token = prepare(url)
    with running_server(database_url=url, extra_env={"CMTUNE_CONFIG_CACHE_SECONDS": "2"},
                        workers=workers) as server:
        if only == "lease":
            return {"backend": f"{name}, {workers} process{'es' if workers > 1 else ''}", "closed": [],
                    "paced": [], "lease": lease_rounds(server.url, url, token, seconds, lease_workers, lease_next)}
        asyncio.run(lookup_load(server.url, token, 2))  # warm-up (connections, caches), not recorded
        closed = [asyncio.run(lookup_load(server.url, token, seconds)) for _ in range(3)]
        paced = []
        for _ in range(3):
            before = config_buckets(server.url) if workers == 1 else None
            result = asyncio.run(lookup_load(server.url, token, seconds, rate=1000))
            if before is not None:  # each worker process keeps its own histogram
                result["server_p99_ms"] = bucket_quantile(before, config_buckets(server.url), 0.99) * 1e3
            paced.append(result)
        lease = lease_rounds(server.url, url, token, seconds, lease_workers, lease_next)
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


# the lease cycle's goals (docs/benchmarks.md): a row of this backend and process count must reach this median rate,
# with no failed request and no duplicate lease
LEASE_GOALS = {"postgresql, 2 processes": 200.0, "sqlite, 1 process": 130.0}


def lease_goal(result: dict) -> str | None:
    """One line saying whether a lease row met its goal (None for a row without one): the regression guard."""
    goal, rounds = LEASE_GOALS.get(result["backend"]), result["lease"]
    if goal is None or not rounds:
        return None
    rate = statistics.median(x["cycles_per_s"] for x in rounds)
    failed, duplicates = sum(x["failures"] for x in rounds), sum(x["duplicates"] for x in rounds)
    held = rate >= goal and failed == 0 and duplicates == 0
    return (f"lease goal {'held' if held else 'NOT HELD'} on {result['backend']}: {rate:.1f} cycles/s "
            f"(goal {goal:.0f}), {failed} failed, {duplicates} duplicate leases")


def commit() -> str:
    """The checked-out commit, ``+`` if the working tree has changes: each row of docs/benchmarks.md names it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+" if git("status", "--porcelain", "--", ".") else "")


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
    parser.add_argument("--only", choices=["lease"], help="run only the lease+report benchmark")
    parser.add_argument("--lease-workers", type=int, default=32, help="simulated workers of the lease benchmark")
    parser.add_argument("--separate-leases", action="store_true",
                        help="a lease request and a result per cycle (default: the result leases the next trial, "
                             "as the worker daemon does)")
    parser.add_argument("--backends", nargs="+", choices=["sqlite", "postgresql"], default=["sqlite", "postgresql"],
                        help="postgresql needs CMTUNE_TEST_DATABASE_URL")
    args = parser.parse_args()
    Path(args.sqlite).unlink(missing_ok=True)
    backends = [("sqlite", f"sqlite:///{args.sqlite}")]
    if os.environ.get("CMTUNE_TEST_DATABASE_URL"):
        backends.append(("postgresql", os.environ["CMTUNE_TEST_DATABASE_URL"]))
    elif args.backends == ["postgresql"]:
        raise SystemExit("--backends postgresql needs CMTUNE_TEST_DATABASE_URL (postgresql+psycopg://user:pw@host/db)")
    elif "postgresql" in args.backends:
        print("CMTUNE_TEST_DATABASE_URL is not set: PostgreSQL is left out\n", file=sys.stderr)
    backends = [(name, url) for name, url in backends if name in args.backends]
    results = [run_backend(name, url, args.seconds, workers, args.only, args.lease_workers, not args.separate_leases)
               for name, url in backends
               for workers in args.workers]
    client = cached_client_lookup()
    print(f"{dt.date.today()}, commit {commit()}, {os.cpu_count()} CPUs, {args.seconds:.0f} s per round, 3 rounds, "
          "64 connections; median of rounds (min-max)\n")
    print("| backend | load | look-ups/s | p50 | p99 | p99 inside the service | errors |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        for load, label in (("closed", "closed loop (max)"), ("paced", "paced at 1000/s")):
            rounds = r[load]
            if not rounds:
                continue
            cells = [_spread([x[f] for x in rounds], fmt) for f, fmt in
                     (("rps", "{:.0f}"), ("p50_ms", "{:.1f} ms"), ("p99_ms", "{:.1f} ms"))]
            inside = (f"<= {statistics.median(x['server_p99_ms'] for x in rounds):g} ms"
                      if "server_p99_ms" in rounds[0] else "-")
            print(f"| {r['backend']} | {label} | {' | '.join(cells)} | {inside} "
                  f"| {sum(x['errors'] for x in rounds)} |")
    protocol = "a lease and a result per cycle" if args.separate_leases else "each result leases the next trial"
    print(f"\nlease + report ({protocol}):\n")
    print(f"| backend | lease+report cycles/s ({args.lease_workers} workers) | cycles | studies created "
          "| open studies | empty leases | failed | duplicate leases | lease p50 | result p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        rounds = r["lease"]
        total = {k: sum(x[k] for x in rounds) for k in ("cycles", "studies", "empty", "failures", "duplicates")}
        print(f"| {r['backend']} | {_spread([x['cycles_per_s'] for x in rounds], '{:.1f}')} | {total['cycles']} "
              f"| {total['studies']} | {_spread([x['open_studies'] for x in rounds], '{:.0f}')} "
              f"| {total['empty']} | {total['failures']} | {total['duplicates']} "
              f"| {_spread([x['lease_p50_ms'] for x in rounds], '{:.0f} ms')} "
              f"| {_spread([x['result_p50_ms'] for x in rounds], '{:.0f} ms')} |")
    for r in results:
        if (verdict := lease_goal(r)) is not None:
            print(f"\n{verdict}")
    asks = ask_cost()
    print("\none engine ask (median of 50): " + ", ".join(f"{k} {v:.2f} ms" for k, v in asks.items()))
    print(f"\ncached `Tuned.lookup`: {client['median_us']:.2f} µs median of 7 rounds "
          f"({client['min_us']:.2f}-{client['max_us']:.2f})")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/service-*.result.jsonl

    with recorded("service", runs="median of three 10 s rounds (min-max) (--seconds)"):
        main()
