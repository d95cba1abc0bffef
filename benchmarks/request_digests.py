"""A large job's request figures: read from its rows against read from its digests' sample.

    python -m benchmarks.request_digests --requests 1000000 --shards 1000 [--json out.json]
    (also `batchgen bench request-digests`)

Writes one job through the `Store` API (`benchmarks.store_queries.synthesize`: every attempt flushes
its rows in parts of `--rows-per-part`, so each part gets its digest), compacts it as the janitor
would, then times, over one connection and alternating the two forms round by round, each of the job
page's request figures (dashboard.queries): latency distributions, output tokens/s, request
concurrency, preemptions and the job summary's live totals, in the form that reads every request row
of `requests_live` (what the dashboard ran before digests, and still runs for a job of at most
EXACT_MAX_ROWS rows) and the form that reads the digests (for the distributions and series: the
sample at the level `jobs.store.digests.sample_level` picks, after `JOB_REQUEST_DIGESTS`, as the
dashboard does). Reports p50 / p95 ms of each form, and how far the sample's percentiles and
concurrency are from the rows' (relative error).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.store_queries import JOB_ID, count_files, synthesize

# the job summary's live totals as the dashboard read them before digests (from every request row)
_LIVE_FROM_ROWS = """
SELECT job_id, count(*) AS rows_live, coalesce(sum(output_tokens), 0) AS output_tokens_live
FROM requests_live WHERE job_id = $job_id GROUP BY job_id
"""
_LIVE_FROM_DIGESTS = """
SELECT job_id, sum(num_rows) AS rows_live, coalesce(sum(output_tokens), 0) AS output_tokens_live
FROM _bg.request_digests_live WHERE job_id = $job_id GROUP BY job_id
"""


def figures(level: int, points: list[float]) -> dict[str, tuple[str, str, dict]]:
    """name -> (SQL over the rows, SQL over the digests, parameters)."""
    from dashboard import queries as q
    from dashboard.series import HISTOGRAM_BINS, OUTPUT_RATE_BUCKETS

    job = {"job_id": JOB_ID}
    rate = {**job, "n": OUTPUT_RATE_BUCKETS}
    return {
        "latency": (q.JOB_LATENCY, q.JOB_LATENCY_SAMPLED[level], {**job, "bins": HISTOGRAM_BINS}),
        "output_rate": (q.JOB_OUTPUT_RATE, q.JOB_OUTPUT_RATE_SAMPLED[level], rate),
        "outstanding_at": (q.JOB_OUTSTANDING_AT, q.JOB_OUTSTANDING_AT_SAMPLED[level],
                           {**job, "points": points}),
        "preemptions": (q.JOB_PREEMPTIONS_SCAN, q.JOB_PREEMPTIONS, job),
        "summary_live_totals": (_LIVE_FROM_ROWS, _LIVE_FROM_DIGESTS, job),
    }


def measure(data_dir: Path, rounds: int) -> dict:
    from dashboard.queries import JOB_REQUEST_DIGESTS
    from jobs.store import connect, run_query, source_level

    con = connect(data_dir)

    def run(sql: str, params: dict) -> list[tuple]:
        cur = con.cursor()
        try:
            return run_query(cur, sql, params, timeout_s=600, max_rows=1_000_000, job_id=JOB_ID).rows
        finally:
            cur.close()

    (request_rows, undigested), = run(JOB_REQUEST_DIGESTS, {"job_id": JOB_ID})
    level = source_level(request_rows, undigested)
    if level is None:
        raise SystemExit(f"the job has {request_rows} request rows ({undigested} commits without digests): "
                         "the dashboard reads its rows; give --requests above 65,536")
    t0, t1 = run("SELECT min(arrival_ts), max(finished_ts) FROM requests_live WHERE job_id = $job_id",
                 {"job_id": JOB_ID})[0]
    points = [t0 + (t1 - t0) * i / 599 for i in range(600)]
    queries = figures(level, points)
    times: dict[str, dict[str, list[float]]] = {name: {"rows": [], "digests": []} for name in queries}
    answers: dict[str, dict[str, list]] = {name: {} for name in queries}
    for r in range(rounds):
        for name, (rows_sql, digests_sql, params) in queries.items():
            order = (("rows", rows_sql), ("digests", digests_sql))
            for form, sql in order if r % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                if form == "digests" and name in ("latency", "output_rate", "outstanding_at"):
                    # the question the dashboard asks first (once per SOURCE_TTL_S), counted every time
                    run(JOB_REQUEST_DIGESTS, {"job_id": JOB_ID})
                answers[name][form] = run(sql, params)
                times[name][form].append((time.perf_counter() - start) * 1000)
    con.close()
    report = {"request_rows": request_rows, "level": level, "queries": {}}
    for name, by_form in times.items():
        report["queries"][name] = {f"{form}_{stat}": value for form, values in by_form.items()
                                   for stat, value in (("p50_ms", statistics.median(values)),
                                                       ("p95_ms", _p95(values)))}
    report["accuracy"] = accuracy(answers)
    return report


def accuracy(answers: dict) -> dict:
    """Relative errors of the sample's figures against the rows'."""
    out = {}
    lat_rows = {row[0]: row for row in answers["latency"]["rows"]}
    for row in answers["latency"]["digests"]:
        exact = lat_rows[row[0]]
        # columns: metric, count, mean, min, max, p50, p90, p99, ...
        out[row[0]] = {name: _rel(row[i], exact[i]) for i, name in ((1, "count"), (2, "mean"), (5, "p50"),
                                                                  (6, "p90"), (7, "p99"))}
    exact_out = [n for _, n in answers["outstanding_at"]["rows"]]
    sampled_out = [n for _, n in answers["outstanding_at"]["digests"]]
    peak = max(exact_out) or 1
    out["outstanding_at"] = {"mean_abs_error_of_peak": statistics.fmean(
        abs(a - b) for a, b in zip(exact_out, sampled_out, strict=True)) / peak}
    rate_rows = [r[1] for r in answers["output_rate"]["rows"]]
    rate_digests = [r[1] for r in answers["output_rate"]["digests"]]
    totals = [answers["output_rate"][form][0][3] for form in ("digests", "rows")]
    out["output_rate"] = {"total": _rel(*totals),
                          "mean_abs_error_of_mean": statistics.fmean(
                              abs(a - b) for a, b in zip(rate_rows, rate_digests, strict=True))
                          / (statistics.fmean(rate_rows) or 1)}
    return out


def _rel(value, exact) -> float | None:
    if value is None or exact is None:
        return None
    return abs(value - exact) / abs(exact) if exact else float(value != exact)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="batchgen bench request-digests", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--rows-per-part", type=int, default=256, help="request rows per flushed part")
    ap.add_argument("--rounds", type=int, default=5, help="timed runs of each form of each query")
    ap.add_argument("--data-dir", type=Path, default=None, help="default: a temporary directory, deleted")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bg-digests-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        if not (data_dir / "store").exists():
            t = time.perf_counter()
            synthesize(data_dir, requests=args.requests, shards=args.shards, iterations=0, workers=1,
                       rows_per_part=args.rows_per_part)
            from jobs.store.compact import collect_garbage, compact
            compact(data_dir, min_age_s=0.0)
            collect_garbage(data_dir, grace_s=0.0)
            print(f"wrote {args.requests:,} requests in {time.perf_counter() - t:.0f} s, "
                  f"{count_files(data_dir)} files", flush=True)
        report = measure(data_dir, args.rounds)
    print(f"{report['request_rows']:,} request rows; the sample at level {report['level']} "
          f"(1 in {2 ** report['level']})")
    print(f"{'figure':22} {'rows p50':>9} {'p95':>7} {'digests p50':>12} {'p95':>7}   ratio p50")
    for name, q in report["queries"].items():
        print(f"{name:22} {q['rows_p50_ms']:9.0f} {q['rows_p95_ms']:7.0f} {q['digests_p50_ms']:12.0f} "
              f"{q['digests_p95_ms']:7.0f}   {q['rows_p50_ms'] / q['digests_p50_ms']:.1f}x")
    print("relative error of the sample:", json.dumps(report["accuracy"], indent=None))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
