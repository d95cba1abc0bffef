"""Chart data of a job page, columnar (name -> list) as uPlot draws it, downsampled in SQL.

A series with more points than MAX_POINTS is bucketed on the server: iterations into time buckets
(each worker's mean per bucket, summed over workers), output tokens/s into at most OUTPUT_RATE_BUCKETS
buckets. The browser therefore draws a few thousand points whatever the job's size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from flask import current_app

from dashboard import queries
from dashboard.db import fetch_columns, fetch_dicts, fetch_one
from jobs.store import source_level

OUTPUT_RATE_BUCKETS = 120  # buckets of the output tokens/s chart
HISTOGRAM_BINS = 30  # bins of a latency histogram


@dataclass(frozen=True)
class RequestSource:
    """Where a job's request figures come from: its rows (`level` None), or its digests' sample of
    level >= `level` (jobs.store.digests), which holds about `request_rows` / 2**level rows.
    `digested`: every committed attempt's parts have their digests, so their sums are the job's."""

    request_rows: int
    level: int | None
    digested: bool

    def pick(self, exact: str, sampled: dict[int, str]) -> str:
        return exact if self.level is None else sampled[self.level]

    def describe(self) -> dict | None:
        """What the API says about the sample (None: every request row was read)."""
        if self.level is None:
            return None
        return {"level": self.level, "rate": 2.0 ** -self.level, "request_rows": self.request_rows}


SOURCE_TTL_S = 5.0  # a job's RequestSource is asked again after this long (a page asks 3-4 times)


def request_source(job_id: str) -> RequestSource:
    """The job's rows or its digests' sample, as `jobs.store.digests.source_level` decides. Kept per app
    for SOURCE_TTL_S: the page's figures ask together, and an answer a few seconds old is still right
    (either form answers correctly; the level only sets the sample's size)."""
    cache = current_app.extensions.setdefault("batchgen_request_sources", {})
    now = time.monotonic()
    hit = cache.get(job_id)
    if hit is not None and now - hit[0] < SOURCE_TTL_S:
        return hit[1]
    row = fetch_one(queries.JOB_REQUEST_DIGESTS, {"job_id": job_id}) or {}
    rows, undigested = row.get("request_rows") or 0, row.get("undigested_commits") or 0
    source = RequestSource(rows, source_level(rows, undigested), not undigested)
    if len(cache) > 256:  # a long-lived dashboard over many jobs: forget the old answers
        cache.clear()
    cache[job_id] = (now, source)
    return source


def job_iterations(job_id: str) -> dict:
    """The engine iterations that served the job: per iteration, or time-bucketed when long.

    Also `outstanding_requests`: the job's requests that had arrived at an engine and not finished,
    at each point -- request concurrency, drawn against running sequences.
    """
    series = iteration_series(fetch_columns, job_id, current_app.config["MAX_POINTS"])
    extent = {name: series.pop(name, []) for name in queries.ITERATION_EXTENT_COLUMNS}
    out = {"job_id": job_id, "num_iterations": 0, "num_workers": 0, "downsampled": False, "bucket_s": None,
           "series": {}}
    if not series.get("ts"):
        return out
    out.update({name: values[0] for name, values in extent.items()})
    if not out["downsampled"]:
        out["bucket_s"] = None
    source = request_source(job_id)
    series["outstanding_requests"] = outstanding_at(job_id, series["ts"], source)
    out["series"], out["outstanding_sample"] = series, source.describe()
    return out


def iteration_series(columns: Callable[[str, dict], dict[str, list]], job_id: str,
                     max_points: int) -> dict[str, list]:
    """The columns of the job's iteration chart, `columns(sql, params)` running its queries: from the
    per-second rollups (`queries.JOB_ITERATIONS_ROLLED`) when its buckets are whole seconds, else from
    the rows (`queries.JOB_ITERATIONS`, over the time window the rollups give)."""
    params = {"job_id": job_id, "max_points": max_points}
    rolled = columns(queries.JOB_ITERATIONS_ROLLED, params)
    if not rolled.get("ts"):
        return {}
    t0, t_end, use = rolled.pop("t0")[0], rolled.pop("t_end")[0], rolled.pop("rolled")[0]
    if use:
        return rolled
    return columns(queries.JOB_ITERATIONS, {**params, "t0": t0, "t_end": t_end})


def outstanding_at(job_id: str, points: list[float], source: RequestSource | None = None) -> list[int]:
    """Request concurrency of the job at each point (`queries.JOB_OUTSTANDING_AT`)."""
    if not points:
        return []
    source = source or request_source(job_id)
    sql = source.pick(queries.JOB_OUTSTANDING_AT, queries.JOB_OUTSTANDING_AT_SAMPLED)
    cols = fetch_columns(sql, {"job_id": job_id, "points": points})
    return cols["outstanding_requests"]


def job_output_rate(job_id: str) -> dict:
    """Output tokens/s of the job over time (see `queries.JOB_OUTPUT_RATE`); `sample`: see
    `RequestSource.describe`."""
    source = request_source(job_id)
    sql = source.pick(queries.JOB_OUTPUT_RATE, queries.JOB_OUTPUT_RATE_SAMPLED)
    series = fetch_columns(sql, {"job_id": job_id, "n": OUTPUT_RATE_BUCKETS})
    bucket_s, total = series.pop("bucket_s", []), series.pop("output_tokens", [])
    return {"job_id": job_id, "output_tokens": total[0] if total else 0,
            "bucket_s": bucket_s[0] if bucket_s else None, "sample": source.describe(),
            "series": series or {"ts": [], "output_tokens_per_s": []}}


def job_latency(job_id: str) -> dict:
    """TTFT, ITL, end-to-end and queue time of the job's requests: percentiles and a histogram each,
    and `sample` (see `RequestSource.describe`; each metric's `sampled_count` is its sampled requests)."""
    params = {"job_id": job_id, "bins": HISTOGRAM_BINS}
    source = request_source(job_id)
    rows = {r["metric"]: r for r in fetch_dicts(source.pick(queries.JOB_LATENCY, queries.JOB_LATENCY_SAMPLED),
                                                  params)}
    out = {metric: _distribution(rows.get(metric)) for metric in queries.LATENCY_METRICS}
    return {**out, "sample": source.describe()}


def _distribution(row: dict | None) -> dict:
    """One metric's summary, with its histogram as every bin's lower edge and count."""
    if row is None:
        return {"count": 0, "mean": None, "min": None, "max": None, "p50": None, "p90": None, "p99": None,
                "sampled_count": None, "histogram": {"lo": [], "count": [], "width": None}}
    counts = [0] * HISTOGRAM_BINS
    for b, n in zip(row.pop("bins"), row.pop("counts"), strict=True):
        counts[b] = n
    width = row.pop("width")
    row.pop("metric")
    lo = [row["min"] + i * width for i in range(HISTOGRAM_BINS)]
    return {**row, "histogram": {"lo": lo, "count": counts, "width": width}}
