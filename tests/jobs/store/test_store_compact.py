"""Compaction and garbage collection, in one process (the racing version is in test_store_concurrency)."""

from __future__ import annotations

import importlib
import json
import os
import random
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.store_queries import main as bench_main
from engine.stats import RequestStats
from jobs.store import catalog, listing
from jobs.store.catalog import connect
from jobs.store.compact import collect_garbage, compact, compact_group, compact_job, compact_telemetry
from jobs.store.layout import Layout, StoreError
from jobs.store.listing import list_files, pin
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord


@pytest.fixture(autouse=True)
def compacted_files_count_at_once(monkeypatch):
    """Single-process tests: no reader races us, so compacted files may count (and GC run) at once."""
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)


def _fill(store: Store, job_id: str, shards: int = 3, parts: int = 3, commit: bool = True) -> None:
    store.record_job(JobRecord(job_id, "tiny", shards * parts, shards, time.time()))
    for s in range(shards):
        att = store.begin_attempt(job_id, s, 1, "w")
        for p in range(parts):
            att.add_outputs([{"request_id": f"{s}-{p}", "output_text": "x", "finish_reason": "stop",
                              "prompt_tokens": 1, "output_tokens": p, "error": None, "extra": p}])
            att.flush()
        if commit:
            att.commit()


def _snapshot(data_dir, *, listed: bool = True) -> dict:
    """Every view's rows, over a listing pinned for the queries (as run_query does), or with
    `listed=False` over the globs (a connection that pins none)."""
    con = connect(data_dir)
    try:
        if listed:
            pin(con)
        return {v: sorted(con.execute(f"SELECT * FROM {v}").fetchall(), key=repr)
                for v in ("jobs", "shards", "outputs", "requests", "iterations")}
    finally:
        con.close()


def _files(layout: Layout, kind: str, job_id: str, where: str) -> list:
    return sorted((layout.kind_dir(kind) / where / job_id).glob("*.parquet"))


def test_compacting_a_finished_job_merges_its_parts_and_keeps_answers(tmp_path):
    store = Store(tmp_path)
    _fill(store, "job-a")
    before = _snapshot(tmp_path)
    report = compact_job(tmp_path, "job-a")
    assert report.groups == 4  # job_records, shard_events, commits, outputs
    assert len(_files(store.layout, "outputs", "job-a", "compacted")) == 1
    assert len(_files(store.layout, "outputs", "job-a", "raw")) == 9  # kept for the grace period
    assert _snapshot(tmp_path) == before
    assert collect_garbage(tmp_path) == 0  # inside the grace period nothing goes
    assert collect_garbage(tmp_path, grace_s=0) == report.files_in
    assert _files(store.layout, "outputs", "job-a", "raw") == []
    assert _snapshot(tmp_path) == before
    assert store.committed("job-a", 1).num_outputs == 3  # workers still find commits once compacted
    assert compact_job(tmp_path, "job-a").groups == 0  # nothing new


def _codecs(paths) -> set[str]:
    """The codecs of the files' columns (a file of no rows has none)."""
    metas = [pq.ParquetFile(p).metadata for p in paths]
    return {m.row_group(0).column(i).compression
            for m in metas if m.num_row_groups for i in range(m.num_columns)}


def test_the_kinds_every_query_reads_are_written_uncompressed_and_the_bulk_rows_zstd(tmp_path):
    store = Store(tmp_path)
    _fill(store, "job-a")
    att = store.begin_attempt("job-a", 0, 2, "w")
    att.add_request("0-0", "stop", RequestStats(arrival_ts=1.0, finished_ts=2.0, output_tokens=3))
    att.commit()
    raw = {kind: _files(store.layout, kind, "job-a", "raw") for kind in
           ("commits", "shard_events", "request_digests", "outputs", "requests")}
    compact_job(tmp_path, "job-a")
    compacted = {kind: _files(store.layout, kind, "job-a", "compacted") for kind in raw}
    twins = sorted((store.layout.rollup_dir("request_digests")).rglob("*.parquet"))
    for kind in ("commits", "shard_events", "request_digests"):
        assert raw[kind] and compacted[kind]
        assert _codecs(raw[kind] + compacted[kind]) == {"UNCOMPRESSED"}, kind
    for kind in ("outputs", "requests"):
        assert _codecs(raw[kind] + compacted[kind]) == {"ZSTD"}, kind
    assert [t for t in twins if t.name != "_schema.parquet"]
    assert _codecs(t for t in twins if t.name != "_schema.parquet") <= {"UNCOMPRESSED"}


