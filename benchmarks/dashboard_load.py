"""Load benchmark: concurrent requests to a job page's JSON endpoints while the job writes.

    batchgen bench dashboard-load [--concurrency 50] [--rounds 2] [--requests 2] [--shards 40]

Builds a temporary data dir with a job of `--shards` committed shards (and their iterations), starts
a writer process that keeps adding shards to it (outputs, request timings, iterations, a commit
every `--write-every` seconds), and serves it with two `batchgen dashboard` processes (waitress):
one with the page cache off (the "before") and one with it on. Rounds alternate between them (off,
on, off, on, ...); in each, `--concurrency` clients each send `--requests` GETs spread over the job
page's JSON endpoints at once. Prints p50 / p99 / max latency and errors per server, the single-
request latency of each, and the load average beside them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

JOB = "load-job"
WORKER = "load-worker"
ROWS_PER_SHARD = 50
NO_AUTO_FLUSH_S = 3600.0  # iterations are flushed once per shard (one part), as a worker's buffer does
ENDPOINTS = ("/api/jobs/{job}", "/api/jobs/{job}/iterations", "/api/jobs/{job}/throughput",
             "/api/jobs/{job}/latency", "/api/jobs/{job}/outputs")


def write_shard(store, shard_id: int, telemetry, now: float) -> None:
    """One shard as a worker writes it: outputs, request timings, iterations, commit."""
    from engine.stats import IterationStats, RequestStats

    attempt = store.begin_attempt(JOB, shard_id, 1, WORKER, num_requests=ROWS_PER_SHARD)
    outputs, timings = [], []
    for i in range(ROWS_PER_SHARD):
        rid = str(shard_id * ROWS_PER_SHARD + i)
        outputs.append({"request_id": rid, "output_text": "x" * 40, "finish_reason": "length",
                        "prompt_tokens": 20, "output_tokens": 40, "error": None})
        stats = RequestStats(now - 3.0, now - 2.5 + i * 0.01, now - 2.0 + i * 0.01, now, i % 2, 20, 40)
        timings.append({"request_id": rid, "finish_reason": "length", **stats.as_row()})
        telemetry.append(IterationStats(iteration=shard_id * ROWS_PER_SHARD + i, ts=now - 1 + i * 0.01,
                                        duration_s=0.01, num_running=8, num_waiting=4, decode_tokens=8,
                                        scheduled_tokens=24, token_budget=256, max_num_seqs=16,
                                        kv_blocks_used=40, kv_blocks_total=512, job_ids=[JOB]))
    attempt.add_outputs(outputs)
    attempt.add_requests(timings)
    telemetry.flush()
    attempt.commit()


def seed(data_dir: str, shards: int, total_shards: int) -> None:
    from jobs.store.compact import compact_group, compact_job
    from jobs.store.parts import Store
    from jobs.store.schemas import JobRecord, ShardEvent

    store = Store(data_dir)
    t0 = time.time() - 600
    store.record_job(JobRecord(JOB, "tiny-random", total_shards * ROWS_PER_SHARD, total_shards, t0))
    store.record_shard_events([ShardEvent(JOB, s, "queued", t0) for s in range(total_shards)])
    with store.telemetry_buffer(WORKER, flush_interval_s=NO_AUTO_FLUSH_S) as telemetry:
        for shard_id in range(shards):
            write_shard(store, shard_id, telemetry, t0 + shard_id)
    compact_job(data_dir, JOB, force=True)
    compact_group(store.layout, "iterations", WORKER)


def writer(data_dir: str, first_shard: int, total_shards: int, every_s: float, stop_file: str) -> None:
    """Child process: a new committed shard every `every_s` seconds until `stop_file` exists."""
    from jobs.store.parts import Store

    store = Store(data_dir)
    with store.telemetry_buffer(WORKER, flush_interval_s=NO_AUTO_FLUSH_S) as telemetry:
        for shard_id in range(first_shard, total_shards):
            if os.path.exists(stop_file):
                return
            write_shard(store, shard_id, telemetry, time.time())
            time.sleep(every_s)


def serve(data_dir: str, cache_entries: int, threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "jobs.cli", "dashboard", "--data-dir", data_dir, "--port", "0",
           "--threads", str(threads), "--page-cache-entries", str(cache_entries)]
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_DASHBOARD_TOKEN"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line = proc.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:\d+", line)
    if found is None:
        proc.kill()
        raise SystemExit(f"dashboard did not start: {line}{proc.stdout.read()}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain its log
    return proc, found.group(0)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)
    proc.stdout.close()


def fetch(url: str, timeout_s: float) -> tuple[float, str | None]:
    """(seconds, error or None) of one GET."""
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            response.read()
            error = None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        exc.close()
        error = f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        error = type(exc).__name__
    return time.perf_counter() - start, error


def burst(base: str, concurrency: int, requests: int, timeout_s: float) -> list[tuple[float, str | None]]:
    """`concurrency` clients at once, each sending `requests` GETs over the endpoints."""
    urls = [base + e.format(job=JOB) for e in ENDPOINTS]
    results: list[tuple[float, str | None]] = []
    lock, start = threading.Lock(), threading.Barrier(concurrency)

    def client(i: int) -> None:
        start.wait()
        for k in range(requests):
            outcome = fetch(urls[(i + k) % len(urls)], timeout_s)
            with lock:
                results.append(outcome)

    workers = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return results


def summarize(name: str, results: list[tuple[float, str | None]]) -> str:
    times = sorted(t for t, _ in results)
    errors = [e for _, e in results if e]
    p = statistics.quantiles(times, n=100, method="inclusive") if len(times) > 1 else times * 99
    kinds = ", ".join(sorted(set(errors)))
    return (f"{name:<10} {len(times):>5} {len(errors):>6}  {p[49]:7.2f} {p[98]:7.2f} {times[-1]:7.2f}"
            + (f"  ({kinds})" if kinds else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="batchgen bench dashboard-load",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per server, alternating")
    parser.add_argument("--requests", type=int, default=2, help="GETs per client per round")
    parser.add_argument("--shards", type=int, default=40, help="committed shards before the writer starts")
    parser.add_argument("--write-every", type=float, default=1.0, help="seconds between the writer's shards")
    parser.add_argument("--threads", type=int, default=8, help="waitress threads of each server")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a request is an error")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="batchgen-loadbench-") as tmp:
        data_dir, stop_file = str(Path(tmp) / "data"), str(Path(tmp) / "stop")
        total = args.shards + 1000  # more than the writer gets through
        seed(data_dir, args.shards, total)
        servers = {"cache off": serve(data_dir, 0, args.threads),
                   "cache on": serve(data_dir, 256, args.threads)}
        ctx = multiprocessing.get_context("spawn")
        writing = ctx.Process(target=writer, args=(data_dir, args.shards, total, args.write_every, stop_file))
        writing.start()
        try:
            print(f"load average before: {os.getloadavg()}")
            single = {name: [fetch(base + ENDPOINTS[0].format(job=JOB), args.timeout)[0] for _ in range(5)]
                      for name, (_, base) in servers.items()}
            results: dict[str, list] = {name: [] for name in servers}
            for r in range(args.rounds):
                for name, (_, base) in servers.items():
                    results[name] += burst(base, args.concurrency, args.requests, args.timeout)
                    print(f"round {r + 1} {name}: done, load average {os.getloadavg()}", flush=True)
        finally:
            Path(stop_file).touch()
            writing.join(30)
            for proc, _ in servers.values():
                stop(proc)
        print(f"\n{args.concurrency} concurrent clients x {args.requests} GETs x {args.rounds} rounds over "
              f"{len(ENDPOINTS)} JSON endpoints, writer adding a shard every {args.write_every} s")
        print(f"{'server':<10} {'reqs':>5} {'errors':>6}  {'p50 s':>7} {'p99 s':>7} {'max s':>7}")
        for name, found in results.items():
            print(summarize(name, found))
        for name, times in single.items():
            print(f"single request ({name}): median {statistics.median(times):.2f} s")
        print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
