"""The listed catalog (jobs.store.catalog `_create_listed`): the same views, whose scans read a pinned
listing's files as they are. `over_listing` runs a query there only where the listing holds each part
of every kind in one file; there every view answers as the default catalog's do over the same listing,
and its scans refuse any other use rather than read a part twice."""

from __future__ import annotations

import time

import duckdb
import pytest

from engine.stats import IterationStats, RequestStats
from jobs.store import catalog, listing
from jobs.store.catalog import connect
from jobs.store.compact import collect_garbage, compact_job
from jobs.store.listing import (
    DEFAULT_CATALOG,
    LISTED_CATALOG,
    LISTING_VARIABLE,
    RENAMING_SUFFIX,
    list_files,
    over_listing,
    pin,
)
from jobs.store.parts import Store
from jobs.store.queries import QUERIES
from jobs.store.schemas import KINDS, JobRecord
from jobs.store.usersql import run_query
from tests.jobs.store.test_store_disjoint import compaction_killed_before_its_tombstone

VIEWS = ("jobs", "shards", "outputs", "requests", "requests_live", "iterations", "sweeps", "_bg.winners",
         "_bg.request_digests_live", "_bg.iteration_seconds", "_bg.shard_status_counts", "_bg.job_shards",
         "_bg.outputs_of_shards('job-a', 1, 2)")


@pytest.fixture(autouse=True)
def compacted_files_count_at_once(monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)


def _attempt(store: Store, job_id: str, shard: int, attempt: int, commit: bool = True):
    att = store.begin_attempt(job_id, shard, attempt, f"w{attempt}")
    for flush in range(2):
        for i in range(2):
            rid = f"{shard}-{flush}-{i}"
            att.add_outputs([{"request_id": rid, "output_text": f"a{attempt}", "finish_reason": "stop",
                              "prompt_tokens": 2, "output_tokens": 1 + i, "error": None}])
            att.add_request(rid, "stop", RequestStats(
                arrival_ts=1.0, scheduled_ts=1.5, first_token_ts=2.0 + i,
                finished_ts=3.0 + shard, prompt_tokens=2, output_tokens=1 + i, num_preemptions=i))
        att.flush()
    return att.commit() if commit else att


def _fill(store: Store) -> None:
    """Two jobs: one with a shard killed then committed by its retry, a commit revoked and a shard that
    never ran; one cancelled with a shard failed; and a worker's engine iterations."""
    now = time.time()
    store.record_job(JobRecord("job-a", "tiny", 16, 4, now))
    _attempt(store, "job-a", 0, 1)
    _attempt(store, "job-a", 1, 1, commit=False)
    _attempt(store, "job-a", 1, 2)
    store.revoke_commit(_attempt(store, "job-a", 2, 1), "a part was lost")
    store.record_job(JobRecord("job-b", "tiny", 8, 2, now + 1))
    _attempt(store, "job-b", 0, 1)
    _attempt(store, "job-b", 1, 1, commit=False).fail("out of memory")
    store.request_cancel("job-b", "not needed")
    buffer = store.telemetry_buffer("w1")
    buffer.extend(IterationStats(ts=now + i, num_running=1 + i % 3, decode_tokens=4, scheduled_tokens=8,
                                 token_budget=16, job_ids=["job-a"] if i % 2 else ["job-a", "job-b"])
                  for i in range(30))
    buffer.flush()


def _answers(con) -> dict:
    return {view: sorted(con.execute(f"SELECT * FROM {view}").fetchall(), key=repr) for view in VIEWS}


def _both(data_dir) -> tuple[dict, dict, str]:
    """Every view's rows over one listing: in the catalog `over_listing` chose, and in the default one."""
    con = connect(data_dir)
    try:
        with over_listing(con):
            chosen = con.execute("SELECT current_database()").fetchone()[0]
            found = _answers(con)
            con.execute(f"USE {DEFAULT_CATALOG}")
            default = _answers(con)
            con.execute(f"USE {chosen}")
        assert con.execute("SELECT current_database()").fetchone()[0] == DEFAULT_CATALOG  # back after
        return found, default, chosen
    finally:
        con.close()


def test_every_view_answers_alike_in_both_catalogs_raw_compacted_and_collected(tmp_path):
    store = Store(tmp_path)
    _fill(store)
    stages = []
    for step in (lambda: None, lambda: compact_job(tmp_path, "job-a", force=True),
                 lambda: collect_garbage(tmp_path, grace_s=0)):
        step()
        found, default, chosen = _both(tmp_path)
        assert chosen == LISTED_CATALOG and found == default
        stages.append(found)
    assert stages[0] == stages[1] == stages[2]
    answers = stages[0]
    assert len(answers["outputs"]) == 12 and len(answers["_bg.winners"]) == 3  # the revoked commit is out
    assert {r[1] for r in answers["jobs"]} == {"running", "cancelled"}
    assert answers["_bg.iteration_seconds"] and len(answers["iterations"]) == 30


def test_the_dashboards_queries_answer_alike_through_run_query(tmp_path):
    """run_query runs a query in the listed catalog; the default catalog over the same store agrees."""
    store = Store(tmp_path)
    _fill(store)
    con = connect(tmp_path)
    try:
        for name, sql in QUERIES.items():
            params = {"job_id": "job-a"} if "$job_id" in sql else None
            listed = run_query(con, sql, params).rows
            pin(con)  # the default catalog over a listing of the same store
            assert con.execute(sql, params).fetchall() == listed, name
    finally:
        con.close()


