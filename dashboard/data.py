"""What the pages show, read from the views: job summaries, workers, sweep configurations.

Each function runs the named queries of `dashboard.queries` on the request's cursor and adds what
is derived from the clock (tokens/s, ETA, age). Rows go out as dataclasses so the templates and the
JSON endpoints use the same names.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields

from flask import current_app

from dashboard import queries, series
from dashboard.db import fetch_dicts, fetch_one
from jobs.store import WorkerRecord, no_worker_warning, read_worker_records

LIVE_STATUSES = ("queued", "running")
MAX_JOBS = 500  # jobs listed on the jobs page
SHARDS_PER_PAGE = 100  # shards a job page (and /api/jobs/<id>) lists at a time
MAX_SHARDS_PER_PAGE = 1000  # the most /api/jobs/<id>/shards gives in one page
SHARD_STATUSES = ("failed", "running", "queued", "cancelled", "completed")  # the order counts are shown in
MAX_WORKERS = 1000  # workers listed in a job's configuration table
RECENT_WINDOW_S = 60.0  # "recent" tokens/s of a worker: over the whole seconds since floor(now) - this
HEARTBEAT_STALE_S = 30.0  # a worker with no record whose last iteration is older than this is gone
BUSY_WITHIN_S = 10.0  # a live worker holding no shard at its heartbeat but iterating this recently: running


@dataclass
class JobSummary:
    """One row of the jobs page: the `jobs` view plus live progress and clock-derived rates."""

    job_id: str
    status: str  # queued | running | completed | failed | cancelled
    model: str | None  # as the job was submitted with
    num_requests: int | None  # rows of the input Parquet
    num_shards: int | None  # shards 0 .. num_shards - 1
    shards_completed: int  # shards whose attempt committed
    shards_failed: int  # shards out of retries
    shards_running: int  # shards with an attempt running now
    rows_done: int  # rows finished: committed, or finished by an attempt still running
    output_tokens: int  # generated tokens of those rows
    prompt_tokens: int  # prompt tokens of the committed rows
    error_rows: int  # output rows with finish_reason 'error'
    error: str | None  # the first failed shard's error, or the cancel reason
    submitted_ts: float | None  # epoch seconds
    started_ts: float | None  # first shard attempt started
    finished_ts: float | None  # set once the job is completed, failed or cancelled
    progress: float  # rows_done / num_requests, in [0, 1]
    elapsed_s: float | None  # started -> finished (or now, while live)
    output_tokens_per_s: float | None  # output_tokens / elapsed_s
    rows_per_s: float | None  # rows_done / elapsed_s
    eta_s: float | None  # rows left / rows_per_s, while live
    age_s: float | None  # now - submitted
    live: bool  # queued or running: the page keeps refreshing

    def as_json(self) -> dict:
        return asdict(self)


def job_warning(job: JobSummary, config: dict) -> str | None:
    """The job's shards wait while no live worker consumes its queue (jobs.store.workers)."""
    if not job.live:
        return None
    queued = (job.num_shards or 0) - job.shards_completed - job.shards_failed - job.shards_running
    return no_worker_warning(queued, config.get("queue", ""), config.get("broker", ""),
                             read_worker_records(current_app.config["DATA_DIR"]), time.time())


def job_summaries(limit: int = MAX_JOBS) -> list[JobSummary]:
    now = time.time()
    rows = fetch_dicts(queries.JOBS_SUMMARY, {"limit": limit})
    if not all(row["counts_complete"] for row in rows):  # a job committed by an older batchgen
        rows = fetch_dicts(queries.JOBS_SUMMARY_SCAN, {"limit": limit})
    return [_summary(row, now) for row in rows]


def job_summary(job_id: str) -> tuple[JobSummary, dict] | None:
    """The job's summary and its config (parsed JSON), or None when there is no such job."""
    row = fetch_one(queries.JOB_SUMMARY, {"job_id": job_id, "limit": 1})
    if row is not None and not row["counts_complete"]:  # committed by an older batchgen
        row = fetch_one(queries.JOB_SUMMARY_SCAN, {"job_id": job_id, "limit": 1})
    if row is None:
        return None
    return _summary(row, time.time()), parse_config(row.get("config"))


def _summary(row: dict, now: float) -> JobSummary:
    names = {f.name for f in fields(JobSummary)}
    base = {k: v for k, v in row.items() if k in names}
    live = row["status"] in LIVE_STATUSES
    rates = job_rates(row, now, live)
    return JobSummary(**base, **rates, live=live)


