"""The views: empty data dirs, any cwd, commit rules, status derivation, schema version, catalog."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jobs.store.catalog import USER_VIEWS, connect, write_catalog
from jobs.store.layout import SCHEMA_VERSION, StoreError
from jobs.store.parts import ShardAttempt, Store
from jobs.store.schemas import JobRecord, ShardEvent


def _output(i) -> dict:
    return {"request_id": i, "output_text": "o", "finish_reason": "stop", "prompt_tokens": 1,
            "output_tokens": 1, "error": None}


def _one(con, sql: str, params=None):
    return con.execute(sql, params).fetchall() if params else con.execute(sql).fetchall()


def _commit_shard(store: Store, job_id: str, shard: int, attempt: int = 1, worker: str = "w", n: int = 2):
    att = store.begin_attempt(job_id, shard, attempt, worker)
    att.add_outputs([_output(f"{shard}-{i}") for i in range(n)])
    return att.commit()


def test_views_on_an_empty_data_dir_have_zero_rows(tmp_path):
    con = connect(tmp_path)
    for view in USER_VIEWS:
        assert _one(con, f"SELECT count(*) FROM {view}") == [(0,)], view
    cols = {v: [d[0] for d in con.execute(f"SELECT * FROM {v} LIMIT 0").description] for v in USER_VIEWS}
    assert cols["jobs"][:10] == ["job_id", "status", "model", "num_requests", "num_shards", "submitted_at",
                                 "started_at", "finished_at", "config", "output_path"]
    assert cols["shards"][:8] == ["job_id", "shard_id", "status", "attempts", "worker_id", "num_requests",
                                  "started_at", "finished_at"]
    assert set(cols["requests"]) >= {"job_id", "shard_id", "request_id", "worker_id", "prompt_tokens",
                                     "output_tokens", "finish_reason", "arrival_ts", "scheduled_ts",
                                     "first_token_ts", "finished_ts", "queue_s", "ttft_s", "e2e_s", "tpot_s",
                                     "num_preemptions"}
    assert "job_ids" in cols["iterations"] and "kv_blocks_total" in cols["iterations"]
    assert cols["sweeps"][:3] == ["sweep_id", "ts", "model"]


def test_missing_data_dir_is_an_error_for_readers(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        connect(tmp_path / "nope")


def test_views_work_from_any_working_directory(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    _commit_shard(Store(data_dir), "job-1", 0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)
    con = connect("data")  # relative: resolved once, when the connection is made
    monkeypatch.chdir(elsewhere)
    assert _one(con, "SELECT count(*) FROM outputs") == [(2,)]


def _catalog_count(catalog: Path, cwd: Path | str, setup: str = "") -> str:
    """count(*) of outputs through the catalog file, read by a fresh process (a user's duckdb)."""
    script = ("import duckdb, sys; c = duckdb.connect(sys.argv[1], read_only=True); "
              f"{setup}print(c.execute('SELECT count(*) FROM outputs').fetchall()[0][0])")
    out = subprocess.run([sys.executable, "-c", script, str(catalog)], cwd=cwd, capture_output=True,
                         text=True)
    return out.stdout.strip() if out.returncode == 0 else out.stderr.strip().splitlines()[-1]


def test_the_catalog_file_is_portable_and_shows_only_the_user_views(tmp_path):
    data_dir = tmp_path / "data"
    _commit_shard(Store(data_dir), "job-1", 0)
    assert write_catalog(data_dir)
    # its views read paths relative to the data dir: opened from there, or with file_search_path
    assert _catalog_count(data_dir / "batchgen.duckdb", data_dir) == "2"
    search = f"c.execute(\"SET file_search_path='{data_dir}'\"); "
    assert _catalog_count(data_dir / "batchgen.duckdb", "/", search) == "2"
    # a copy reads its own files: more rows in the copy, then the original gone
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    _commit_shard(Store(copy), "job-2", 0)
    shutil.rmtree(data_dir)
    assert _catalog_count(copy / "batchgen.duckdb", copy) == "4"
    con = duckdb.connect(str(copy / "batchgen.duckdb"), read_only=True)
    shown = {r[0] for r in con.execute("SHOW TABLES").fetchall()}
    internal = {r[0] for r in con.execute(
        "SELECT view_name FROM duckdb_views() WHERE schema_name = '_bg'").fetchall()}
    con.close()
    assert shown == set(USER_VIEWS), "internal views live in the _bg schema"
    assert {"winners", "scan_outputs", "job_shards"} <= internal


def test_two_commits_of_one_shard_count_once_and_the_first_wins(tmp_path):
    store = Store(tmp_path)
    late = store.begin_attempt("job-r", 0, 1, "slow")
    early = store.begin_attempt("job-r", 0, 2, "fast")
    early.add_outputs([_output("a"), _output("b")])
    late.add_outputs([_output("a"), _output("b"), _output("c")])  # a different row count, to tell them apart
    early.commit()
    con = connect(tmp_path)
    assert _one(con, "SELECT count(*) FROM outputs") == [(2,)]
    late.commit()  # the race: both commit
    for _ in range(2):  # same answer on every query and every connection
        con = connect(tmp_path)
        assert _one(con, "SELECT count(*) FROM outputs") == [(2,)]
        assert _one(con, "SELECT status, worker_id, committed_attempt, rows_done FROM shards") == [
            ("completed", "fast", 2, 2)]


def test_shard_and_job_status_derivation(tmp_path):
    store = Store(tmp_path)
    t = time.time()
    store.record_job(JobRecord("job-s", "tiny", 8, 4, t))
    store.record_shard_events([ShardEvent("job-s", s, "queued", t, num_requests=2) for s in range(4)])
    con = connect(tmp_path)
    status = lambda: dict(_one(con, "SELECT shard_id, status FROM shards WHERE job_id = 'job-s'"))
    job = lambda: _one(con, "SELECT status, shards_completed, shards_failed, rows_done FROM jobs")[0]
    assert status() == {0: "queued", 1: "queued", 2: "queued", 3: "queued"} and job()[0] == "queued"

    _commit_shard(store, "job-s", 0)
    failing = store.begin_attempt("job-s", 1, 1, "w")
    running = store.begin_attempt("job-s", 2, 1, "w")
    assert status() == {0: "completed", 1: "running", 2: "running", 3: "queued"}
    assert job() == ("running", 1, 0, 2)

    failing.fail("CUDA error")
    store.record_shard_events([ShardEvent("job-s", 1, "queued", time.time(), attempt=2)])  # a retry
    assert status()[1] == "queued"
    retry = store.begin_attempt("job-s", 1, 2, "w2")
    retry.fail("CUDA error again")
    # a zombie from attempt 1 reporting late does not override attempt 2
    store.record_shard_events([ShardEvent("job-s", 1, "running", time.time(), attempt=1, worker_id="zombie")])
    assert _one(con, "SELECT status, attempts, error FROM shards WHERE shard_id = 1") == [
        ("failed", 2, "CUDA error again")]

    running.commit()
    _commit_shard(store, "job-s", 3)
    assert job()[:3] == ("failed", 3, 1)
    [(finished, started)] = _one(con, "SELECT finished_at, started_at FROM jobs")
    assert finished is not None and started is not None and finished >= started


def test_cancel_marks_unfinished_shards_cancelled(tmp_path):
    store = Store(tmp_path)
    store.record_job(JobRecord("job-c", "tiny", 6, 3, time.time()))
    _commit_shard(store, "job-c", 0)
    store.begin_attempt("job-c", 1, 1, "w")
    store.request_cancel("job-c", reason="user asked")
    con = connect(tmp_path)
    assert dict(_one(con, "SELECT shard_id, status FROM shards")) == {0: "completed", 1: "cancelled",
                                                                      2: "cancelled"}
    [(status, error, finished)] = _one(con, "SELECT status, error, finished_at FROM jobs")
    assert (status, error) == ("cancelled", "user asked") and finished is not None
    assert _one(con, "SELECT count(*) FROM outputs") == [(2,)]  # finished rows stay


def test_a_cancel_during_the_last_shards_ends_cancelled_one_after_the_end_does_not(tmp_path):
    store = Store(tmp_path)
    con = connect(tmp_path)
    store.record_job(JobRecord("job-late", "tiny", 4, 2, time.time()))
    _commit_shard(store, "job-late", 0)
    store.begin_attempt("job-late", 1, 1, "w")
    store.request_cancel("job-late", reason="user asked")
    time.sleep(0.01)
    _commit_shard(store, "job-late", 1)  # the running shard commits its rows (some marked cancelled)
    late = _one(con, "SELECT status, shards_completed FROM jobs WHERE job_id = 'job-late'")
    assert late == [("cancelled", 2)]

    store.record_job(JobRecord("job-done", "tiny", 2, 1, time.time()))
    _commit_shard(store, "job-done", 0)
    time.sleep(0.01)
    store.request_cancel("job-done", reason="too late")
    assert _one(con, "SELECT status FROM jobs WHERE job_id = 'job-done'") == [("completed",)]


def test_requests_live_shows_the_latest_uncommitted_attempt(tmp_path):
    store = Store(tmp_path)
    old = store.begin_attempt("job-l", 0, 1, "w")
    old.add_request("r1", "stop", _stats())
    old.flush()
    new = store.begin_attempt("job-l", 0, 2, "w")
    new.add_request("r1", "stop", _stats())
    new.add_request("r2", "stop", _stats())
    new.flush()
    con = connect(tmp_path)
    assert _one(con, "SELECT count(*) FROM requests") == [(0,)]
    assert _one(con, "SELECT attempt, count(*), bool_or(committed) FROM requests_live GROUP BY 1") == [
        (2, 2, False)]
    new.commit()
    assert _one(con, "SELECT attempt, count(*), bool_and(committed) FROM requests_live GROUP BY 1") == [
        (2, 2, True)]
    assert _one(con, "SELECT count(*) FROM requests") == [(2,)]


def _stats():
    from engine.stats import RequestStats

    return RequestStats(1.0, 1.1, 1.5, 2.0, 0, 3, 4)


def test_a_newer_schema_version_is_refused(tmp_path):
    store = Store(tmp_path)
    store.layout.version_file.write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(StoreError, match=r"written by a newer batchgen .*upgrade batchgen"):
        connect(tmp_path)
    with pytest.raises(StoreError, match="newer batchgen"):
        Store(tmp_path)


def test_an_older_schema_without_migration_says_what_to_do(tmp_path):
    store = Store(tmp_path)
    store.layout.version_file.write_text(json.dumps({"schema_version": 0}))
    with pytest.raises(StoreError, match=r"schema v0 .* no migration from it: read it with the batchgen"):
        connect(tmp_path)


def test_an_older_schema_with_a_migration_is_migrated(tmp_path, monkeypatch):
    from jobs.store import layout

    store = Store(tmp_path)
    store.layout.version_file.write_text(json.dumps({"schema_version": SCHEMA_VERSION - 1}))
    ran = []
    monkeypatch.setitem(layout.MIGRATIONS, SCHEMA_VERSION - 1, ran.append)
    connect(tmp_path)
    assert ran == [store.layout]
    assert json.loads(store.layout.version_file.read_text()) == {"schema_version": SCHEMA_VERSION}


def test_readers_never_open_the_catalog_file(tmp_path):
    """A user's duckdb session holding batchgen.duckdb must not stop batchgen's readers."""
    store = Store(tmp_path)
    _commit_shard(store, "job-h", 0)
    assert write_catalog(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
         "print('held', flush=True); time.sleep(30)", str(store.layout.catalog)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(duckdb.IOException):  # the lock the holder takes
            duckdb.connect(str(store.layout.catalog), read_only=True)
        assert _one(connect(tmp_path), "SELECT count(*) FROM outputs") == [(2,)]
        assert write_catalog(tmp_path) is False  # skipped while held, not an error
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_catalog_records_the_schema_version(tmp_path):
    Store(tmp_path)
    assert write_catalog(tmp_path)
    con = duckdb.connect(str(tmp_path / "batchgen.duckdb"), read_only=True)
    assert _one(con, "SELECT schema_version FROM _bg.meta") == [(SCHEMA_VERSION,)]  # and no data dir
    names = {r[0] for r in _one(con, "SELECT view_name FROM duckdb_views() WHERE NOT internal")}
    assert set(USER_VIEWS) <= names
    con.close()


def test_attempt_objects_can_be_built_without_a_running_event(tmp_path):
    # ShardAttempt is public: a caller may build one directly (no "running" event is written then)
    store = Store(tmp_path)
    att = ShardAttempt(store, "job-d", 0, 1, "w")
    att.add_outputs([_output(1)])
    att.commit()
    con = connect(tmp_path)
    assert _one(con, "SELECT status, attempts FROM shards") == [("completed", 1)]


# The straightforward definition of the shard event aggregate (one aggregate over every event), which
# catalog._SHARD_EVENT_AGG computes in two halves for speed
_REFERENCE_EVENT_AGG = """
SELECT job_id, shard_id,
    arg_max(event, (attempt, ts, rank)) AS last_event,
    arg_max(error, (attempt, ts, rank)) AS last_error,
    arg_max(ts, (attempt, ts, rank)) AS last_ts,
    arg_max(worker_id, (attempt, ts)) FILTER (WHERE event = 'running') AS last_worker,
    greatest(count(DISTINCT nullif(_bg_attempt_id, '')) FILTER (WHERE event = 'running'),
             count(DISTINCT attempt) FILTER (WHERE event = 'running')) AS attempts_started,
    max(num_requests) AS num_requests,
    min(ts) FILTER (WHERE event = 'running') AS first_running_ts
FROM (SELECT *, CASE event WHEN 'queued' THEN 0 WHEN 'running' THEN 1 ELSE 2 END AS rank
      FROM _bg.scan_shard_events)
GROUP BY job_id, shard_id
"""

def _shard_events_table(events) -> duckdb.DuckDBPyConnection:
    """A connection whose `_bg.scan_shard_events` holds `events`: (job, shard, (event, attempt, ts,
    error, attempt id, num_requests)), the first of each (job, shard, ts) only (arg_max of a tie in a
    key may take either)."""
    con = duckdb.connect()
    con.execute("CREATE SCHEMA _bg")
    con.execute("CREATE TABLE _bg.scan_shard_events (job_id VARCHAR, shard_id INTEGER, event VARCHAR, "
                "attempt INTEGER, ts DOUBLE, error VARCHAR, worker_id VARCHAR, _bg_attempt_id VARCHAR, "
                "num_requests INTEGER)")
    seen, rows = set(), []
    for job, shard, (event, attempt, ts, error, attempt_id, num_requests) in events:
        if (job, shard, ts) not in seen:
            seen.add((job, shard, ts))
            rows.append((job, shard, event, attempt, float(ts), error, f"w{attempt}", attempt_id,
                         num_requests))
    if rows:
        con.executemany("INSERT INTO _bg.scan_shard_events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    return con


_EVENTS = ["queued", "running", "completed", "failed", "cancelled"]
_EVENT = st.tuples(st.integers(0, 3), st.sampled_from(_EVENTS),
                   st.integers(0, 3), st.integers(0, 30), st.sampled_from([None, "boom", "stop"]),
                   st.sampled_from(["", "a1", "a2"]), st.sampled_from([None, 3, 5]))


@given(st.lists(_EVENT, max_size=30))
@example([(0, "cancelled", 0, 5, None, "", None), (0, "queued", 0, 10, None, "", None)])  # queued again
@example([(1, "running", 1, 3, None, "a1", 5), (1, "failed", 1, 4, "boom", "a1", None),
          (1, "queued", 2, 6, None, "", None), (2, "cancelled", 0, 2, "stop", "", None)])
@example([(0, "queued", 0, 2, "boom", "", None), (0, "queued", 1, 1, None, "", None)])  # arg_max skips NULL
@settings(max_examples=80, deadline=None)
def test_the_shard_event_aggregate_equals_one_aggregate_over_every_event(events):
    """Every shard's first `queued` event (attempt 0) is aggregated apart from the others: the result
    is the one aggregate's, ties in a key aside (the events here have distinct times per shard)."""
    from jobs.store import catalog

    submitted = [("j", shard, ("queued", 0, -1, None, "", 7)) for shard in range(4)]  # submit's, first
    con = _shard_events_table(submitted + [("j", e[0], (e[1], e[2], e[3], e[4], e[5], e[6])) for e in events])
    got = sorted(con.execute(catalog._SHARD_EVENT_AGG).fetchall(), key=repr)
    assert got == sorted(con.execute(_REFERENCE_EVENT_AGG).fetchall(), key=repr)


# a shard's commit: (job, shard, committed_ts, counts known); a job: (num_shards, cancel ts or None)
_COMMIT = st.tuples(st.sampled_from(["j", "k"]), st.integers(0, 5), st.integers(0, 40), st.booleans())
_JOB = st.tuples(st.sampled_from(["j", "k", "m"]), st.integers(0, 4), st.sampled_from([None, 12, 35]))


@given(st.lists(st.tuples(st.sampled_from(["j", "k"]), _EVENT), max_size=30),
       st.lists(_COMMIT, max_size=8), st.lists(_JOB, max_size=3))
@example([("j", (1, "running", 1, 3, "boom", "a1", 5)), ("j", (1, "failed", 1, 4, "boom", "a1", None))],
         [("j", 0, 9, True), ("k", 5, 2, False)], [("j", 3, 20), ("k", 2, None)])  # a failed shard's error
# a commit that names no worker: the one of its events counts
@example([("j", (2, "running", 1, 3, None, "a1", 5))], [("j", 2, 9, True)], [("j", 3, None)])
@settings(max_examples=80, deadline=None)
def test_the_jobs_shard_counts_and_the_uncommitted_shards_are_those_of_the_shards_view(events, commits, jobs):
    """`_bg.job_shards` counts a job's shards without a row per committed shard, from rows of the
    shards without a winning commit only (`u` of its CTES, which `status JOB` lists too): both answer
    as the `shards` view's rows do (`_JOB_SHARDS` over them; those not 'completed'; the counts by
    state of `_bg.shard_status_counts`), on shards
    committed, evented or neither, inside and outside their job's shard range, with and without a
    cancel."""
    from jobs.store import catalog

    con = _shard_events_table([(job, e[0], e[1:]) for job, e in events])
    con.execute("CREATE TABLE _bg.winners (job_id VARCHAR, shard_id INTEGER, worker_id VARCHAR, "
                "num_outputs BIGINT, committed_ts DOUBLE, prompt_tokens BIGINT, output_tokens BIGINT, "
                "attempt INTEGER, requests_completed BIGINT, requests_failed BIGINT, "
                "requests_cancelled BIGINT, error_rows BIGINT)")
    winners = {(job, shard): (ts, counted) for job, shard, ts, counted in commits}  # one per shard
    for (job, shard), (ts, counted) in winners.items():
        n = shard + 2
        worker = None if shard % 3 == 2 else "w9"  # a commit that names no worker: its events' last does
        con.execute("INSERT INTO _bg.winners VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?)",
                    [job, shard, worker, n, float(ts), 3 * n, 2 * n]
                    + ([n - 1, 1, 0, 1] if counted else [None] * 4))
    con.execute("CREATE TABLE _bg.job_records (job_id VARCHAR, num_shards INTEGER)")
    con.execute("CREATE TABLE _bg.cancels (job_id VARCHAR, cancel_ts DOUBLE, cancel_reason VARCHAR)")
    for job, num_shards, cancel_ts in {job[0]: job for job in jobs}.values():
        con.execute("INSERT INTO _bg.job_records VALUES (?, ?)", [job, num_shards])
        if cancel_ts is not None:
            con.execute("INSERT INTO _bg.cancels VALUES (?, ?, 'stop')", [job, float(cancel_ts)])
    views = dict(catalog.view_definitions(catalog.Layout(Path("/"))))
    for name in ("_bg.shard_event_agg", "shards", "_bg.job_shards", "_bg.shard_status_counts"):
        con.execute(f"CREATE VIEW {name} AS {views[name]}")

    reference = con.execute(f"{catalog._JOB_SHARDS.format(shards='shards')} ORDER BY job_id").fetchall()
    assert con.execute("SELECT * FROM _bg.job_shards ORDER BY job_id").fetchall() == reference
    assert (con.execute(f"WITH {catalog.JOB_SHARDS_CTES} SELECT * FROM u ORDER BY ALL").fetchall()
            == con.execute("SELECT * FROM shards WHERE status <> 'completed' ORDER BY ALL").fetchall())
    counts = "SELECT job_id, status, count(*) FROM shards GROUP BY ALL ORDER BY ALL"
    assert (con.execute("SELECT * FROM _bg.shard_status_counts ORDER BY ALL").fetchall()
            == con.execute(counts).fetchall())
    # a page of a job's shards (`SHARDS_PAGE`) is that of the `shards` view's rows
    page = f"SELECT * FROM ({catalog.SHARDS_PAGE}) ORDER BY {catalog.SHARDS_PAGE_ORDER}"
    of_view = (f"SELECT * FROM shards WHERE job_id = $job_id AND ($status IS NULL OR status = $status) "
               f"ORDER BY {catalog.SHARDS_PAGE_ORDER} LIMIT $limit OFFSET $offset")
    for job, status, offset in (("j", None, 0), ("j", None, 2), ("k", None, 0), ("j", "completed", 1),
                                ("k", "queued", 0), ("j", "failed", 0)):
        params = {"job_id": job, "status": status, "limit": 3, "offset": offset}
        assert con.execute(page, params).fetchall() == con.execute(of_view, params).fetchall()
    # and the workers that ran a job's shards (`SHARD_WORKERS`)
    workers = ("SELECT DISTINCT worker_id FROM shards WHERE job_id = $job_id AND worker_id IS NOT NULL "
               "ORDER BY worker_id LIMIT $limit")
    for job in ("j", "k"):
        params = {"job_id": job, "limit": 5}
        assert (con.execute(catalog.SHARD_WORKERS, params).fetchall()
                == con.execute(workers, params).fetchall())
    # and each worker's latest started shard's job (`WORKER_LATEST_SHARDS`)
    latest = ("SELECT worker_id, arg_max(job_id, (started_at, job_id)), max(started_at) FROM shards "
              "WHERE worker_id IS NOT NULL AND started_at IS NOT NULL GROUP BY worker_id ORDER BY ALL")
    assert (con.execute(f"SELECT * FROM ({catalog.WORKER_LATEST_SHARDS}) ORDER BY ALL").fetchall()
            == con.execute(latest).fetchall())
