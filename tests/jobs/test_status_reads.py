"""What `batchgen status` reads: the scans, with the views above them inlined (catalog.over_scans), the
`shards` rows once per answer, over one listing, with the answers of the `jobs` view (jobs.status,
catalog.jobs_over)."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from jobs.cli import cli
from jobs.manifest import load_manifest
from jobs.store import Store, connect, jobs_over, over_scans
from tests.jobs.helpers import MODEL
from tests.jobs.store.test_store_disjoint import compaction_killed_before_its_tombstone
from tests.jobs.store.test_store_job_counts import JOB, OTHER, make_jobs


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """Two submitted jobs of 4 shards: one with a committed, a failed, a running and a queued shard,
    the other cancelled after one commit."""
    root = tmp_path_factory.mktemp("status-reads")
    data, src = root / "data", root / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(8)]}), src)
    ids = []
    for queue in ("q.one", "q.two"):
        sub = CliRunner().invoke(cli, ["submit", str(src), "--model", MODEL, "--data-dir", str(data),
                                       "--shard-size", "2", "--queue", queue])
        assert sub.exit_code == 0, sub.output
        ids.append(sub.output.strip().splitlines()[-1])
    store = Store(data)
    rows = [{"request_id": str(i), "output_text": "o", "finish_reason": "stop", "prompt_tokens": 3,
             "output_tokens": 2, "error": None} for i in range(2)]
    for job_id in ids:
        att = store.begin_attempt(job_id, 0, 1, "w1", num_requests=2)
        att.add_outputs(rows)
        att.commit()
    store.begin_attempt(ids[0], 1, 1, "w1", num_requests=2).fail("engine died")
    store.begin_attempt(ids[0], 2, 1, "w2", num_requests=2).add_outputs(rows[:1])
    CliRunner().invoke(cli, ["cancel", ids[1], "--data-dir", str(data)])
    time.sleep(0.01)
    return data, ids


def test_status_creates_only_the_scans_it_reads(two_jobs, monkeypatch):
    """Creating a view binds it, and each view over others binds them again: `status` creates the scans
    it reads and the outputs' (for unreadable outputs), its queries inline the views above them, and
    the `jobs` rows are computed from the shards. Over a listing that holds each part once, only the
    listed catalog's scans are made (the default catalog's wait for a listing that needs them)."""
    from jobs.status import job_status, jobs_status
    from jobs.store import catalog

    data, ids = two_jobs
    real, bound = catalog._create_view_set, []

    def create_view_set(con, layout, relative_to=None, views=None, **kwargs):
        bound.append((kwargs.get("pinned", False), catalog._with_dependencies(views)))
        return real(con, layout, relative_to, views, **kwargs)

    monkeypatch.setattr(catalog, "_create_view_set", create_view_set)
    every = {r["job_id"]: r for r in jobs_status(str(data))}
    one = job_status(load_manifest(str(data), ids[0]), all_shards=False)
    assert bound == [(True, {"_bg.scan_job_records", "_bg.scan_job_events", "_bg.scan_shard_events",
                             "_bg.scan_commits", "_bg.scan_outputs"})] * 2
    assert (every[ids[0]]["status"], every[ids[1]]["status"]) == ("running", "cancelled")
    assert one["shard_counts"] == {"queued": 1, "running": 1, "completed": 1, "failed": 1, "cancelled": 0,
                                   "total": 4}


def test_status_makes_the_default_catalogs_scans_when_a_listing_needs_them(two_jobs, monkeypatch):
    """A listing that may hold a part twice (a compactor died between its rename and its tombstone)
    is read in the default catalog: a `status` connection that left its scans for later makes them
    then, and answers as a full connection does."""
    import shutil

    import duckdb

    from jobs.store import JOBS_SELECT, STATUS_BINDS, catalog, connect_reporting, run_listed
    from jobs.store.listing import LISTING_VARIABLE

    data, ids = two_jobs
    copy = data.parent / "deferred"
    shutil.copytree(data, copy)
    con, broken = connect_reporting(copy, views=STATUS_BINDS, defer_default=True)
    try:
        assert broken == {}
        assert not con.execute("SELECT count(*) FROM duckdb_views() WHERE database_name = 'memory' "
                               "AND view_name = 'scan_commits'").fetchone()[0]

        compaction_killed_before_its_tombstone(monkeypatch, Store(copy).layout, "shard_events", ids[0])

        def jobs(c: duckdb.DuckDBPyConnection) -> tuple:
            assert c.execute("SELECT current_database()").fetchone()[0] == "memory"
            return sorted(c.execute(over_scans(JOBS_SELECT, once=True)).fetchall(), key=repr)

        found = run_listed(con, jobs)
        full = connect(copy)
        try:
            full.execute(f"RESET VARIABLE {LISTING_VARIABLE}")
            assert found == sorted(full.execute(over_scans(JOBS_SELECT, once=True)).fetchall(), key=repr)
        finally:
            full.close()
        assert con.execute("SELECT count(*) FROM duckdb_views() WHERE database_name = 'memory' "
                           "AND view_name = 'scan_commits'").fetchone()[0] == 1
        databases = {r[0] for r in con.execute("SELECT database_name FROM duckdb_databases()").fetchall()}
        assert catalog.LISTED_CATALOG in databases
    finally:
        con.close()


def test_deferred_scans_that_met_a_deleted_part_are_made_again_on_the_next_try(two_jobs, monkeypatch):
    """Making the default catalog's scans can meet a part deleted after its listing on every one of its
    BIND_TRIES: the query's next try (run_listed lists anew) makes them again, not a catalog without
    them."""
    import shutil

    import duckdb

    from jobs.store import JOBS_SELECT, STATUS_BINDS, catalog, connect_reporting, run_listed

    data, ids = two_jobs
    copy = data.parent / "deferred-retried"
    shutil.copytree(data, copy)
    con, _ = connect_reporting(copy, views=STATUS_BINDS, defer_default=True)
    try:
        compaction_killed_before_its_tombstone(monkeypatch, Store(copy).layout, "shard_events", ids[0])
        real, calls = catalog.create_views, []

        def flaky(*args, **kwargs):
            calls.append(1)
            if len(calls) <= catalog.BIND_TRIES:
                raise duckdb.IOException('IO Error: Cannot open file "gone.parquet": No such file')
            return real(*args, **kwargs)

        monkeypatch.setattr(catalog, "create_views", flaky)
        rows = run_listed(con, lambda c: c.execute(over_scans(JOBS_SELECT, once=True)).fetchall())
        assert len(rows) == 2 and len(calls) == catalog.BIND_TRIES + 1
    finally:
        con.close()


def test_status_over_an_unreadable_outputs_part_makes_both_catalogs_and_says_so(two_jobs):
    """Binding the listed scans over the first listing met the bad part: the connection is made the
    usual way, which reports the outputs unreadable (status then leaves the request counts unknown)."""
    import shutil

    from jobs.store import STATUS_BINDS, connect_reporting

    data, ids = two_jobs
    copy = data.parent / "bad-outputs"
    shutil.copytree(data, copy)
    [part, *_] = sorted((copy / "store" / "tables" / "outputs" / "raw").glob("*/*.parquet"))
    part.write_bytes(b"not parquet")
    con, broken = connect_reporting(copy, views=STATUS_BINDS, defer_default=True)
    try:
        assert set(broken) == {"outputs"} and part.name in broken["outputs"]
        assert con.execute("SELECT count(*) FROM duckdb_views() WHERE database_name = 'memory' "
                           "AND view_name = 'scan_commits'").fetchone()[0] == 1
    finally:
        con.close()


def test_status_of_one_job_lists_its_parts_once(two_jobs, monkeypatch):
    """`status JOB`'s job row, shard counts and listed shards come from one read of its shards over one
    listing of its parts, so they agree with each other however the store moves meanwhile."""
    from jobs.status import job_status
    from jobs.store import listing

    data, ids = two_jobs
    scopes, real = [], listing.list_files
    monkeypatch.setattr(listing, "list_files",
                        lambda layout, job_id=None: scopes.append(job_id) or real(layout, job_id))
    for all_shards in (False, True):
        scopes.clear()
        info = job_status(load_manifest(str(data), ids[0]), all_shards=all_shards)
        assert scopes.count(ids[0]) == 1, scopes
        assert info["shards_completed"] == info["shard_counts"]["completed"] == 1


def _one_jobs_row_each(con, job_ids: list[str]) -> dict[str, tuple]:
    out = {}
    for job_id in job_ids:
        con.execute("CREATE OR REPLACE TEMP TABLE one_job AS SELECT * FROM shards WHERE job_id = ?", [job_id])
        out[job_id] = con.execute(f"SELECT * FROM ({jobs_over('one_job')}) WHERE job_id = ?",
                                  [job_id]).fetchall()
    return out


def test_the_jobs_row_from_one_jobs_shards_is_the_views(two_jobs, tmp_path):
    """`jobs_over` a table of one job's `shards` rows gives that job's `jobs` row, column for column, on
    jobs whose shards take every path (duplicate and revoked commits, retries, failures, a cancel)."""
    make_jobs(tmp_path)
    for data, ids in ((two_jobs[0], two_jobs[1]), (tmp_path, [JOB, OTHER])):
        con = connect(data)
        try:
            view = {job_id: con.execute("SELECT * FROM jobs WHERE job_id = ?", [job_id]).fetchall()
                    for job_id in ids}
            assert all(len(rows) == 1 for rows in view.values())
            assert _one_jobs_row_each(con, ids) == view
            every = con.execute(f"SELECT * FROM ({jobs_over('shards')}) ORDER BY job_id").fetchall()
            assert every == con.execute("SELECT * FROM jobs ORDER BY job_id").fetchall()
        finally:
            con.close()


def test_a_select_over_the_scans_answers_as_over_the_views(two_jobs, tmp_path):
    """`over_scans` inlines the views above the scans: on a connection of the scans alone, the shards
    and the jobs rows are the views'."""
    from jobs.store import STATUS_BINDS

    make_jobs(tmp_path)
    for data in (two_jobs[0], tmp_path):
        views, scans = connect(data), connect(data, views=STATUS_BINDS)
        try:
            for select, view in ((jobs_over("_bg_shards"), "jobs"), ("SELECT * FROM _bg_shards", "shards"),
                                 ("SELECT * FROM _bg.winners", "_bg.winners")):
                got = scans.execute(f"{over_scans(select)} ORDER BY ALL").fetchall()
                assert got and got == views.execute(f"SELECT * FROM {view} ORDER BY ALL").fetchall()
        finally:
            views.close()
            scans.close()


def test_status_of_one_job_counts_and_lists_as_from_every_shard(two_jobs):
    """`status JOB` without --shards makes rows of the shards without a winning commit only and counts
    the committed ones from the commits: its job row, counts and listed shards are those that every
    shard's row gives (a committed, a failed, a running and a queued shard; a cancelled job)."""
    from jobs.status import LISTED_STATES, job_status

    data, ids = two_jobs
    for job_id in ids:
        manifest = load_manifest(str(data), job_id)
        every, listed = job_status(manifest, all_shards=True), job_status(manifest, all_shards=False)
        assert listed["shard_counts"] == every["shard_counts"]
        assert ({k: v for k, v in listed.items() if k not in ("shards", "all_shards")}
                == {k: v for k, v in every.items() if k not in ("shards", "all_shards")})
        assert listed["shards"] == [s for s in every["shards"] if s["status"] in LISTED_STATES]
        assert every["shard_counts"]["completed"] == 1


def test_jobs_over_takes_one_relation_or_one_select():
    with pytest.raises(ValueError, match="one of"):
        jobs_over()
    with pytest.raises(ValueError, match="one of"):
        jobs_over("shards", job_shards="SELECT * FROM job_shards")