def job_rates(row: dict, now: float, live: bool) -> dict:
    """progress, elapsed, tokens/s, rows/s, ETA and age of one `JOBS_SUMMARY` row."""
    total, done = row["num_requests"], row["rows_done"] or 0
    started, finished = row["started_ts"], row["finished_ts"]
    end = finished if finished is not None else (now if live else None)
    elapsed = end - started if started is not None and end is not None else None
    per_s = (lambda n: n / elapsed) if elapsed and elapsed > 0 else (lambda n: None)
    rows_per_s = per_s(done)
    eta = (total - done) / rows_per_s if live and rows_per_s and total is not None else None
    return {
        "progress": min(done / total, 1.0) if total else (1.0 if row["status"] == "completed" else 0.0),
        "elapsed_s": elapsed,
        "output_tokens_per_s": per_s(row["output_tokens"] or 0),
        "rows_per_s": rows_per_s,
        "eta_s": max(eta, 0.0) if eta is not None else None,
        "age_s": now - row["submitted_ts"] if row["submitted_ts"] is not None else None,
    }


def parse_config(text: str | None) -> dict:
    """A job's config JSON as a dict ({} when empty; {'unparsed': text} when it is not JSON)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"unparsed": text}
    return value if isinstance(value, dict) else {"value": value}


def job_worker_configs(job_id: str) -> list[dict]:
    """The engine config each worker that ran the job's shards serves, from its own record (what it
    really runs: a job never sets engine limits); [] before any worker took a shard."""
    seen = [r["worker_id"] for r in fetch_dicts(queries.JOB_SHARD_WORKERS, {"job_id": job_id,
                                                                             "limit": MAX_WORKERS})]
    records = {r.worker_id: r for r in read_worker_records(current_app.config["DATA_DIR"])}
    return [{"worker_id": wid, "engine_config": records[wid].engine_config if wid in records else {}}
            for wid in seen]


@dataclass
class ShardPage:
    """One page of a job's shards (failed and running ones first), with the job's counts by status:
    what the job page and `/api/jobs/<id>/shards` show, the same size whatever the shard count."""

    counts: dict[str, int]  # every shard of the job, by status
    status: str | None  # the status the list is narrowed to (None: all)
    page: int  # 1-based
    per_page: int
    total: int  # shards in the (narrowed) list
    shards: list[dict]  # this page's rows

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.per_page))

    def as_json(self) -> dict:
        return {**asdict(self), "pages": self.pages}


def job_shard_page(job_id: str, page: int = 1, per_page: int = SHARDS_PER_PAGE,
                   status: str | None = None) -> ShardPage:
    counts = {r["status"]: r["n"] for r in fetch_dicts(queries.JOB_SHARD_COUNTS, {"job_id": job_id})}
    rows = fetch_dicts(queries.JOB_SHARDS_PAGE, {"job_id": job_id, "status": status, "limit": per_page,
                                                 "offset": (page - 1) * per_page})
    total = counts.get(status, 0) if status else sum(counts.values())
    return ShardPage(counts, status, page, per_page, total, rows)


def job_outputs_sample(job_id: str, limit: int) -> list[dict]:
    """The first committed shards' output rows, at most `limit` (`queries.JOB_OUTPUTS_SAMPLE`)."""
    shards = fetch_one(queries.JOB_SAMPLE_SHARDS, {"job_id": job_id, "limit": limit}) or {}
    if shards.get("lo") is None:
        return []
    return fetch_dicts(queries.JOB_OUTPUTS_SAMPLE, {"job_id": job_id, "limit": limit, **shards})


def job_preemptions(job_id: str) -> dict:
    """The job's request preemptions, from its request digests; from its rows when it has commits whose
    parts have no digests (dashboard.series.request_source)."""
    digested = series.request_source(job_id).digested
    sql = queries.JOB_PREEMPTIONS if digested else queries.JOB_PREEMPTIONS_SCAN
    return fetch_one(sql, {"job_id": job_id}) or {"request_preemptions": 0, "requests_preempted": 0}


# ---------------------------------------------------------------- workers


@dataclass
class WorkerSummary:
    """A worker seen in its heartbeat record (jobs.store.workers) or in the `iterations` telemetry."""

    worker_id: str
    state: str  # running | idle | gone
    gone_reason: str | None  # stopped (clean shutdown) | lost (heartbeat stopped) | silent (no record, no
    # iteration for HEARTBEAT_STALE_S); None while not gone
    gone_since_ts: float | None  # when it stopped, or its last sign of life
    heartbeat_ts: float | None  # its last sign of life: record heartbeat, else end of its last iteration
    host: str | None  # from its record
    metrics_url: str | None  # its Prometheus /metrics, when it serves one
    iterations: int  # engine steps it has written
    first_seen_ts: float | None  # its first iteration
    last_seen_ts: float | None  # end of its last iteration
    max_num_seqs: int | None  # sequence cap in force at its last iteration
    token_budget: int | None  # max_num_batched_tokens in force at its last iteration
    kv_blocks_total: int | None  # KV blocks in its cache
    kv_blocks_used: int | None  # at its last iteration
    num_running: int | None  # running sequences at its last iteration
    num_waiting: int | None  # waiting requests at its last iteration
    recent_decode_tokens_per_s: float  # over the whole seconds since floor(now) - RECENT_WINDOW_S
    recent_scheduled_tokens_per_s: float  # prefill + decode tokens, same window
    lifetime_decode_tokens_per_s: float | None  # first to last iteration
    preemptions: int  # sequences it preempted, over all its iterations
    alive: bool  # not gone
    current_shards: list[dict]  # shards it is running now (job_id, shard_id, attempts, started_ts)
    latest_job_id: str | None  # the job of the shard it started last
    model: str | None  # the model it serves (its record), else that job's model
    engine_config: dict  # the engine config it serves (its record; {} when it wrote none)
    engine_error: str | None  # why its engine failed (it handed its shards back and stopped), else None
    device: str | None  # where its engine runs (cpu, cuda:N), from its record

    def as_json(self) -> dict:
        return asdict(self)


