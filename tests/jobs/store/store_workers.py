"""Process bodies for the store's concurrency tests (spawned, so they live in an importable module).

- `write_job`: a writer that appends shard attempts (several parts each, some abandoned and
  retried) and iteration telemetry as fast as it can until a deadline.
- `read_loop`: a reader that runs every dashboard query in `jobs.store.queries` plus consistency
  checks in a loop, and reports errors and the answers it saw.
- `kill_mid_attempt`: a worker that writes part of an attempt and is SIGKILLed before commit.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from pathlib import Path

import duckdb

from engine.stats import IterationStats, RequestStats
from jobs.store.catalog import connect
from jobs.store.listing import LISTING_VARIABLE
from jobs.store.parts import Store
from jobs.store.queries import QUERIES
from jobs.store.schemas import JobRecord
from jobs.store.usersql import run_query

ROWS_PER_PART = 5
PARTS_PER_ATTEMPT = 3
ROWS_PER_SHARD = ROWS_PER_PART * PARTS_PER_ATTEMPT
MIN_SHARDS = 2  # a writer commits at least this many shards


def output_rows(job_id: str, shard: int, start: int, n: int) -> list[dict]:
    return [{"request_id": f"{shard}-{i}", "output_text": f"text {i}", "finish_reason": "stop",
             "prompt_tokens": 10, "output_tokens": 3, "error": None, "lang": "en", "row_no": i}
            for i in range(start, start + n)]


def timing_rows(shard: int, start: int, n: int) -> list[dict]:
    now = time.time()
    stats = RequestStats(now - 1, now - 0.9, now - 0.5, now, 0, 10, 3)
    return [{"request_id": f"{shard}-{i}", "finish_reason": "stop", **stats.as_row()}
            for i in range(start, start + n)]


def write_attempt(store: Store, job_id: str, shard: int, attempt: int, worker: str, *, commit: bool) -> None:
    att = store.begin_attempt(job_id, shard, attempt, worker, num_requests=ROWS_PER_SHARD)
    for p in range(PARTS_PER_ATTEMPT):
        start = p * ROWS_PER_PART
        att.add_outputs(output_rows(job_id, shard, start, ROWS_PER_PART))
        att.add_requests(timing_rows(shard, start, ROWS_PER_PART))
        att.flush()
    if commit:
        att.commit()


def write_job(data_dir: str, job_id: str, worker: str, deadline: float, result_path: str) -> None:
    """Write shards until the deadline, and at least MIN_SHARDS however late the process started (its
    imports take seconds on a loaded machine); every 4th shard is first abandoned (no commit), then
    retried."""
    store = Store(data_dir)
    store.record_job(JobRecord(job_id, "tiny", 0, 0, time.time()))
    shards = iterations = 0
    with store.telemetry_buffer(worker, flush_interval_s=0.05) as telemetry:
        while time.time() < deadline or shards < MIN_SHARDS:
            if shards % 4 == 3:
                write_attempt(store, job_id, shards, 1, worker, commit=False)
                write_attempt(store, job_id, shards, 2, worker, commit=True)
            else:
                write_attempt(store, job_id, shards, 1, worker, commit=True)
            shards += 1
            for _ in range(7):
                telemetry.append(IterationStats(worker, iterations, time.time(), 0.01, 3, 1, 3, 1, 2, 5, 2, 7,
                                                64, 8, 10, 100, 0, 1, 0, [job_id]))
                iterations += 1
    Path(result_path).write_text(json.dumps({"shards": shards, "iterations": iterations}))


CHECKS = {
    # every committed shard is seen whole: a seen commit implies all its parts are seen
    "partial_shards": f"SELECT count(*) FROM (SELECT job_id, shard_id, count(*) AS n FROM requests "
                      f"GROUP BY ALL HAVING n <> {ROWS_PER_SHARD})",
    "duplicate_outputs": "SELECT count(*) FROM (SELECT job_id, request_id FROM outputs GROUP BY ALL "
                         "HAVING count(*) > 1)",
    "outputs": "SELECT count(*) FROM outputs",
    "iterations": "SELECT count(*) FROM iterations",
}


def read_loop(data_dir: str, stop_path: str, result_path: str, compare_path: str | None = None) -> None:
    """Run every named query and the checks until stop_path exists; then one last pass.

    With compare_path (a JSON of check answers), every pass must give exactly those answers.
    """
    expected = json.loads(Path(compare_path).read_text()) if compare_path else None
    errors: list[str] = []
    passes = 0
    last: dict = {}
    con = connect(data_dir)
    Path(stop_path + ".ready").touch()
    while True:
        stopping = os.path.exists(stop_path)
        try:  # every other pass over the globs (a connection that pins no listing), the others as
            # run_query does, each query over a listing pinned for it
            last = _one_pass(con, errors, last, expected, pinned=passes % 2 == 0)
        except Exception:  # noqa: BLE001 - every reader error is what the test counts
            errors.append(traceback.format_exc())
        passes += 1
        if stopping:
            break
    con.close()
    Path(result_path).write_text(json.dumps({"errors": errors[:20], "n_errors": len(errors), "passes": passes,
                                             "last": last}))


def _one_pass(con, errors: list[str], last: dict, expected: dict | None, pinned: bool = True) -> dict:
    def rows(sql: str, params: dict | None = None) -> list:
        if pinned:
            return run_query(con, sql, params or None, timeout_s=60).rows
        con.execute(f"RESET VARIABLE {LISTING_VARIABLE}")
        for attempt in range(4):  # as run_query: again when a part listed was deleted before it was read
            try:
                return con.execute(sql, params or None).fetchall()
            except duckdb.IOException:
                if attempt == 3:
                    raise
                time.sleep(0.05)
        raise AssertionError("unreachable")

    job_ids = [r[0] for r in rows("SELECT job_id FROM jobs ORDER BY job_id")] or ["none"]
    for sql in QUERIES.values():
        rows(sql, {"job_id": job_ids[0]} if "$job_id" in sql else {})
    answers = {name: rows(sql)[0][0] for name, sql in CHECKS.items()}
    if answers["partial_shards"] or answers["duplicate_outputs"]:
        errors.append(f"inconsistent view: {answers}")
    for name in ("outputs", "iterations"):
        if answers[name] < last.get(name, 0):
            errors.append(f"{name} went down from {last[name]} to {answers[name]}")
    if expected is not None and answers != expected:
        errors.append(f"answers changed: {answers} != {expected}")
    return answers


def kill_mid_attempt(data_dir: str, job_id: str, shard: int) -> None:
    """Write two flushed parts of attempt 1 of a shard, then die by SIGKILL before commit."""
    store = Store(data_dir)
    att = store.begin_attempt(job_id, shard, 1, "doomed-worker", num_requests=ROWS_PER_SHARD)
    for p in range(2):
        att.add_outputs(output_rows(job_id, shard, p * ROWS_PER_PART, ROWS_PER_PART))
        att.add_requests(timing_rows(shard, p * ROWS_PER_PART, ROWS_PER_PART))
        att.flush()
    # a third part left half-written under its temporary name, as a crash mid-write would
    (store.layout.tmp / "deadbeef.partial.parquet.tmp").write_bytes(b"PAR1 half a file")
    os.kill(os.getpid(), signal.SIGKILL)
