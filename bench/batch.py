"""Benchmark: do large batch look-ups starve other requests?  On a real `cmtune serve` (SQLite).

    python bench/batch.py                      # 4 clients of batches of the API's maximum
    python bench/batch.py --clients 4 --size 1000 --rounds 3 --seconds 8

A prober sends small requests one after another (``GET /v1/configs`` of a tuned problem and
``GET /v1/studies``) and records each latency.  Rounds alternate: the prober alone ("idle"),
then the prober while ``--clients`` threads each post batches of ``--size`` look-ups of shapes
never asked before (the costly case: each asks for the cost model's choice) in a closed loop
("loaded").  Prints, per round pair, the prober's median and p90 latency idle and loaded, their
ratio, and the batches answered; then the medians over the pairs.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

HARDWARE = {"platform": "cpu", "device_kind": "cpu", "device_count": 8, "process_count": 1}
TUNED = {"collective": "allgather_matmul", "m": 1024, "k": 1024, "n": 1024, "dtype": "bfloat16", "axis_size": 8}


def prepare(url: str) -> str:
    from cmtune.service import migrate
    from cmtune.service.db import Database
    from cmtune.service.models import TokenRole
    from cmtune.service.store import SqlStore
    from collective_matmul import Decomposition, Hardware, Problem
    from collective_matmul.wire.bundle import TunedConfig

    db = Database(url)
    migrate.upgrade(db.engine)
    with SqlStore(db).write() as tx:
        _, token = tx.tokens.add(name="bench", role=TokenRole.READER)
        tx.save_tuned(TunedConfig(problem=Problem(**TUNED), hardware=Hardware(**HARDWARE), time_s=1e-3,
                                  baseline_s=1.2e-3, speedup=1.2,
                                  decomposition=Decomposition(direction="bidirectional", chunks=2)), study_id=None)
    db.dispose()
    return token


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def probe(url: str, headers: dict, seconds: float) -> list[float]:
    params = {**TUNED, "platform": "cpu", "device_kind": "cpu"}
    latencies = []
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        end = time.perf_counter() + seconds
        for path in itertools.cycle(["/v1/configs", "/v1/studies"]):
            if time.perf_counter() > end:
                break
            start = time.perf_counter()
            response = client.get(path, params=params if path == "/v1/configs" else None)
            latencies.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text
            time.sleep(0.02)
    return latencies


def load(url: str, headers: dict, size: int, stop: threading.Event, counter: list, seed: int) -> None:
    shapes = (divmod(c, 4096) for c in itertools.count())  # (m, n) pairs never asked before
    with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
        while not stop.is_set():
            queries = [{"problem": {"collective": "matmul_reduce_scatter", "m": 8 * (1 + m), "k": 8 * (1 + seed),
                                    "n": 8 * (1 + n), "dtype": "float32", "axis_size": 8},
                        "platform": "cpu", "device_kind": "cpu"} for m, n in itertools.islice(shapes, size)]
            response = client.post("/v1/configs/query", json={"queries": queries}, params={"unmeasured": "costmodel"})
            assert response.status_code == 200, response.text[:300]
            counter.append(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--size", type=int, default=None, help="look-ups per batch (default: the API's maximum)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    from cmtune.launcher import running_server
    from collective_matmul.wire import ConfigQueryBatch

    size = args.size or ConfigQueryBatch.model_fields["queries"].metadata[0].max_length
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/batch.sqlite"
        token = prepare(url)
        headers = {"Authorization": f"Bearer {token}"}
        with running_server(database_url=url) as server:
            probe(server.url, headers, 1.0)  # warm up
            rows = []
            for r in range(args.rounds):
                idle = probe(server.url, headers, args.seconds)
                stop, counter = threading.Event(), []
                threads = [threading.Thread(target=load, args=(server.url, headers, size, stop, counter, r * 100 + i))
                           for i in range(args.clients)]
                for t in threads:
                    t.start()
                time.sleep(0.5)  # the batches are in flight
                loaded = probe(server.url, headers, args.seconds)
                stop.set()
                for t in threads:
                    t.join()
                row = (statistics.median(idle), percentile(idle, 0.9), statistics.median(loaded),
                       percentile(loaded, 0.9), len(counter))
                rows.append(row)
                print(f"round {r + 1}: idle median {row[0] * 1e3:.1f} ms p90 {row[1] * 1e3:.1f} ms | loaded median "
                      f"{row[2] * 1e3:.1f} ms p90 {row[3] * 1e3:.1f} ms | x{row[2] / row[0]:.1f} median, "
                      f"x{row[3] / row[1]:.1f} p90 | {row[4]} batches of {size} answered", flush=True)
    factors = [row[2] / row[0] for row in rows]
    loaded, p90 = statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows)
    print(f"{args.clients} clients x {size} look-ups: loaded/idle median latency x{statistics.median(factors):.1f} "
          f"(rounds: {', '.join(f'{f:.1f}' for f in factors)}); loaded median {loaded * 1e3:.1f} ms, "
          f"p90 {p90 * 1e3:.1f} ms")
    idle = statistics.median(r[0] for r in rows)
    batches = sorted(r[4] for r in rows)
    print("\n| `cmtune serve` | prober alone: median | loaded: median (p90) | loaded / alone, per round "
          "| batches answered per round |\n|---|---|---|---|---|")
    print(f"| {args.clients} clients x {size} look-ups | {idle * 1e3:.1f} ms | {loaded * 1e3:.1f} ms ({p90 * 1e3:.1f}) "
          f"| {', '.join(f'{f:.1f}' for f in factors)} | {batches[0]}-{batches[-1]} |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import recorded  # bench/results.py: rewrites bench/results/service-*.result.jsonl

    with recorded("service", runs="rounds alternating the prober alone and loaded (--rounds, --seconds per phase)"):
        main()