def _mark_raw(paths) -> None:
    """Prove which files a view reads: the raw parts' rows marked (same parts, other text)."""
    for p in paths:
        table = pq.read_table(p)
        i = table.schema.get_field_index("output_text")
        pq.write_table(table.set_column(i, "output_text", pa.array(["raw"] * table.num_rows)), p)


def test_a_compacted_file_counts_only_after_its_activation_delay(tmp_path, monkeypatch):
    """Over the globs (a connection that pins no listing): every scan of a query lists anew."""
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 1.5)
    store = Store(tmp_path)
    _fill(store, "job-v")
    before = _snapshot(tmp_path, listed=False)
    compact_job(tmp_path, "job-v")
    assert collect_garbage(tmp_path, grace_s=0) == 0  # never before the replacement counts
    raw = _files(store.layout, "outputs", "job-v", "raw")
    _mark_raw(raw)
    # the compacted file does not count yet
    assert {r[3] for r in _snapshot(tmp_path, listed=False)["outputs"]} == {"raw"}
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for p in raw:
        p.rename(hidden / p.name)
    # parts no scan lists (merged, then deleted): their rows come from the compacted file at once
    assert _snapshot(tmp_path, listed=False) == before
    for p in raw:
        (hidden / p.name).rename(p)
    time.sleep(1.6)
    # now it counts, in place of the parts, which are not counted twice
    assert _snapshot(tmp_path, listed=False) == before
    assert collect_garbage(tmp_path, grace_s=0) > 0


def test_a_pinned_listing_leaves_out_merged_inputs_and_reads_their_rows_from_the_output(tmp_path,
                                                                                        monkeypatch):
    """A listing made once for a query (`listing.pin`, which run_query does) leaves out the inputs of a
    compaction whose output it holds: their rows come from the output at once, activation delay or not,
    and no query opens the inputs waiting out their grace."""
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 60.0)
    store = Store(tmp_path)
    _fill(store, "job-p")
    before = _snapshot(tmp_path)
    assert before == _snapshot(tmp_path, listed=False)
    listed_before = list_files(store.layout)
    report = compact_job(tmp_path, "job-p")
    raw = _files(store.layout, "outputs", "job-p", "raw")
    _mark_raw(raw)
    listing = list_files(store.layout)
    assert listing.left_out == report.files_in
    assert not set(map(str, raw)) & set(listing.files["outputs"])
    assert len(listing.files["outputs"]) == len(listed_before.files["outputs"]) - len(raw) + 1
    assert _snapshot(tmp_path) == before  # no "raw" text: the output's rows, not the inputs'
    assert {r[3] for r in _snapshot(tmp_path, listed=False)["outputs"]} == {"raw"}  # the globs: not yet
    # a tombstone whose output is not listed (gone, or written by an older batchgen) leaves its inputs in
    tomb = next(store.layout.gc.glob("outputs~*.json"))
    info = json.loads(tomb.read_text())
    del info["output"]
    tomb.unlink()  # a tombstone is never rewritten in place (readers keep their content): a new one
    (tomb.parent / f"old-{tomb.name}").write_text(json.dumps(info))
    assert set(map(str, raw)) <= set(list_files(store.layout).files["outputs"])


