"""A listing pinned for a query (jobs.store.listing): what it lists, the time it fences at, when it is
not used, and that the readers pin one before each query."""

from __future__ import annotations

import time

import duckdb
import pytest

from jobs.store import catalog, listing, run_query
from jobs.store.catalog import connect
from jobs.store.compact import compact_job
from jobs.store.listing import LISTING_VARIABLE, list_files, pin
from jobs.store.parts import Store
from jobs.store.schemas import KINDS, JobRecord


def _commit_shard(store: Store, job_id: str, shard: int, n: int = 2) -> None:
    att = store.begin_attempt(job_id, shard, 1, "w")
    att.add_outputs([{"request_id": f"{shard}-{i}", "output_text": "o", "finish_reason": "stop",
                      "prompt_tokens": 1, "output_tokens": 1, "error": None} for i in range(n)])
    att.commit()


def _rows(con) -> tuple:
    return (con.execute("SELECT count(*) FROM outputs").fetchone()[0],
            con.execute("SELECT shards_completed FROM jobs").fetchall())


def test_a_listing_names_what_the_glob_matches(tmp_path):
    store = Store(tmp_path)
    store.record_job(JobRecord("job-a", "tiny", 4, 2, time.time()))
    _commit_shard(store, "job-a", 0)
    (store.layout.kind_dir("outputs") / "raw" / "job-a" / "notes.txt").write_text("not a part")
    found = list_files(store.layout)
    assert set(found.files) == set(KINDS)
    for kind in KINDS:
        assert found.files[kind] == sorted(str(p) for p in store.layout.kind_dir(kind).rglob("*.parquet"))
    assert found.left_out == 0 and found.listed_at <= time.time()


def test_a_pinned_listing_is_a_snapshot_fenced_at_its_own_time(tmp_path):
    """Queries over a pinned listing see the store as it was listed: a shard committed after the listing
    (its parts and its commit landed later) is neither half-seen nor counted, until the next pin."""
    store = Store(tmp_path)
    store.record_job(JobRecord("job-s", "tiny", 4, 2, time.time()))
    _commit_shard(store, "job-s", 0)
    con = connect(tmp_path)
    pin(con)
    _commit_shard(store, "job-s", 1)
    assert _rows(con) == (2, [(1,)])  # the listing's store
    con.execute(f"RESET VARIABLE {LISTING_VARIABLE}")
    assert _rows(con) == (4, [(2,)])  # the globs list now
    pin(con)
    assert _rows(con) == (4, [(2,)])


def test_the_commit_fence_is_the_listing_time_not_the_query_start(tmp_path, monkeypatch):
    """A commit listed but made after the listing's time does not count over that listing: its parts
    may have been renamed in after the listing read their directory."""
    store = Store(tmp_path)
    store.record_job(JobRecord("job-f", "tiny", 2, 1, time.time()))
    con = connect(tmp_path)
    listed_at = time.time()
    _commit_shard(store, "job-f", 0)
    files = list_files(store.layout)
    assert any("commits" in p for p in files.files["commits"] if "/raw/" in p)
    con.execute(f"SET VARIABLE {LISTING_VARIABLE} = $1", [{**files.variable(), "listed_at": listed_at}])
    assert _rows(con) == (0, [(0,)])
    con.execute(f"SET VARIABLE {LISTING_VARIABLE} = $1", [files.variable()])
    assert _rows(con) == (2, [(1,)])


def test_a_listing_older_than_its_max_age_is_not_used(tmp_path):
    """A connection that pinned long ago reads the globs again (its listing could name deleted files)."""
    store = Store(tmp_path)
    store.record_job(JobRecord("job-o", "tiny", 2, 1, time.time()))
    _commit_shard(store, "job-o", 0)
    con = connect(tmp_path)
    schema_only = listing.Listing(0.0, {kind: [str(store.layout.kind_dir(kind) / "_schema.parquet")]
                                        for kind in KINDS}, 0).variable()
    con.execute(f"SET VARIABLE {LISTING_VARIABLE} = $1", [{**schema_only, "listed_at": time.time()}])
    assert _rows(con) == (0, [])  # a young listing is what the views read
    old = time.time() - listing.MAX_AGE_S - 1
    con.execute(f"SET VARIABLE {LISTING_VARIABLE} = $1", [{**schema_only, "listed_at": old}])
    assert _rows(con) == (2, [(1,)])  # an old one is not


