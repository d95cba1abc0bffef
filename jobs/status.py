"""`batchgen status`: job and shard progress from the views plus live leases.

The `jobs` and `shards` views say what is committed (the request outcome counts too: the winning
commits carry them, jobs.request_counts); lease files add the rows finished so far by shards still
running. The connection creates only the scans it reads (and the outputs', to report unreadable
outputs parts: `STATUS_BINDS`), and its queries inline the views above them (`over_scans`): every
job's row is the `jobs` view's. `status JOB` reads its job's row, its shard counts and its running and
failed shards in one query (rows only for the shards without a winning commit: `JOB_SHARDS_CTES`);
with --shards, it reads every shard's row once, into a table that all its answers read (its `jobs`
row is the view's SELECT over them, `jobs_over`). Each over one listing of the job's parts. Request
counts follow OpenAI Batch's `request_counts`: total, completed (stop or length), failed (error rows),
plus cancelled.
"""

from __future__ import annotations

import json
import time
from collections import Counter

from jobs.manifest import JobManifest, ManifestError, load_manifest
from jobs.request_counts import fetch_rows, job_counts, request_counts
from jobs.shards.state import JOB_ENDED_STATUSES, VIEW_STATUSES, ShardState
from jobs.shards.supervise import job_progress
from jobs.store import (
    JOB_SHARDS_CTES,
    JOBS_SELECT,
    STATUS_BINDS,
    connect_reporting,
    jobs_over,
    no_worker_warning,
    over_scans,
    read_worker_records,
    run_listed,
)


def jobs_status(data_dir: str) -> list[dict]:
    """One row per job: status, request counts, shard counts, rows done (live), tokens."""
    con, broken = connect_reporting(data_dir, views=STATUS_BINDS, defer_default=True)
    try:
        jobs = {r["job_id"]: r for r in fetch_rows(
            con, f"{over_scans(JOBS_SELECT, once=True)} ORDER BY submitted_at, job_id")}
    finally:
        con.close()
    found = job_counts(data_dir, list(jobs.values()), broken.get("outputs"))
    counts = found or {}
    rows, records = [], read_worker_records(data_dir)
    for job_id in sorted(jobs, key=lambda j: (str(jobs[j]["submitted_at"]), j)):
        job = jobs[job_id]
        live, damaged = _live_rows(data_dir, job_id)
        config = json.loads(job["config"] or "{}")
        rows.append({
            "job_id": job_id, "status": job["status"], "model": job["model"],
            "request_counts": request_counts(job["num_requests"] or 0, counts.get(job_id), found is None),
            "rows_done": max(live, job["rows_done"] or 0), "num_shards": job["num_shards"],
            "shards_completed": job["shards_completed"], "shards_failed": job["shards_failed"],
            "shards_running": job["shards_running"], "output_tokens": job["output_tokens"],
            "submitted_at": job["submitted_at"], "finished_at": job["finished_at"], "error": job["error"],
            "warning": damaged or no_worker_warning(queued_shards(job), config.get("queue", ""),
                                                    config.get("broker", ""), records, time.time()),
        })
    return rows


def queued_shards(job: dict) -> int:
    """Shards of a `jobs` row waiting for a worker (none once the job ended)."""
    if job["status"] in JOB_ENDED_STATUSES:
        return 0
    return (job["num_shards"] or 0) - job["shards_completed"] - job["shards_failed"] - job["shards_running"]


def _live_rows(data_dir: str, job_id: str) -> tuple[int, str | None]:
    """Rows done by the job's running attempts, and why they cannot be known (a damaged manifest)."""
    try:
        return job_progress(load_manifest(data_dir, job_id)).rows_done, None
    except ManifestError as exc:
        return 0, str(exc)
    except (OSError, ValueError):
        return 0, None


ENGINE_FAULTS_WITHIN_S = 86400.0  # `status` reports the engine faults of workers stopped within this


def engine_faults(data_dir: str, now: float | None = None) -> list[dict]:
    """Workers whose engine failed (jobs.worker_runtime: they handed their shards back and stopped) within
    the last ENGINE_FAULTS_WITHIN_S: worker id, host, when, and why."""
    now = time.time() if now is None else now
    return [{"worker_id": r.worker_id, "host": r.host, "ts": r.stopped_ts or r.heartbeat_ts,
             "error": r.engine_error} for r in read_worker_records(data_dir)
            if r.engine_error and now - (r.stopped_ts or r.heartbeat_ts) <= ENGINE_FAULTS_WITHIN_S]