def test_running_jobs_are_left_alone_unless_forced(tmp_path):
    store = Store(tmp_path)
    _fill(store, "job-r", commit=False)
    report = compact_job(tmp_path, "job-r")
    assert report.groups == 0 and report.skipped == ["job job-r is not finished"]
    assert compact(tmp_path).groups == 0  # compact() only takes finished jobs
    before = _snapshot(tmp_path)
    assert compact_job(tmp_path, "job-r", force=True).groups == 3
    assert _snapshot(tmp_path) == before


def test_late_parts_are_merged_with_the_earlier_compacted_file(tmp_path):
    store = Store(tmp_path)
    _fill(store, "job-l")
    compact_job(tmp_path, "job-l")
    late = store.begin_attempt("job-l", 0, 7, "zombie")  # never commits: invisible, but on disk
    late.add_outputs([{"request_id": "z", "output_text": "z", "finish_reason": "stop", "prompt_tokens": 1,
                       "output_tokens": 1, "error": None}])
    late.flush()
    before = _snapshot(tmp_path)
    first = _files(store.layout, "outputs", "job-l", "compacted")
    report = compact_group(store.layout, "outputs", "job-l")
    assert (report.groups, report.files_in) == (1, 2)  # the earlier compacted file + the late part
    both = _files(store.layout, "outputs", "job-l", "compacted")
    assert len(both) == 2 and both[0] not in first  # the new file sorts first
    assert _snapshot(tmp_path) == before
    collect_garbage(tmp_path, grace_s=0)
    assert _files(store.layout, "outputs", "job-l", "compacted") == [both[0]]
    assert _snapshot(tmp_path) == before


def test_a_held_lock_skips_the_group_and_a_stale_one_is_broken(tmp_path):
    store = Store(tmp_path)
    _fill(store, "job-k")
    lock = store.layout.locks / "outputs~job-k.lock"
    lock.write_text("other-host 1234\n")
    report = compact_group(store.layout, "outputs", "job-k")
    assert report.groups == 0 and "another compactor holds the lock" in report.skipped[0]
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert compact_group(store.layout, "outputs", "job-k").groups == 1
    assert not lock.exists()


def test_telemetry_is_compacted_per_worker_and_stale_temp_files_are_removed(tmp_path):
    store = Store(tmp_path)
    for w in ("w1", "w2"):
        with store.telemetry_buffer(w, flush_interval_s=0) as buf:
            for i in range(5):
                buf.append({"iteration": i, "ts": float(i), "job_ids": ["j"]})
    stale = store.layout.tmp / "dead.x.parquet.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    before = _snapshot(tmp_path)
    report = compact(tmp_path, grace_s=0, min_age_s=0)
    assert report.groups == 2 and report.files_in == 10 and report.rows == 10
    assert report.deleted == 10 + 1 and not stale.exists()
    assert _snapshot(tmp_path) == before
    tombstones = list(store.layout.gc.glob("*.json"))
    assert tombstones == []
    assert (tmp_path / "batchgen.duckdb").exists()  # compact() refreshes the catalog file


def test_tombstones_list_what_was_merged(tmp_path):
    store = Store(tmp_path)
    _fill(store, "job-t", shards=1, parts=2)
    compact_group(store.layout, "outputs", "job-t")
    [tomb] = store.layout.gc.glob("outputs~job-t~*.json")
    info = json.loads(tomb.read_text())
    raw = [store.layout.relative(p) for p in _files(store.layout, "outputs", "job-t", "raw")]  # relative
    assert info["kind"] == "outputs" and sorted(info["files"]) == raw


