"""The store while a large job runs: every dashboard query and `status`, timed as the job's parts land.

    python -m benchmarks.store_live --requests 10000000 [--lever none|compact] [--json out.json]

A writer process writes one job's parts through the same `Store` API a fleet of workers uses, shard
after shard in input order: per shard attempt its `running` event, its output and request-timing rows
in `--flushes` parts each (a worker flushes every 10 s), then its commit; every worker's engine
iterations in parts of 40 rows (a worker's telemetry buffer), `--steps-per-shard` steps per shard.
Shards land as fast as the writer can write them (on a shared 2-core machine that is already
faster than a fleet of a few GPU workers finishes them: the worst case for the reader), or at
`--requests-per-s`. One shard in 50 has a killed first attempt (rows written, never committed).

Meanwhile the main process runs, in a loop, every query the dashboard's pages run (dashboard.queries,
with the parameters dashboard.data / dashboard.series pass) and `batchgen status` (all jobs, and one
job), each on a fresh cursor of one connection as the dashboard does, and records its time against
the job's progress. The report gives p50 / p95 / max per query per tenth of the job, and overall.

`--lever writers` (the default: the store as it ships) has the writers merge their groups' raw parts
as they commit (jobs.store.compact.compact_written) and runs the janitor's compaction
(jobs.store.compact.compact: running jobs too) every `--compact-every-s` in a third process during
the job, as a worker's janitor would; `--lever compact` the janitor's alone (writers' compaction
off); `--lever telemetry` only what the janitor compacted before (telemetry, then garbage); `--lever
none` nothing. `--max-s` stops the writer after that long (a 10M-request job takes hours to write
here). `--start-at F` first writes the job's first F of shards (two writers at once, untimed) and
compacts them as the janitor would have, so the timed part is the middle or the end of a job (the
writer takes hours to write a 10M-request job from the start). `--finished-jobs K` first writes K
finished jobs of `--finished-requests` each (compacted, as the janitor leaves them): a data dir that
has served other jobs. `--prefill-cache DIR` keeps the data dir as it is before the timing and starts
the next run with the same parameters from a copy (compare two trees from one store).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from engine.stats import IterationStats, RequestStats

JOB_ID = "live-job"
TOPICS = ("math", "code", "chat", "summarise", "translate")
MAX_POINTS = 600  # the dashboard's MAX_POINTS default (series bucketed in SQL)


# ---------------------------------------------------------------- the job and its writer


def make_job(data_dir: Path, requests: int, shard_size: int, job_id: str = JOB_ID) -> None:
    """The job as `batchgen submit` leaves it: manifest (no shard files: nothing here reads them), job
    record, a `queued` event per shard."""
    from jobs.broker import resolve_broker
    from jobs.manifest import JobManifest, JobPaths, RegularShards, write_manifest
    from jobs.store import Store
    from jobs.submit import QUEUED_EVENTS_PER_PART, job_record

    paths = JobPaths.of(data_dir, job_id)
    broker = resolve_broker(str(data_dir), embedded=True)
    manifest = JobManifest(job_id, str(Path(data_dir).resolve()), [], requests, shard_size,
                           RegularShards(paths, requests, shard_size), {"model": "smollm2-135m"}, {},
                           broker.queue, broker.display_url, 3, 5.0, ["topic"], time.time())
    write_manifest(manifest, paths)
    store = Store(data_dir)
    store.record_job(job_record(manifest))
    from jobs.store import ShardEvent

    shards = manifest.shards
    for start in range(0, len(shards), QUEUED_EVENTS_PER_PART):
        store.record_shard_events([ShardEvent(job_id, s.shard_id, "queued", time.time(),
                                              num_requests=s.num_requests)
                                   for s in shards[start:start + QUEUED_EVENTS_PER_PART]])


def writer(data_dir: str, requests: int, shard_size: int, workers: int, flushes: int, steps_per_shard: int,
           requests_per_s: float, max_s: float, done, stop, compact_as_written: bool = False,
           job_id: str = JOB_ID, shards: tuple[int, int] | None = None) -> None:
    """Write the job's shards in order (see the module docstring), for at most `max_s` seconds (0: no
    limit); `done` counts committed requests. `compact_as_written`: the writers compact as they write.
    `shards`: only shards [first, end) (default all), as the fleet writes them from the first on: each
    worker's steps go on from the shards before."""
    from jobs.store import Store

    num_shards = -(-requests // shard_size)
    first, end = shards or (0, num_shards)
    rng = random.Random(first)
    store = Store(data_dir, compact_as_written=compact_as_written)
    telemetry = [store.telemetry_buffer(f"worker-{w:02d}", flush_interval_s=1e9) for w in range(workers)]
    for buf in telemetry:
        buf.max_rows = 40
    steps = [steps_per_shard * len(range(w, first, workers)) for w in range(workers)]
    start = time.time()
    for shard in range(first, end):
        if stop.is_set() or (max_s and time.time() - start > max_s):
            break
        n = min(shard_size, requests - shard * shard_size)
        w = shard % workers
        if shard % 50 == 17:
            _attempt(store, rng, shard, 1, n, shard_size, w, flushes, commit=False, job_id=job_id)
        _attempt(store, rng, shard, 2 if shard % 50 == 17 else 1, n, shard_size, w, flushes, commit=True,
                 job_id=job_id)
        for _ in range(steps_per_shard):
            decode = rng.randint(1, 64)
            buf = telemetry[w]
            buf.append(IterationStats(
                f"worker-{w:02d}", steps[w], time.time(), 0.05, min(decode + 4, 64), rng.randint(0, 500),
                decode, 0, decode, 0, decode, decode, 2048, 64, rng.randint(100, 4000), 4096,
                int(rng.random() < 0.01), 0, 0, [job_id]))
            steps[w] += 1
        with done.get_lock():
            done.value += n
        if requests_per_s:
            ahead = (shard + 1 - first) * shard_size / requests_per_s - (time.time() - start)
            if ahead > 0:
                time.sleep(ahead)
    for buf in telemetry:
        buf.close()


def _attempt(store, rng: random.Random, shard: int, attempt: int, n: int, shard_size: int, w: int,
             flushes: int, *, commit: bool, job_id: str = JOB_ID) -> None:
    att = store.begin_attempt(job_id, shard, attempt, f"worker-{w:02d}", num_requests=n,
                              flush_interval_s=1e9)
    now = time.time()
    per_flush = -(-n // flushes)
    for lo in range(0, n, per_flush):
        outputs, timings = [], []
        for i in range(lo, min(lo + per_flush, n)):
            request_id = str(shard * shard_size + i)
            prompt, out = rng.randint(20, 600), rng.randint(1, 256)
            reason = "stop" if rng.random() < 0.7 else "length"
            outputs.append({"request_id": request_id, "output_text": "tok " * min(out, 40),
                            "finish_reason": reason, "prompt_tokens": prompt, "output_tokens": out,
                            "error": None,
                            "topic": TOPICS[i % len(TOPICS)]})
            arrival = now - rng.uniform(5, 60)
            first = arrival + rng.expovariate(2.0)
            stats = RequestStats(arrival, arrival + rng.uniform(0, 0.2), first,
                                 first + out * rng.uniform(0.01, 0.05), 0, prompt, out)
            timings.append({"request_id": request_id, "finish_reason": reason, **stats.as_row()})
        att.add_outputs(outputs)
        att.add_requests(timings)
        att.flush()
    if commit:
        att.commit()


def prefill(data_dir: Path, args: argparse.Namespace, end_shard: int, processes: int = 2,
            chunk: int = 1024) -> float:
    """The job's shards [0, end_shard) as the fleet and the janitor would have left them: written by
    `processes` writers at once (as fast as they can, not timed), `chunk` shards at a time, each chunk's
    parts then merged as the janitor's passes merge a running job's; the merges' inputs collected at the
    end. Returns the seconds it took."""
    from jobs.store.catalog import ACTIVATION_DELAY_S, clock_skew_s
    from jobs.store.compact import collect_garbage, compact_live_job, compact_telemetry

    t = time.time()
    ctx = mp.get_context("spawn")
    done, stop = ctx.Value("q", 0), ctx.Event()
    writing = 0.0
    for lo in range(0, end_shard, chunk):
        hi = min(end_shard, lo + chunk)
        bounds = [lo + (hi - lo) * k // processes for k in range(processes + 1)]
        procs = [ctx.Process(target=writer, args=(str(data_dir), args.requests, args.shard_size, args.workers,
                                                  args.flushes, args.steps_per_shard, 0.0, 0.0, done, stop,
                                                  False, JOB_ID, (a, b)))
                 for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
        w = time.time()
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"a prefill writer failed (exit code {p.exitcode})")
        writing += time.time() - w
        compact_live_job(data_dir, JOB_ID, min_age_s=0.0, min_parts=2)
        compact_telemetry(data_dir, min_age_s=0.0)
        print(f"  prefill: {done.value:,} requests in {time.time() - t:.0f} s", flush=True)
    time.sleep(ACTIVATION_DELAY_S + clock_skew_s())  # the earliest the merges' inputs may go
    collect_garbage(data_dir, grace_s=0.0)
    print(f"prefilled {done.value:,} requests ({end_shard:,} shards) in {time.time() - t:.0f} s "
          f"({writing:.0f} s writing, the rest compacting)", flush=True)
    return time.time() - t


def compactor(data_dir: str, lever: str, every_s: float, min_age_s: float, stop) -> None:
    """The janitor's compaction every `every_s`: `compact` (finished jobs, running ones, telemetry,
    garbage), or `telemetry` (telemetry and garbage only: what the janitor did before running jobs
    were compacted)."""
    from jobs.store.compact import collect_garbage, compact, compact_telemetry

    while not stop.wait(every_s):
        if lever in ("compact", "writers"):
            compact(data_dir, min_age_s=min_age_s)
        else:
            compact_telemetry(data_dir, min_age_s=min_age_s)
            collect_garbage(data_dir)


# ---------------------------------------------------------------- the reader


def dashboard_queries() -> dict[str, tuple]:
    """name -> (SQL, parameters): every query the dashboard's pages and /metrics run for this job. The
    SQL is a pair (rows, samples by level) where dashboard.series.request_source picks one, or a
    function of (run, parameters) where a figure takes several queries."""
    from dashboard import queries as q
    from dashboard.data import MAX_JOBS, MAX_WORKERS, RECENT_WINDOW_S, SHARDS_PER_PAGE
    from dashboard.series import HISTOGRAM_BINS, OUTPUT_RATE_BUCKETS

    job = {"job_id": JOB_ID}
    now = time.time()
    points = [now - 60 + i * 60 / MAX_POINTS for i in range(MAX_POINTS)]
    return {
        "jobs_summary": (q.JOBS_SUMMARY, {"limit": MAX_JOBS}),
        "job_summary": (q.JOB_SUMMARY, {**job, "limit": 1}),
        "job_shard_counts": (q.JOB_SHARD_COUNTS, job),
        "job_shards_page": (q.JOB_SHARDS_PAGE, {**job, "status": None, "limit": SHARDS_PER_PAGE,
                                                "offset": 0}),
        "job_shard_workers": (q.JOB_SHARD_WORKERS, {**job, "limit": MAX_WORKERS}),
        "job_outputs_sample": (_outputs_sample, {**job, "limit": 20}),
        "job_iterations": (_iterations, {**job, "max_points": MAX_POINTS}),
        # the form that JOB_REQUEST_DIGESTS picks (dashboard.series.request_source), asked once a round
        "job_outstanding_at": ((q.JOB_OUTSTANDING_AT, q.JOB_OUTSTANDING_AT_SAMPLED),
                               {**job, "points": points}),
        "job_output_rate": ((q.JOB_OUTPUT_RATE, q.JOB_OUTPUT_RATE_SAMPLED),
                            {**job, "n": OUTPUT_RATE_BUCKETS}),
        "job_latency": ((q.JOB_LATENCY, q.JOB_LATENCY_SAMPLED), {**job, "bins": HISTOGRAM_BINS}),
        "job_preemptions": ((q.JOB_PREEMPTIONS, None), job),
        "workers": (q.WORKERS, {"now": now, "window_s": RECENT_WINDOW_S}),
        "worker_shards": (q.WORKER_SHARDS, {}),
        "worker_latest_job": (q.WORKER_LATEST_JOB, {}),
        "metrics_job_status_counts": (q.JOB_STATUS_COUNTS, {}),
        "metrics_shard_status_counts": (q.SHARD_STATUS_COUNTS, {}),
        "metrics_rows_committed": (q.ROWS_COMMITTED, {}),
        "metrics_job_shard_status_counts": (q.JOB_SHARD_STATUS_COUNTS, {"job_ids": [JOB_ID]}),
    }


def _iterations(run, params: dict) -> None:
    """The job page's iteration chart as dashboard.series.job_iterations asks it: the rollups, then the
    rows where the rollups do not serve."""
    from dashboard.series import iteration_series

    iteration_series(lambda sql, p: run(sql, p, columns=True), params["job_id"], params["max_points"])


def _outputs_sample(run, params: dict) -> None:
    """The job page's sample of outputs as dashboard.data.job_outputs_sample runs it: its shards, then
    their rows."""
    from dashboard.queries import JOB_OUTPUTS_SAMPLE, JOB_SAMPLE_SHARDS

    (lo, hi), = run(JOB_SAMPLE_SHARDS, params)
    if lo is not None:
        run(JOB_OUTPUTS_SAMPLE, {**params, "lo": lo, "hi": hi})


def time_round(con, data_dir: str, manifest, queries: dict, timeout_s: float) -> dict[str, float]:
    """One run of every query (interrupted past `timeout_s`, as the dashboard's are: it then counts as
    `timeout_s`) and of `status`: name -> milliseconds."""
    from dashboard.queries import JOB_PREEMPTIONS_SCAN, JOB_REQUEST_DIGESTS, job_scope
    from dashboard.series import RequestSource
    from jobs.status import job_status, jobs_status
    from jobs.store import QueryTimeout, UserSqlError, run_query, source_level

    def run(sql: str, params: dict | None, columns: bool = False):  # as dashboard.db.run (fetch_columns)
        cur = con.cursor()
        try:
            result = run_query(cur, sql, params or None, timeout_s=timeout_s, max_rows=200_000,
                               job_id=job_scope(sql, params))
        finally:
            cur.close()
        if columns:
            return {name: [row[i] for row in result.rows] for i, name in enumerate(result.columns)}
        return result.rows

    out = {}
    # the page's figures over requests ask which form to read once (dashboard.series.request_source,
    # kept SOURCE_TTL_S): timed on its own, once a round
    t = time.perf_counter()
    try:
        (rows, undigested), = run(JOB_REQUEST_DIGESTS, {"job_id": JOB_ID})
        out["job_request_digests"] = (time.perf_counter() - t) * 1000
    except (QueryTimeout, UserSqlError) as exc:
        print(f"job_request_digests failed: {exc}", flush=True)
        (rows, undigested), out["job_request_digests"] = (0, 1), timeout_s * 1000
    source = RequestSource(rows, source_level(rows, undigested), not undigested)
    for name, (sql, params) in queries.items():
        t = time.perf_counter()
        try:
            if callable(sql):  # a page's figure in several queries
                sql(run, params)
                out[name] = (time.perf_counter() - t) * 1000
                continue
            if isinstance(sql, tuple):  # the rows or the sample, as request_source picked
                exact, sampled = sql
                if sampled is None:  # preemptions: the digests' sums unless commits have none
                    sql = exact if source.digested else JOB_PREEMPTIONS_SCAN
                else:
                    sql = source.pick(exact, sampled)
            run(sql, params)
            out[name] = (time.perf_counter() - t) * 1000
        except QueryTimeout:
            out[name] = timeout_s * 1000
        except UserSqlError as exc:  # failed even when run again (a part deleted under it each time)
            print(f"{name} failed: {exc}", flush=True)
            out[name] = timeout_s * 1000
    for name, run_status in (("status_all_jobs", lambda: jobs_status(data_dir)),
                             ("status_one_job", lambda: job_status(manifest, all_shards=False))):
        t = time.perf_counter()
        try:
            run_status()
            out[name] = (time.perf_counter() - t) * 1000
        except Exception as exc:  # noqa: BLE001 -- a part deleted under it (the CLI says so and exits 1)
            print(f"{name} failed: {exc}", flush=True)
            out[name] = timeout_s * 1000
    return out


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def setup(args: argparse.Namespace, data_dir: Path, first: int) -> None:
    """The data dir before the timing: `--finished-jobs`, the job, its first `first` shards."""
    for k in range(args.finished_jobs):  # earlier jobs in the data dir, written and compacted
        job_id = f"finished-{k:02d}"
        make_job(data_dir, args.finished_requests, args.shard_size, job_id)
        ctx = mp.get_context("spawn")
        writer(str(data_dir), args.finished_requests, args.shard_size, args.workers, args.flushes,
               args.steps_per_shard, 0.0, 0.0, ctx.Value("q", 0), ctx.Event(), True, job_id)
    if args.finished_jobs:
        from jobs.store import collect_garbage, compact

        compact(data_dir, min_age_s=0.0)
        collect_garbage(data_dir, grace_s=0.0)
        print(f"{args.finished_jobs} finished jobs of {args.finished_requests:,} requests written and "
              "compacted", flush=True)
    make_job(data_dir, args.requests, args.shard_size)
    if first:
        prefill(data_dir, args, first)


def run(args: argparse.Namespace, data_dir: Path) -> dict:
    from jobs.manifest import load_manifest
    from jobs.store import connect

    num_shards = -(-args.requests // args.shard_size)
    first = min(num_shards, round(args.start_at * num_shards))
    cached = None
    if args.prefill_cache:  # the same data dir before the timing, kept to compare trees from one start
        key = (f"{args.requests}r-{args.shard_size}s-{args.workers}w-{args.flushes}f-{args.steps_per_shard}i-"
               f"{first}first-{args.finished_jobs}x{args.finished_requests}")
        cached = args.prefill_cache / key
    if cached is not None and cached.is_dir():
        shutil.copytree(cached, data_dir, dirs_exist_ok=True)
        print(f"data dir copied from {cached}", flush=True)
    else:
        setup(args, data_dir, first)
        if cached is not None:
            shutil.copytree(data_dir, cached.with_name(cached.name + ".tmp"), dirs_exist_ok=True)
            os.replace(cached.with_name(cached.name + ".tmp"), cached)
    manifest = load_manifest(data_dir, JOB_ID)
    ctx = mp.get_context("spawn")
    done, stop = ctx.Value("q", 0), ctx.Event()  # stop: the compactor's (and an interrupted writer's)
    done.value = min(args.requests, first * args.shard_size)
    procs = [ctx.Process(target=writer, args=(str(data_dir), args.requests, args.shard_size, args.workers,
                                              args.flushes, args.steps_per_shard, args.requests_per_s,
                                              args.max_s, done, stop, args.lever == "writers", JOB_ID,
                                              (first, num_shards)))]
    if args.lever != "none":
        procs.append(ctx.Process(target=compactor, args=(str(data_dir), args.lever, args.compact_every_s,
                                                         args.min_age_s, stop)))
    for p in procs:
        p.start()
    samples: list[tuple[float, float, dict]] = []  # (seconds in, fraction committed, ms per query)
    most_files = 0
    con = connect(data_dir)
    t0 = time.time()
    try:
        while procs[0].is_alive():
            fraction = done.value / args.requests
            samples.append((time.time() - t0, fraction, time_round(con, str(data_dir), manifest,
                                                                   dashboard_queries(), args.timeout_s)))
            files = sum(1 for _ in (data_dir / "store").rglob("*.parquet"))
            most_files = max(most_files, files)
            slowest = max(samples[-1][2].items(), key=lambda kv: kv[1])
            print(f"{time.time() - t0:7.0f} s {100 * fraction:6.2f}% {files:7d} files, "
                  f"slowest {slowest[0]} {slowest[1]:.0f} ms", flush=True)
        for _ in range(args.final_rounds):  # the written job (the janitor still compacting)
            samples.append((time.time() - t0, done.value / args.requests,
                            time_round(con, str(data_dir), manifest, dashboard_queries(), args.timeout_s)))
    finally:
        stop.set()
        for p in procs:
            p.join()
        con.close()
    return report(samples, args, time.time() - t0, data_dir, most_files)


def report(samples: list[tuple[float, float, dict]], args: argparse.Namespace, wall_s: float,
           data_dir: Path, most_files: int = 0) -> dict:
    """p50 / p95 / max per query over the run, and p95 in each tenth of the run's time (the worst
    tenth: "at every moment", not only on average)."""
    names = list(samples[0][2]) if samples else []
    tenths: dict[int, list[dict]] = {}
    for elapsed, _fraction, times in samples:
        tenths.setdefault(min(int(10 * elapsed / max(wall_s, 1e-9)), 9), []).append(times)
    table = {}
    for name in names:
        every = [t[name] for _, _, t in samples]
        table[name] = {"p50_ms": statistics.median(every), "p95_ms": _p(every, 0.95), "max_ms": max(every),
                       "timeouts": sum(1 for v in every if v >= args.timeout_s * 1000)
                       if not name.startswith("status") else 0,  # status is not interrupted
                       "worst_tenth_p95_ms": max(_p([t[name] for t in ts], 0.95) for ts in tenths.values()),
                       "p95_ms_by_tenth": [round(_p([t[name] for t in ts], 0.95), 1)
                                           for _, ts in sorted(tenths.items())]}
    files = sum(1 for _ in (data_dir / "store").rglob("*.parquet"))
    committed = samples[-1][1] * args.requests if samples else 0
    out = {"requests": args.requests, "requests_written": committed, "shard_size": args.shard_size,
           "workers": args.workers, "lever": args.lever,
           "rounds": len(samples), "wall_s": wall_s, "parquet_files_at_end": files,
           "parquet_files_most": most_files, "queries": table}
    print(f"\nlever {args.lever}: {committed:,.0f} of {args.requests:,} requests written, "
          f"{len(samples)} rounds in {wall_s:.0f} s, "
          f"{files} Parquet files in the store at the end (at most {most_files} seen between rounds)")
    print(f"{'query':34} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'worst tenth p95':>16}")
    for name, row in table.items():
        flag = ("" if row["worst_tenth_p95_ms"] < 300 else "  > 300 ms") + (
            f", {row['timeouts']} timed out" if row["timeouts"] else "")
        print(f"{name:34} {row['p50_ms']:8.0f} {row['p95_ms']:8.0f} {row['max_ms']:8.0f} "
              f"{row['worst_tenth_p95_ms']:16.0f}{flag}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000_000)
    ap.add_argument("--shard-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=16, help="workers in the fleet (telemetry groups)")
    ap.add_argument("--flushes", type=int, default=2, help="output / request-timing parts per shard attempt")
    ap.add_argument("--steps-per-shard", type=int, default=40, help="engine iterations written per shard")
    ap.add_argument("--requests-per-s", type=float, default=0.0,
                    help="the fleet's rate (0: as fast as possible)")
    ap.add_argument("--lever", choices=("none", "telemetry", "compact", "writers"), default="writers",
                    help="compaction while the job runs: none; telemetry (and garbage) only; the janitor's "
                         "compact (running jobs too); writers (the writers' compaction as they commit, "
                         "and the janitor's)")
    ap.add_argument("--compact-every-s", type=float, default=60.0, help="the janitor's interval")
    ap.add_argument("--min-age-s", type=float, default=30.0, help="parts younger than this stay raw")
    ap.add_argument("--timeout-s", type=float, default=30.0,
                    help="a query's limit (the dashboard's PAGE_QUERY_TIMEOUT_S); past it, it counts as this")
    ap.add_argument("--final-rounds", type=int, default=3, help="rounds timed once the job is written")
    ap.add_argument("--max-s", type=float, default=0.0, help="stop writing after this (0: the whole job)")
    ap.add_argument("--start-at", type=float, default=0.0,
                    help="the fraction of the job's shards written (and compacted, as the janitor leaves "
                         "them) before the timing starts: measure the middle or the end of a job")
    ap.add_argument("--finished-jobs", type=int, default=0,
                    help="finished jobs written (and compacted) into the data dir before the live one")
    ap.add_argument("--finished-requests", type=int, default=100_000, help="requests of each finished job")
    ap.add_argument("--prefill-cache", type=Path, default=None,
                    help="keep the data dir as it is before the timing (finished jobs, --start-at) under "
                         "this directory, and start from the kept copy when its parameters match: "
                         "compare trees from the same store")
    ap.add_argument("--data-dir", type=Path, default=None, help="default: a temporary directory, deleted")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not 0.0 <= args.start_at <= 1.0:
        ap.error(f"--start-at {args.start_at}: a fraction of the job, from 0 to 1")
    with tempfile.TemporaryDirectory(prefix="bg-store-live-") as tmp:
        out = run(args, args.data_dir or Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