_NO_TELEMETRY = {"iterations": 0, "first_seen_ts": None, "last_seen_ts": None, "max_num_seqs": None,
                 "token_budget": None, "kv_blocks_total": None, "kv_blocks_used": None, "num_running": None,
                 "num_waiting": None, "recent_decode_tokens_per_s": 0.0, "recent_scheduled_tokens_per_s": 0.0,
                 "lifetime_decode_tokens_per_s": None, "preemptions": 0}
_STATE_ORDER = {"running": 0, "idle": 1, "gone": 2}


def worker_summaries() -> list[WorkerSummary]:
    """Every worker, live ones first, then the gone ones; each group by last sign of life."""
    now = time.time()
    rows = fetch_dicts(queries.WORKERS, {"now": now, "window_s": RECENT_WINDOW_S}, cache=False)
    telemetry = {r["worker_id"]: r for r in rows}
    records = {r.worker_id: r for r in read_worker_records(current_app.config["DATA_DIR"])}
    running = fetch_dicts(queries.WORKER_SHARDS)
    latest = {r["worker_id"]: r for r in fetch_dicts(queries.WORKER_LATEST_JOB)}
    summaries = [_worker(wid, telemetry.get(wid), records.get(wid), running, latest.get(wid, {}), now)
                 for wid in telemetry.keys() | records.keys()]
    return sorted(summaries, key=lambda w: (_STATE_ORDER[w.state], -(w.heartbeat_ts or 0), w.worker_id))


def _worker(worker_id: str, row: dict | None, record: WorkerRecord | None, running: list[dict], latest: dict,
            now: float) -> WorkerSummary:
    shards = [{k: s[k] for k in ("job_id", "shard_id", "attempts", "started_ts")}
              for s in running if s["worker_id"] == worker_id]
    stats = {k: v for k, v in (row or _NO_TELEMETRY).items() if k != "worker_id"}
    state, reason, since, heartbeat = _liveness(record, stats["last_seen_ts"], now)
    return WorkerSummary(
        worker_id=worker_id, state=state, gone_reason=reason, gone_since_ts=since, heartbeat_ts=heartbeat,
        host=record.host if record else None, metrics_url=(record.metrics_url or None) if record else None,
        **stats, alive=state != "gone", current_shards=shards, latest_job_id=latest.get("job_id"),
        model=(record.model if record and record.model else latest.get("model")),
        engine_config=record.engine_config if record else {},
        engine_error=(record.engine_error or None) if record else None,
        device=(record.device or record.engine_config.get("device")) if record else None,
    )


def _liveness(record: WorkerRecord | None, last_iteration_ts: float | None,
              now: float) -> tuple[str, str | None, float | None, float | None]:
    """(state, gone reason, gone since, last sign of life). A worker with a record is judged by it; one
    without (telemetry written before records existed) by its last iteration."""
    if record is None:
        if last_iteration_ts is not None and now - last_iteration_ts <= HEARTBEAT_STALE_S:
            return "running", None, None, last_iteration_ts
        return "gone", "silent", last_iteration_ts, last_iteration_ts
    since = record.gone_since(now)
    if since is not None:
        return "gone", record.state(now), since, record.heartbeat_ts
    iterating = last_iteration_ts is not None and now - last_iteration_ts <= BUSY_WITHIN_S
    busy = record.shards_held > 0 or iterating
    return ("running" if busy else "idle"), None, None, record.heartbeat_ts


# ---------------------------------------------------------------- sweeps


def sweep_configurations(limit: int = 5000) -> dict[str, list[dict]]:
    """sweep_id -> its measured configurations (repeats averaged), by throughput; newest sweep first."""
    groups: dict[str, list[dict]] = {}
    for row in fetch_dicts(queries.SWEEP_CONFIGURATIONS, {"limit": limit}):
        groups.setdefault(row["sweep_id"], []).append(row)
    return dict(sorted(groups.items(), key=lambda kv: -max(r["ts"] for r in kv[1])))