def engine_fault_lines(faults: list[dict], now: float | None = None) -> list[str]:
    now = time.time() if now is None else now
    return [f"warning: worker {f['worker_id']} ({f['host']}) stopped {_ago(now - f['ts'])}: its "
            f"{f['error']}; the shards it held went back to the queue" for f in faults]


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    return f"{seconds / 60:.0f} min ago" if seconds < 7200 else f"{seconds / 3600:.0f} h ago"


SHARD_STATES = VIEW_STATUSES  # the `shards` view's statuses, in the order they are counted
LISTED_STATES = (ShardState.RUNNING.view_status, ShardState.FAILED.view_status)  # listed without --shards
_JOB_SHARDS_TABLE = "_bg_status_shards"  # `status JOB --shards`: the job's `shards` rows, read once
# `status JOB` without --shards: the job's `jobs` row, once per shard of the listed states and first
# shard of every other state among its shards without a winning commit (`_bg_shard`, with its state's
# count `_bg_n`), or once with none; the committed shards are counted, not each made a row
_JOB_AND_LISTED_SQL = over_scans(f"""
WITH {JOB_SHARDS_CTES}, job AS ({jobs_over(job_shards="SELECT * FROM job_shards")}),
n AS (
    SELECT status, count(*) AS _bg_n, min(shard_id) AS _bg_first FROM u WHERE job_id = $2 GROUP BY status
), listed AS (
    SELECT u AS _bg_shard, n._bg_n FROM u JOIN n ON n.status = u.status
    WHERE u.job_id = $2 AND (list_contains($1, u.status) OR u.shard_id = n._bg_first)
)
SELECT job.*, listed._bg_shard, listed._bg_n FROM job LEFT JOIN listed ON true WHERE job.job_id = $3
""", once=True)


def job_status(manifest: JobManifest, all_shards: bool = True) -> dict:
    """One job: its `jobs` row, request counts, shard counts by state and its shards (every one, or
    only the running and failed ones), with live progress where running."""
    con, broken = connect_reporting(manifest.data_dir, views=STATUS_BINDS,
                                     defer_default=True)
    try:
        job, shards, by_state = run_listed(con, lambda c: _job_rows(c, manifest.job_id, all_shards),
                                           job_id=manifest.job_id)
    finally:
        con.close()
    counts = job_counts(manifest.data_dir, job, broken.get("outputs"))
    progress = {s.shard_id: s for s in job_progress(manifest).active}  # running ones among them
    for shard in shards:
        live = progress.get(shard["shard_id"])
        if shard["status"] == ShardState.RUNNING.view_status and live is not None:
            shard["rows_done"], shard["output_tokens"] = live.rows_done, live.output_tokens
    info = dict(job[0]) if job else {"job_id": manifest.job_id, "status": "queued"}
    for key in ("config", "requests_completed", "requests_failed", "requests_cancelled", "counts_complete"):
        info.pop(key, None)  # the counts go out as request_counts
    info["request_counts"] = request_counts(manifest.num_requests, (counts or {}).get(manifest.job_id),
                                             counts is None)
    info["shard_counts"] = {state: by_state.get(state, 0) for state in SHARD_STATES}
    info["shard_counts"]["total"] = len(manifest.shards)
    info["shards"] = shards
    info["all_shards"] = all_shards
    queued = 0 if info["status"] in JOB_ENDED_STATUSES else info["shard_counts"]["queued"]
    info["warning"] = no_worker_warning(queued, manifest.queue, manifest.broker,
                                        read_worker_records(manifest.data_dir), time.time())
    info["engine_faults"] = engine_faults(manifest.data_dir)
    return info