def test_readers_pin_a_listing_before_each_query(tmp_path, monkeypatch):
    """run_query (the dashboard, `batchgen sql`) pins a listing on its cursor before each try; on a
    connection that is not a store's it pins nothing."""
    store = Store(tmp_path)
    store.record_job(JobRecord("job-r", "tiny", 2, 1, time.time()))
    _commit_shard(store, "job-r", 0)
    pins = []
    real_pin = listing.list_files
    monkeypatch.setattr(listing, "list_files",
                        lambda layout, job_id=None: pins.append(layout.root) or real_pin(layout, job_id))
    con = connect(tmp_path)
    pins.clear()
    cur = con.cursor()
    assert run_query(cur, "SELECT count(*) FROM outputs").rows == [(2,)]
    assert pins == [store.layout.root]
    value = cur.execute(f"SELECT getvariable('{LISTING_VARIABLE}')").fetchone()[0]
    assert value["outputs"] == list_files(store.layout).files["outputs"]
    plain = duckdb.connect()
    assert run_query(plain, "SELECT 1").rows == [(1,)] and len(pins) == 1
    assert listing.data_dir_of(plain) is None


def test_compaction_inputs_are_left_out_and_answers_stay_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)
    store = Store(tmp_path)
    store.record_job(JobRecord("job-c", "tiny", 8, 4, time.time()))
    for shard in range(4):
        _commit_shard(store, "job-c", shard)
    con = connect(tmp_path)
    pin(con)
    before = _rows(con)
    report = compact_job(tmp_path, "job-c")
    assert report.files_in > 4
    found = pin(con)
    assert found.left_out == report.files_in
    assert _rows(con) == before
    on_disk = sum(1 for _ in store.layout.store.joinpath("tables").rglob("*.parquet"))
    assert sum(len(v) for v in found.files.values()) == on_disk - report.files_in


@pytest.mark.parametrize("read_only_user_sql", [False, True])
def test_pinning_works_on_every_kind_of_store_connection(tmp_path, read_only_user_sql):
    store = Store(tmp_path)
    store.record_job(JobRecord("job-h", "tiny", 2, 1, time.time()))
    _commit_shard(store, "job-h", 0)
    con = connect(tmp_path, read_only_user_sql=read_only_user_sql)
    assert pin(con.cursor()) is not None
    assert run_query(con.cursor(), "SELECT count(*) FROM outputs").rows == [(2,)]


def test_a_kind_listed_as_its_glob_is_read_through_it(tmp_path):
    """A kind of which a listing found no file, not even its `_schema.parquet`, is pinned as its glob
    (`list_files`); its scan then reads the glob, as an unpinned one does, instead of choosing by file
    rank over a list of files (catalog._ranked_scan_sql), which would meet files it did not list."""
    store = Store(tmp_path)
    store.record_job(JobRecord("job-a", "tiny", 4, 2, time.time()))
    _commit_shard(store, "job-a", 0)
    _commit_shard(store, "job-a", 1)
    con = connect(tmp_path)  # (connecting writes every kind's `_schema.parquet` that is missing)
    try:
        (store.layout.kind_dir("commits") / "_schema.parquet").unlink()
        assert list_files(store.layout, job_id="job-b").files["commits"] == [store.layout.glob("commits")]
        pin(con, store.layout, job_id="job-b")
        assert con.execute("SELECT count(*) FROM _bg.scan_commits").fetchone()[0] == 2
        pin(con, store.layout)  # files listed: chosen by rank
        assert con.execute("SELECT count(*) FROM _bg.scan_commits").fetchone()[0] == 2
    finally:
        con.close()
