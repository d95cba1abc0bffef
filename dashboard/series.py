"""Chart data of a job page, columnar (name -> list) as uPlot draws it, downsampled in SQL.

A series with more points than MAX_POINTS is bucketed on the server: iterations into time buckets
(each worker's mean per bucket, summed over workers), output tokens/s into at most OUTPUT_RATE_BUCKETS
buckets. The browser therefore draws a few thousand points whatever the job's size.
"""

from __future__ import annotations

from flask import current_app

from dashboard import queries
from dashboard.db import fetch_columns, fetch_one

OUTPUT_RATE_BUCKETS = 120  # buckets of the output tokens/s chart
HISTOGRAM_BINS = 30  # bins of a latency histogram


def job_iterations(job_id: str) -> dict:
    """The engine iterations that served the job: per iteration, or time-bucketed when long.

    Also `outstanding_requests`: the job's requests that had arrived at an engine and not finished,
    at each point -- request concurrency, drawn against running sequences.
    """
    extent = fetch_one(queries.JOB_ITERATION_EXTENT, {"job_id": job_id}) or {}
    n = extent.get("num_iterations") or 0
    out = {"job_id": job_id, "num_iterations": n, "num_workers": extent.get("num_workers") or 0,
           "downsampled": False, "bucket_s": None, "series": {}}
    if n == 0:
        return out
    max_points = current_app.config["MAX_POINTS"]
    if n <= max_points and out["num_workers"] == 1:
        series = fetch_columns(queries.JOB_ITERATIONS_RAW, {"job_id": job_id})
    else:
        width = _bucket_width(extent["t0"], extent["t1"], max_points)
        params = {"job_id": job_id, "t0": extent["t0"], "w": width}
        series = fetch_columns(queries.JOB_ITERATIONS_BUCKETED, params)
        out.update(downsampled=True, bucket_s=width)
    series["outstanding_requests"] = outstanding_at(job_id, series["ts"])
    out["series"] = series
    return out


def outstanding_at(job_id: str, points: list[float]) -> list[int]:
    if not points:
        return []
    cols = fetch_columns(queries.JOB_OUTSTANDING_AT, {"job_id": job_id, "points": points})
    return cols["outstanding_requests"]


def _bucket_width(t0: float, t1: float, max_points: int) -> float:
    """Bucket width so that [t0, t1] falls in at most max_points buckets (t1 included)."""
    span = max(t1 - t0, 1e-6)
    return span * (1 + 1e-9) / max_points


def job_output_rate(job_id: str) -> dict:
    """Output tokens/s of the job over time (see `queries.JOB_OUTPUT_RATE`)."""
    extent = fetch_one(queries.JOB_OUTPUT_EXTENT, {"job_id": job_id}) or {}
    out = {"job_id": job_id, "output_tokens": int(extent.get("output_tokens") or 0), "bucket_s": None,
           "series": {"ts": [], "output_tokens_per_s": []}}
    if not extent.get("num_requests"):
        return out
    n = OUTPUT_RATE_BUCKETS
    width = _bucket_width(extent["t0"], extent["t1"], n)
    params = {"job_id": job_id, "t0": extent["t0"], "w": width, "n": n}
    out["series"] = fetch_columns(queries.JOB_OUTPUT_RATE, params)
    out["bucket_s"] = width
    return out


def job_latency(job_id: str) -> dict:
    """TTFT, ITL, end-to-end and queue time of the job's requests: percentiles and a histogram each."""
    return {metric: latency_distribution(job_id, metric) for metric in queries.LATENCY_METRICS}


def latency_distribution(job_id: str, metric: str) -> dict:
    summary = fetch_one(queries.latency_summary_sql(metric), {"job_id": job_id}) or {"count": 0}
    out = {**summary, "histogram": {"lo": [], "count": []}}
    if not summary["count"]:
        return out
    lo, hi = summary["min"], summary["max"]
    width = max(hi - lo, 1e-9) / HISTOGRAM_BINS
    params = {"job_id": job_id, "lo": lo, "width": width, "bins": HISTOGRAM_BINS}
    counts = [0] * HISTOGRAM_BINS
    for b, c in zip(*fetch_columns(queries.latency_histogram_sql(metric), params).values(), strict=True):
        counts[b] = c
    out["histogram"] = {"lo": [lo + i * width for i in range(HISTOGRAM_BINS)], "count": counts,
                        "width": width}
    return out