def test_a_listing_that_may_hold_a_part_twice_keeps_the_default_catalog(tmp_path, monkeypatch):
    """A compactor that died between its rename and its tombstone leaves an output beside its inputs:
    the query runs in the default catalog, which takes each part once; the listed catalog's scans
    refuse that listing rather than read both files."""
    store = Store(tmp_path)
    _fill(store)
    before, _, _ = _both(tmp_path)
    compaction_killed_before_its_tombstone(monkeypatch, store.layout, "outputs", "job-a")
    assert list(store.layout.gc.glob(f"*{RENAMING_SUFFIX}"))
    assert not list_files(store.layout).disjoint["outputs"]
    found, default, chosen = _both(tmp_path)
    assert chosen == DEFAULT_CATALOG and found == default == before
    con = connect(tmp_path)
    try:
        with over_listing(con):
            con.execute(f"USE {LISTED_CATALOG}")
            with pytest.raises(duckdb.InvalidInputException, match="no part of outputs is in two files"):
                con.execute("SELECT count(*) FROM outputs").fetchall()
            assert con.execute("SELECT count(*) FROM _bg.scan_commits").fetchone()[0] == 5  # disjoint
            con.execute(f"USE {DEFAULT_CATALOG}")
    finally:
        con.close()


def test_the_listed_views_answer_only_in_their_own_catalog(tmp_path):
    """Read from the default catalog (a user's `_bg_listed.main.jobs`), whose fences may be the query's
    time, or without a pinned listing, the listed catalog's scans refuse."""
    store = Store(tmp_path)
    _fill(store)
    con = connect(tmp_path)
    try:
        for pinned in (False, True):
            if pinned:
                pin(con)
            with pytest.raises(duckdb.InvalidInputException, match=LISTED_CATALOG):
                con.execute(f"SELECT count(*) FROM {LISTED_CATALOG}.main.outputs").fetchall()
        con.execute(f"RESET VARIABLE {LISTING_VARIABLE}")
        con.execute(f"USE {LISTED_CATALOG}")
        with pytest.raises(duckdb.InvalidInputException, match=LISTED_CATALOG):
            con.execute("SELECT count(*) FROM outputs").fetchall()
    finally:
        con.close()


def test_the_listed_catalog_reads_its_listing_at_any_age_fenced_at_the_listings_time(tmp_path):
    """A listing read in the listed catalog is a snapshot whatever its age (the default catalog reads
    the globs once it is older than MAX_AGE_S): a shard committed after it is neither half-seen nor
    counted, and a listing that names the shard's files, made at an earlier time, fences its commit
    out. After `over_listing`, the cursor's queries that pin nothing read the globs."""
    store = Store(tmp_path)
    _fill(store)
    con = connect(tmp_path)
    try:
        with over_listing(con) as found:
            _attempt(store, "job-a", 3, 1)
            time.sleep(listing.MAX_AGE_S + 0.2)
            assert con.execute("SELECT count(*) FROM _bg.winners").fetchone()[0] == 3
            assert con.execute("SELECT count(*) FROM outputs").fetchone()[0] == 12
            fenced = {**list_files(store.layout).variable(), "listed_at": found.listed_at}
            con.execute(f"SET VARIABLE {LISTING_VARIABLE} = $1", [fenced])
            assert con.execute("SELECT count(*) FROM _bg.winners").fetchone()[0] == 3
            con.execute(f"USE {DEFAULT_CATALOG}")
            assert con.execute("SELECT count(*) FROM _bg.winners").fetchone()[0] == 4  # the globs, now
            con.execute(f"USE {LISTED_CATALOG}")
        assert con.execute("SELECT count(*) FROM outputs").fetchone()[0] == 16
    finally:
        con.close()


def test_a_kind_unreadable_when_connecting_fails_alike_in_both_catalogs(tmp_path):
    store = Store(tmp_path)
    _fill(store)
    [part, *_] = sorted(store.layout.kind_dir("outputs").glob("raw/*/*.parquet"))
    part.write_bytes(b"not parquet")
    con = connect(tmp_path)
    try:
        errors = []
        for name in (LISTED_CATALOG, DEFAULT_CATALOG):
            with over_listing(con):
                con.execute(f"USE {name}")
                with pytest.raises(duckdb.Error) as caught:
                    con.execute("SELECT count(*) FROM outputs").fetchall()
                errors.append(str(caught.value))
                assert con.execute("SELECT count(*) FROM _bg.winners").fetchone()[0] == 3
                con.execute(f"USE {DEFAULT_CATALOG}")
        assert errors[0] == errors[1] and part.name in errors[0]
    finally:
        con.close()


def test_every_kind_is_disjoint_in_a_store_that_compaction_left_alone(tmp_path):
    """What makes the listed catalog the usual one: raw parts and finished compactions."""
    store = Store(tmp_path)
    _fill(store)
    assert all(list_files(store.layout).disjoint[kind] for kind in KINDS)
    assert all(listing.list_files(store.layout, "job-a").disjoint[kind] for kind in KINDS)
