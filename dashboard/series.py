"""Chart data of a job page, columnar (name -> list) as uPlot draws it, downsampled in SQL.

A series with more points than MAX_POINTS is bucketed on the server: iterations into time buckets
(each worker's mean per bucket, summed over workers), output tokens/s into at most OUTPUT_RATE_BUCKETS
buckets. The browser therefore draws a few thousand points whatever the job's size.
"""

from __future__ import annotations

from flask import current_app

from dashboard import queries
from dashboard.db import fetch_columns, fetch_dicts

OUTPUT_RATE_BUCKETS = 120  # buckets of the output tokens/s chart
HISTOGRAM_BINS = 30  # bins of a latency histogram


def job_iterations(job_id: str) -> dict:
    """The engine iterations that served the job: per iteration, or time-bucketed when long.

    Also `outstanding_requests`: the job's requests that had arrived at an engine and not finished,
    at each point -- request concurrency, drawn against running sequences.
    """
    params = {"job_id": job_id, "max_points": current_app.config["MAX_POINTS"]}
    series = fetch_columns(queries.JOB_ITERATIONS, params)
    extent = {name: series.pop(name, []) for name in queries.ITERATION_EXTENT_COLUMNS}
    out = {"job_id": job_id, "num_iterations": 0, "num_workers": 0, "downsampled": False, "bucket_s": None,
           "series": {}}
    if not series.get("ts"):
        return out
    out.update({name: values[0] for name, values in extent.items()})
    if not out["downsampled"]:
        out["bucket_s"] = None
    series["outstanding_requests"] = outstanding_at(job_id, series["ts"])
    out["series"] = series
    return out


def outstanding_at(job_id: str, points: list[float]) -> list[int]:
    if not points:
        return []
    cols = fetch_columns(queries.JOB_OUTSTANDING_AT, {"job_id": job_id, "points": points})
    return cols["outstanding_requests"]


def job_output_rate(job_id: str) -> dict:
    """Output tokens/s of the job over time (see `queries.JOB_OUTPUT_RATE`)."""
    series = fetch_columns(queries.JOB_OUTPUT_RATE, {"job_id": job_id, "n": OUTPUT_RATE_BUCKETS})
    bucket_s, total = series.pop("bucket_s", []), series.pop("output_tokens", [])
    return {"job_id": job_id, "output_tokens": total[0] if total else 0,
            "bucket_s": bucket_s[0] if bucket_s else None,
            "series": series or {"ts": [], "output_tokens_per_s": []}}


def job_latency(job_id: str) -> dict:
    """TTFT, ITL, end-to-end and queue time of the job's requests: percentiles and a histogram each."""
    params = {"job_id": job_id, "bins": HISTOGRAM_BINS}
    rows = {r["metric"]: r for r in fetch_dicts(queries.JOB_LATENCY, params)}
    return {metric: _distribution(rows.get(metric)) for metric in queries.LATENCY_METRICS}


def _distribution(row: dict | None) -> dict:
    """One metric's summary, with its histogram as every bin's lower edge and count."""
    if row is None:
        return {"count": 0, "mean": None, "min": None, "max": None, "p50": None, "p90": None, "p99": None,
                "histogram": {"lo": [], "count": [], "width": None}}
    counts = [0] * HISTOGRAM_BINS
    for b, n in zip(row.pop("bins"), row.pop("counts"), strict=True):
        counts[b] = n
    width = row.pop("width")
    row.pop("metric")
    lo = [row["min"] + i * width for i in range(HISTOGRAM_BINS)]
    return {**row, "histogram": {"lo": lo, "count": counts, "width": width}}
