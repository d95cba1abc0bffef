"""Request outcomes as OpenAI Batch's `request_counts` counts them: total, completed (stop or
length), failed (a sample with an error) and cancelled. Shared by `batchgen status` (jobs.status)
and the end-of-run summary (jobs.summary).

Each commit carries its attempt's outcome counts (store schema v3), so a job's counts are sums over
its winning commits: the `jobs` view's requests_completed / requests_failed / requests_cancelled,
read with the job (`job_counts`), not a GROUP BY over every output row. A job with a commit written
before v3 (`counts_complete` false: a data dir of an older batchgen) is counted from the `outputs`
view as before (`fetch_counts`).
"""

from __future__ import annotations

import logging

import duckdb

from jobs.store import connect, execute_listed, unreadable_part_message

log = logging.getLogger(__name__)

# per request (its n samples together): failed if a sample erred, else cancelled if one was cancelled
REQUEST_OUTCOMES_SQL = """
SELECT job_id, request_id,
    CASE WHEN bool_or(finish_reason = 'error') THEN 'failed'
         WHEN bool_or(finish_reason = 'cancelled') THEN 'cancelled'
         ELSE 'completed' END AS outcome
FROM outputs {where} GROUP BY job_id, request_id
"""
OUTCOMES = ("completed", "failed", "cancelled")
_COUNTS_SQL = """
SELECT job_id,
    count(*) FILTER (WHERE outcome = 'completed') AS completed,
    count(*) FILTER (WHERE outcome = 'failed') AS failed,
    count(*) FILTER (WHERE outcome = 'cancelled') AS cancelled
FROM (""" + REQUEST_OUTCOMES_SQL + """) GROUP BY job_id
"""


def fetch_rows(con, sql: str, params: list | None = None, job_id: str | None = None) -> list[dict]:
    """A query's rows as dicts, over a listing of the store's files made for it and made again when a
    part it listed was deleted before it was read (`jobs.store.execute_listed`). `job_id`: the answer
    depends on that job's rows alone (only its parts are listed for the query)."""
    names, rows = execute_listed(con, sql, params, job_id=job_id)
    return [dict(zip(names, row, strict=True)) for row in rows]


def request_counts(total: int, counts: dict | None, unknown: bool = False) -> dict:
    """OpenAI Batch's request_counts; None for the outcomes when the outputs could not be read."""
    counts = counts or {}
    return {"total": total, **{k: None if unknown else counts.get(k, 0) for k in OUTCOMES}}


def job_counts(data_dir: str, jobs: list[dict], unreadable: str | None = None) -> dict[str, dict] | None:
    """job_id -> {completed, failed, cancelled} for `jobs` (rows of the `jobs` view): from the winning
    commits' counts, or from the outputs (a connection of its own) for a job whose commits predate
    them. None (with a warning naming the file) when the outputs are unreadable: `unreadable` is
    `connect_reporting`'s message for them, else a failed count says so."""
    if unreadable:
        log.warning("request counts unknown: %s", unreadable)
        return None
    counts = {job["job_id"]: {outcome: job[f"requests_{outcome}"] or 0 for outcome in OUTCOMES}
              for job in jobs}
    legacy = sorted(job["job_id"] for job in jobs if not job["counts_complete"])
    if legacy:
        con = connect(data_dir)
        try:
            found = fetch_counts(con, "WHERE list_contains(?, job_id)", [legacy])
        finally:
            con.close()
        if found is None:
            return None
        for job_id in legacy:
            counts[job_id] = dict.fromkeys(OUTCOMES, 0)
        for row in found:
            counts[row["job_id"]] = {outcome: row[outcome] for outcome in OUTCOMES}
    return counts


def fetch_counts(con, where: str = "", params: list | None = None) -> list[dict] | None:
    """Request outcome counts per job, or None (with a warning naming the file) when the outputs are
    unreadable: the job and shard states still show."""
    try:
        return fetch_rows(con, _COUNTS_SQL.format(where=where), params)
    except duckdb.Error as exc:
        log.warning("request counts unknown: %s", unreadable_part_message(str(exc)))
        return None
