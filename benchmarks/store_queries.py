"""Benchmark of the dashboard queries over a synthetic job: `batchgen bench store`.

Writes, through the same `Store` API the workers use, one job of `--requests` requests in
`--shards` shards (each attempt flushing its rows in several parts; a few shards failing once and
being retried) and `--iterations` iteration rows from `--workers` engines in parts of ~40 rows (one
part per 2 s at 20 steps/s). Then it times every query in `queries.QUERIES` (p50 / p95 over
`--runs` runs) three times: over the raw parts, after compaction (once the compacted files count)
while the merged parts still exist (the grace period), and after garbage collection. Prints a
table; `--json` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from engine.stats import IterationStats, RequestStats
from jobs.store import catalog
from jobs.store.catalog import connect
from jobs.store.compact import collect_garbage, compact
from jobs.store.parts import Store
from jobs.store.queries import QUERIES, run_named
from jobs.store.schemas import JobRecord, ShardEvent

JOB_ID = "bench-job"
TOPICS = ("math", "code", "chat", "summarise", "translate")


def synthesize(data_dir: Path, *, requests: int, shards: int, iterations: int, workers: int,
               rows_per_part: int = 250, seed: int = 0) -> dict:
    """Write the synthetic job; returns counts of what was written."""
    rng = random.Random(seed)
    store = Store(data_dir)
    t0 = time.time() - 3600.0
    store.record_job(JobRecord(JOB_ID, "smollm2-135m", requests, shards, t0, '{"max_tokens": 128}'))
    per_shard = requests // shards
    store.record_shard_events([ShardEvent(JOB_ID, s, "queued", t0, num_requests=per_shard)
                               for s in range(shards)])
    for shard in range(shards):
        if shard % 20 == 7:  # a killed attempt: rows written, never committed
            _write_attempt(store, rng, shard, 1, per_shard, t0, rows_per_part, commit=False)
            _write_attempt(store, rng, shard, 2, per_shard, t0, rows_per_part, commit=True)
        else:
            _write_attempt(store, rng, shard, 1, per_shard, t0, rows_per_part, commit=True)
    _write_iterations(store, rng, iterations, workers, t0)
    return {"requests": per_shard * shards, "iterations": iterations - iterations % workers}


def _write_attempt(store: Store, rng: random.Random, shard: int, attempt: int, n: int, t0: float,
                   rows_per_part: int, *, commit: bool) -> None:
    att = store.begin_attempt(JOB_ID, shard, attempt, f"worker-{shard % 8}", num_requests=n)
    for start in range(0, n, rows_per_part):
        outputs, timings = [], []
        for i in range(start, min(start + rows_per_part, n)):
            request_id = str(shard * n + i)
            prompt, out = rng.randint(20, 600), rng.randint(1, 256)
            outputs.append({"request_id": request_id, "output_text": "tok " * min(out, 40),
                            "finish_reason": rng.choice(("stop", "length")), "prompt_tokens": prompt,
                            "output_tokens": out, "error": None, "topic": rng.choice(TOPICS)})
            arrival = t0 + rng.uniform(0, 3000)
            first = arrival + rng.expovariate(2.0)
            stats = RequestStats(arrival, arrival + rng.uniform(0, 0.2), first,
                                 first + out * rng.uniform(0.01, 0.05), 0, prompt, out)
            timings.append({"request_id": request_id, "finish_reason": outputs[-1]["finish_reason"],
                            **stats.as_row()})
        att.add_outputs(outputs)
        att.add_requests(timings)
        att.flush()
    att.commit() if commit else None


def _write_iterations(store: Store, rng: random.Random, iterations: int, workers: int, t0: float) -> None:
    per_worker = iterations // workers
    for w in range(workers):
        buf = store.telemetry_buffer(f"worker-{w}", flush_interval_s=1e9)
        buf.max_rows = 40
        for it in range(per_worker):
            decode = rng.randint(0, 64)
            prefill = rng.choice((0, 0, rng.randint(1, 2048 - decode)))
            buf.append(IterationStats(
                f"worker-{w}", it, t0 + it * 0.05, 0.05, min(decode + 4, 64), rng.randint(0, 500),
                decode + (prefill > 0), int(prefill > 0), decode, prefill, decode, prefill + decode, 2048, 64,
                rng.randint(100, 4000), 4096, int(rng.random() < 0.01), rng.randint(0, 3), 0, [JOB_ID]))
        buf.close()


def time_queries(data_dir: Path, runs: int) -> dict[str, dict[str, float]]:
    """p50 / p95 milliseconds of each named query (a fresh connection per phase, as the dashboard)."""
    con = connect(data_dir)
    results = {}
    try:
        for name, sql in QUERIES.items():
            params = {"job_id": JOB_ID} if "$job_id" in sql else {}
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                run_named(con, name, timeout_s=120, **params)
                times.append((time.perf_counter() - start) * 1000)
            results[name] = {"p50_ms": statistics.median(times), "p95_ms": _p95(times)}
    finally:
        con.close()
    return results


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def count_files(data_dir: Path) -> int:
    return sum(1 for _ in (data_dir / "store" / "tables").rglob("*.parquet"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="batchgen bench store", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--iterations", type=int, default=50_000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=20, help="timed runs per query after compaction")
    parser.add_argument("--runs-before", type=int, default=5, help="timed runs per query over raw parts")
    parser.add_argument("--data-dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        report = run(data_dir, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def run(data_dir: Path, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    written = synthesize(data_dir, requests=args.requests, shards=args.shards,
                         iterations=args.iterations, workers=args.workers)
    report: dict = {"written": written, "synthesize_s": time.perf_counter() - start, "phases": {}}
    print(f"wrote {written} in {report['synthesize_s']:.1f} s: {count_files(data_dir)} files")
    report["phases"]["raw parts"] = _phase(data_dir, args.runs_before)
    start = time.perf_counter()
    compacted = compact(data_dir, grace_s=GRACE_FOR_BENCH, min_age_s=0)
    report["compact_s"] = time.perf_counter() - start
    print(f"compacted {compacted.groups} groups ({compacted.files_in} files, {compacted.rows} rows) "
          f"in {report['compact_s']:.1f} s")
    time.sleep(catalog.ACTIVATION_DELAY_S + catalog.clock_skew_s())  # until the compacted files count
    report["phases"]["compacted, inputs kept (grace)"] = _phase(data_dir, args.runs)
    deleted = collect_garbage(data_dir, grace_s=0)
    print(f"garbage collection removed {deleted} files")
    report["phases"]["compacted, after gc"] = _phase(data_dir, args.runs)
    _print(report)
    return report


GRACE_FOR_BENCH = 3600.0


def _phase(data_dir: Path, runs: int) -> dict:
    return {"files": count_files(data_dir), "runs": runs, "queries": time_queries(data_dir, runs)}


def _print(report: dict) -> None:
    phases = list(report["phases"])
    header = f"{'query':28}" + "".join(f" | {p[:30]:>30}" for p in phases)
    print(header)
    print(f"{'':28}" + "".join(f" | {'files ' + str(report['phases'][p]['files']):>30}" for p in phases))
    print("-" * len(header))
    for name in QUERIES:
        cells = []
        for p in phases:
            q = report["phases"][p]["queries"][name]
            cell = f"p50 {q['p50_ms']:7.1f}  p95 {q['p95_ms']:7.1f} ms"
            cells.append(f" | {cell:>30}")
        print(f"{name:28}" + "".join(cells))


if __name__ == "__main__":
    main()