def test_bench_runs_at_a_tiny_size(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench_main(["--requests", "200", "--shards", "4", "--iterations", "400", "--workers", "2", "--runs", "2",
                "--runs-before", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["written"] == {"requests": 200, "iterations": 400}
    phases = report["phases"]
    assert phases["compacted, after gc"]["files"] < phases["raw parts"]["files"]
    assert set(phases["raw parts"]["queries"]) == set(phases["compacted, after gc"]["queries"])
    assert "job_latency" in capsys.readouterr().out


def _fill_wide(store: Store, job_id: str, *, shards: int, rows: int, text_bytes: int) -> None:
    """A committed job of `shards` x `rows` outputs, each of `text_bytes` of incompressible text."""
    store.record_job(JobRecord(job_id, "tiny", shards * rows, shards, time.time()))
    rng = random.Random(0)
    for s in range(shards):
        att = store.begin_attempt(job_id, s, 1, "w")
        att.add_outputs([{"request_id": f"{s}-{i}", "finish_reason": "stop", "prompt_tokens": 1,
                          "output_tokens": 1, "error": None,
                          "output_text": rng.randbytes(text_bytes // 2).hex()} for i in range(rows)])
        att.commit()


def test_a_merge_spills_past_its_memory_limit_and_keeps_answers(tmp_path, monkeypatch):
    """A merge runs under MERGE_MEMORY_LIMIT with its spill directory under the store's tmp, so its
    memory does not grow with the rows merged; the answers are the same and the spill goes after."""
    import duckdb

    compact_mod = importlib.import_module("jobs.store.compact")  # the package's `compact` is the function

    monkeypatch.setattr(compact_mod, "MERGE_MEMORY_LIMIT", "64MB")
    monkeypatch.setattr(compact_mod, "MERGE_ROW_GROUP_BYTES", "4MB")
    configs = []
    real_connect = duckdb.connect

    def connect_spy(database=":memory:", *a, config=None, **kw):
        if database == ":memory:" and config and "temp_directory" in config:
            configs.append(dict(config))
        return real_connect(database, *a, config=config or {}, **kw)

    monkeypatch.setattr(compact_mod.duckdb, "connect", connect_spy)
    store = Store(tmp_path)
    _fill_wide(store, "big", shards=8, rows=4000, text_bytes=1000)  # 32 MB: half the limit, 8 row groups
    before = _snapshot(tmp_path)
    report = compact_job(tmp_path, "big", force=True)
    assert report.rows >= 32000
    assert configs and all(c["memory_limit"] == "64MB" for c in configs)
    assert all(os.path.dirname(c["temp_directory"]) == str(store.layout.tmp) for c in configs)
    assert not any(store.layout.tmp.glob("*.spill"))  # removed after each merge
    out, = _files(store.layout, "outputs", "big", "compacted")
    assert pq.ParquetFile(out).metadata.num_row_groups >= 4  # row groups of at most MERGE_ROW_GROUP_BYTES
    assert _snapshot(tmp_path) == before


def test_garbage_collection_removes_a_dead_merges_spill_directory(tmp_path):
    store = Store(tmp_path)
    spill = store.layout.tmp / "dead.spill"
    (spill / "sub").mkdir(parents=True)
    (spill / "sub" / "block.tmp").write_bytes(b"x" * 10)
    old = time.time() - 7200
    os.utime(spill, (old, old))
    assert collect_garbage(tmp_path) == 1
    assert not spill.exists()


def test_compact_memory_bench_runs_at_a_tiny_size(tmp_path):
    from benchmarks.compact_memory import main as compact_memory

    compact_memory(["--rows", "300", "--shard-size", "100", "--text-bytes", "64", "--limits", "64MB,1000GB",
                    "--json", str(tmp_path / "out.json")])
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert [(r["limit"], r["rows"]) for r in results] == [("64MB", 300), ("1000GB", 300)]
    assert all(r["peak_rss_mb"] > 0 for r in results)
    compact_memory(["--rows", "300", "--shard-size", "100", "--text-bytes", "64", "--limits", "64MB",
                    "--dedup", "auto,always", "--unsorted", "--json", str(tmp_path / "out.json")])
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert [(r["dedup"], r["sort"], r["rows"]) for r in results] == [("auto", "unsorted", 300),
                                                                     ("always", "unsorted", 300)]
    with pytest.raises(SystemExit, match="--dedup"):
        compact_memory(["--rows", "10", "--limits", "64MB", "--dedup", "sometimes"])


@pytest.mark.parametrize(("pinned", "two_reads"), [(True, True), (True, False), (False, True)])
def test_a_pinned_listings_scans_take_each_part_once(tmp_path, monkeypatch, pinned, two_reads):
    """Over a pinned listing a scan of TWO_READ_KINDS (iterations) chooses its (file, part) pairs in a
    first read and reads their rows in a second, any other kind's scan chooses by file rank
    (`_ranked_scan_sql`: iterations taken out of TWO_READ_KINDS here); unpinned, the one-listing form.
    Every way each part's rows count once: from the raw parts while the compacted file holding them is
    not active (here a merge whose tombstone was never written, so the listing keeps its inputs), from
    the compacted file once the parts are gone or it is active."""
    assert "iterations" in catalog.TWO_READ_KINDS
    if not two_reads:
        monkeypatch.setattr(catalog, "TWO_READ_KINDS", frozenset())
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 1.5)
    store = Store(tmp_path)
    with store.telemetry_buffer("w1", flush_interval_s=0) as buf:
        for i in range(4):
            buf.append({"iteration": i, "ts": float(i), "num_running": 1, "job_ids": ["j"]})

    def running() -> list:
        return sorted(r[0] for r in _iterations(tmp_path, pinned))

    assert running() == [1, 1, 1, 1]
    compact_telemetry(tmp_path, min_age_s=0)
    _died_before_its_tombstone(store.layout)
    raw = sorted((store.layout.kind_dir("iterations") / "raw" / "w1").glob("*.parquet"))
    assert len(raw) == 4
    for p in raw:  # mark the raw parts' rows
        table = pq.read_table(p)
        i = table.schema.get_field_index("num_running")
        marked = pa.array([7] * table.num_rows, table.field(i).type)
        pq.write_table(table.set_column(i, "num_running", marked), p)
    assert running() == [7, 7, 7, 7]  # the compacted file is not active yet: the raw parts, once each
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    raw[0].rename(hidden / raw[0].name)
    assert running() == [1, 7, 7, 7]  # a part gone: its rows from the compacted file
    (hidden / raw[0].name).rename(raw[0])
    time.sleep(1.6)
    assert running() == [1, 1, 1, 1]  # active: the compacted file in place of every part


def _died_before_its_tombstone(layout) -> None:
    """Leave the gc directory as a compactor that died between its rename and its tombstone would: no
    tombstone, its `.renaming` marker (which the listing reads as "this output's inputs may be listed")."""
    for tomb in layout.gc.glob("*.json"):
        info = json.loads(tomb.read_text())
        uid = listing.compacted_uid(info["output"])
        (layout.gc / listing.marker_name(info["kind"], info["group"], uid, listing.RENAMING_SUFFIX)).touch()
        tomb.unlink()


def _iterations(data_dir, pinned: bool) -> list:
    con = connect(data_dir)
    try:
        if pinned:
            pin(con)
        return con.execute("SELECT num_running FROM iterations WHERE list_contains(job_ids, 'j')").fetchall()
    finally:
        con.close()


def test_a_merge_over_its_memory_limit_fails_naming_the_setting_and_changes_nothing(tmp_path, monkeypatch):
    compact_mod = importlib.import_module("jobs.store.compact")
    monkeypatch.setattr(compact_mod, "MERGE_MEMORY_LIMIT", "2MB")
    store = Store(tmp_path)
    _fill_wide(store, "oom", shards=2, rows=2000, text_bytes=2000)
    before = _snapshot(tmp_path)
    raw = _files(store.layout, "outputs", "oom", "raw")
    with pytest.raises(StoreError, match=r"2MB \(BATCHGEN_STORE_MERGE_MEMORY\); nothing was changed"):
        compact_job(tmp_path, "oom", force=True)
    assert _files(store.layout, "outputs", "oom", "raw") == raw
    assert _files(store.layout, "outputs", "oom", "compacted") == []
    assert not list(store.layout.gc.glob("outputs~*.json")) and not any(store.layout.tmp.iterdir())
    assert _snapshot(tmp_path) == before