def _job_rows(con, job_id: str, all_shards: bool) -> tuple[list[dict], list[dict], Counter]:
    """The job's `jobs` row (a list of one, or none), its shards (every one, or the listed ones) and
    their counts by state, over the listing pinned for them: with every shard, from one read of its
    `shards` rows; else from its `jobs` row and the rows of its shards without a winning commit (a
    job of 40,000 shards: the rows of the running ones and the counts come out of DuckDB, and the
    committed ones are counted from the winning commits, not each made a row)."""
    if all_shards:
        con.execute(f"CREATE OR REPLACE TEMP TABLE {_JOB_SHARDS_TABLE} AS "
                    f"{over_scans('SELECT * FROM _bg_shards')} WHERE job_id = ?", [job_id])
        job = _dicts(con.execute(f"{over_scans(jobs_over(_JOB_SHARDS_TABLE))} WHERE job_id = ?", [job_id]))
        shards = _dicts(con.execute(f"SELECT * FROM {_JOB_SHARDS_TABLE} ORDER BY shard_id"))
        return job, shards, Counter(s["status"] for s in shards)
    # one query: the job's row, with the rows of its listed shards and of the first shard of every
    # other state among those without a winning commit (each with its state's count) beside it
    rows = _dicts(con.execute(_JOB_AND_LISTED_SQL, [list(LISTED_STATES), job_id, job_id]))
    job = [{k: v for k, v in rows[0].items() if not k.startswith("_bg_")}] if rows else []
    made = [r for r in rows if r["_bg_shard"] is not None]
    shards = sorted((r["_bg_shard"] for r in made), key=lambda s: s["shard_id"])
    by_state = Counter({r["_bg_shard"]["status"]: r["_bg_n"] for r in made})
    if job:
        by_state[ShardState.COMMITTED.view_status] = job[0]["shards_completed"]
    return job, [s for s in shards if s["status"] in LISTED_STATES], by_state


def _dicts(cur) -> list[dict]:
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


# ---------------------------------------------------------------- rendering


def render_jobs(rows: list[dict], faults: list[dict] = ()) -> str:
    notes = engine_fault_lines(list(faults))
    if not rows:
        return "\n".join(["no jobs", *notes])
    header = ("JOB", "STATUS", "ROWS DONE", "OK", "ERROR", "CANCELLED", "SHARDS DONE/FAILED/ALL", "TOKENS",
              "MODEL")
    lines = [header]
    for r in rows:
        c = r["request_counts"]
        lines.append((r["job_id"], r["status"], f"{r['rows_done']}/{c['total']}", _count(c["completed"]),
                      _count(c["failed"]), _count(c["cancelled"]),
                      f"{r['shards_completed']}/{r['shards_failed']}/{r['num_shards']}",
                      str(r["output_tokens"] or 0), str(r["model"])))
    warnings = [f"warning: job {r['job_id']}: {r['warning']}" for r in rows if r.get("warning")]
    return "\n".join([_table(lines), *warnings, *notes])


def render_job(info: dict) -> str:
    c = info["request_counts"]
    head = [
        f"job {info['job_id']}: {info['status']}",
        f"requests: total {c['total']}, completed {_count(c['completed'])}, failed {_count(c['failed'])}, "
        f"cancelled {_count(c['cancelled'])}",
        f"tokens: prompt {info.get('prompt_tokens') or 0}, output {info.get('output_tokens') or 0}",
    ]
    if info.get("error"):
        head.append(f"error: {info['error']}")
    if info.get("warning"):
        head.append(f"warning: {info['warning']}")
    head += engine_fault_lines(info.get("engine_faults", []))
    counts = info["shard_counts"]
    head.append(f"shards: {counts['total']} total, " + ", ".join(f"{counts[s]} {s}" for s in SHARD_STATES))
    if not info["shards"]:
        note = "" if info.get("all_shards") else "\n(none running or failed; --shards lists all)"
        return "\n".join(head) + note
    lines = [("SHARD", "STATUS", "ATTEMPTS", "ROWS", "WORKER", "ERROR")]
    for s in info["shards"]:
        rows = f"{s['rows_done'] or 0}/{s['num_requests'] or '?'}"
        lines.append((str(s["shard_id"]), s["status"], str(s["attempts"]), rows, s["worker_id"] or "",
                      s["error"] or ""))
    note = "" if info.get("all_shards") else "\n(running and failed shards only; --shards lists all)"
    return "\n".join(head) + "\n\n" + _table(lines) + note


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _table(lines: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)
