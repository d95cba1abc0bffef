"""Writers compact their groups as parts pile up (compact.compact_written), and a scan takes a deleted
part's rows from the compacted file that holds them: the views answer the same at every step, with a
bounded number of files."""

from __future__ import annotations

import importlib
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import time

import duckdb
import pyarrow.parquet as pq
import pytest

from engine.stats import IterationStats
from jobs.request_counts import fetch_rows
from jobs.store import Store, connect
from jobs.store.compact import compact_live_job
from jobs.store.listing import DATA_DIR_MACRO
from jobs.store.schemas import JOB_KINDS, JobRecord, ShardEvent
from tests.jobs.store.test_store_live_compact import JOB, SHARD, _answers, _write

catalog = importlib.import_module("jobs.store.catalog")
compact_mod = importlib.import_module("jobs.store.compact")


def _new_job(store: Store, shards: int = 40) -> None:
    config = json.dumps({"queue": "q"})
    store.record_job(JobRecord(JOB, "m", shards * SHARD, shards, time.time() - 200, config))
    store.record_shard_events([ShardEvent(JOB, s, "queued", time.time() - 200, num_requests=SHARD)
                               for s in range(shards)])


def _parquet(directory) -> list:
    return sorted(directory.glob("*.parquet")) if directory.is_dir() else []


def _merged(layout, kind: str, group: str) -> set:
    """Raw parts a tombstone of the group names (merged, waiting for garbage collection)."""
    return {layout.file(p) for tomb in layout.gc.glob(f"{kind}~{group}~*.json")
            for p in json.loads(tomb.read_text())["files"]}


def _live_compacted(layout, kind: str) -> set:
    """The job's compacted files of a kind that no later compaction merged."""
    return set(_parquet(layout.compacted_dir(kind, JOB))) - _merged(layout, kind, JOB)


def _without_compaction(data_dir, copy) -> dict:
    """The answers of a copy of the data dir with every compacted file and tombstone removed: the raw
    parts alone (kept by a long grace), as if nothing had been compacted."""
    shutil.copytree(data_dir, copy)
    for kind_dir in (copy / "store" / "tables").iterdir():
        shutil.rmtree(kind_dir / "compacted", ignore_errors=True)
    shutil.rmtree(copy / "store" / "gc")
    (copy / "store" / "gc").mkdir()
    return _answers(copy)


@pytest.fixture
def counts_at_once(monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)  # single process: no reader races us
    monkeypatch.setattr(compact_mod, "WRITER_MIN_PARTS", 6)


def test_a_scan_takes_a_merged_and_deleted_parts_rows_from_the_compacted_file_at_once(tmp_path, monkeypatch):
    """The compacted file does not count yet (its activation delay), and its inputs are gone (deleted
    early): their rows come from it, neither lost nor counted twice."""
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 3600.0)
    store = Store(tmp_path, compact_as_written=False)
    _new_job(store)
    _write(store, random.Random(5), range(0, 10))
    before = _answers(tmp_path)
    report = compact_live_job(tmp_path, JOB, min_age_s=0, min_parts=4)
    assert report.groups >= 4
    assert _answers(tmp_path) == before  # inputs listed: they count, the compacted files do not yet
    some = sorted(_merged(store.layout, "outputs", JOB))
    for path in some[: len(some) // 2]:  # half the merged outputs parts gone: a scan mixes both
        path.unlink()
    assert _answers(tmp_path) == before
    for kind in JOB_KINDS:
        for path in _merged(store.layout, kind, JOB):
            path.unlink(missing_ok=True)
    assert _answers(tmp_path) == before


def test_writers_merge_their_groups_as_parts_pile_up(tmp_path, counts_at_once, monkeypatch):
    monkeypatch.setattr(compact_mod, "LIVE_GRACE_S", 3600.0)  # every input kept: compare with them alone
    data = tmp_path / "data"
    store = Store(data)
    _new_job(store)
    rng = random.Random(11)
    for step in range(4):
        _write(store, rng, range(8 * step, 8 * step + 8))
        for kind in ("outputs", "requests", "shard_events"):
            waiting = set(_parquet(store.layout.raw_dir(kind, JOB))) - _merged(store.layout, kind, JOB)
            # the last commit merged what waited; the parts of shards still running since then wait
            assert len(waiting) < 6 + 8, (kind, step, len(waiting))
        assert len(_live_compacted(store.layout, "outputs")) <= compact_mod.LIVE_MAX_COMPACTED + 1
    assert _parquet(store.layout.compacted_dir("outputs", JOB))
    assert _parquet(store.layout.compacted_dir("iterations", "w0"))  # telemetry too, as it is flushed
    assert _answers(data) == _without_compaction(data, tmp_path / "copy")


def test_writers_delete_merged_inputs_after_the_live_grace(tmp_path, counts_at_once, monkeypatch):
    monkeypatch.setattr(compact_mod, "LIVE_GRACE_S", 0.0)
    store = Store(tmp_path / "data")
    _new_job(store)
    rng = random.Random(13)
    kept = Store(tmp_path / "twin", compact_as_written=False)  # the same job left raw, for the answers
    _new_job(kept)
    twin_rng = random.Random(13)
    for step in range(4):
        _write(store, rng, range(8 * step, 8 * step + 8))
        _write(kept, twin_rng, range(8 * step, 8 * step + 8))
    raw = _parquet(store.layout.raw_dir("outputs", JOB))
    assert len(raw) < 6 + 8 + 24  # parts since the last merge, and the last merge's inputs
    assert len(_parquet(kept.layout.raw_dir("outputs", JOB))) > 80
    con, twin = connect(tmp_path / "data"), connect(tmp_path / "twin")
    try:
        for sql in ("SELECT request_id, output_text, prompt_tokens, output_tokens FROM outputs",
                    "SELECT shard_id, status, attempts, rows_done, output_tokens FROM shards",
                    "SELECT request_id, shard_id, attempt, committed, output_tokens FROM requests_live",
                    "SELECT status, shards_completed, rows_done, prompt_tokens FROM jobs",
                    "SELECT worker_id, iteration, num_running FROM iterations"):
            assert sorted(con.execute(sql).fetchall()) == sorted(twin.execute(sql).fetchall()), sql
    finally:
        con.close()
        twin.close()


def test_writers_compaction_can_be_turned_off(tmp_path, counts_at_once, monkeypatch):
    monkeypatch.setenv("BATCHGEN_STORE_WRITER_COMPACTION", "0")
    store = Store(tmp_path)
    assert not store.compact_as_written
    _new_job(store)
    _write(store, random.Random(1), range(0, 12))
    assert not _parquet(store.layout.compacted_dir("outputs", JOB))
    assert len(_parquet(store.layout.raw_dir("outputs", JOB))) > 30


def test_a_failing_compaction_never_fails_the_write(tmp_path, counts_at_once, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(compact_mod, "compact_written", broken)
    store = Store(tmp_path)
    _new_job(store)
    with caplog.at_level(logging.WARNING, logger="jobs.store.parts"):
        _write(store, random.Random(2), range(0, 4))
    assert store.committed(JOB, 0) is not None
    assert "No space left on device" in caplog.text and "the janitor will" in caplog.text


def test_a_lock_left_by_a_dead_process_on_this_host_is_broken(tmp_path, counts_at_once):
    store = Store(tmp_path, compact_as_written=False)
    _new_job(store)
    _write(store, random.Random(3), range(0, 6))
    lock = store.layout.locks / f"outputs~{JOB}.lock"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{socket.gethostname()} {alive.pid} {time.time()}\n")
        report = compact_mod.compact_written(store.layout, ("outputs",), JOB)
        assert report.groups == 0 and "another compactor holds the lock" in report.skipped[0]
    finally:
        alive.kill()
        alive.wait()
    lock.write_text(f"{socket.gethostname()} {alive.pid} {time.time()}\n")  # its holder is gone now
    assert compact_mod.compact_written(store.layout, ("outputs",), JOB).groups == 1
    assert not lock.exists()
    lock.write_text(f"other-host {alive.pid} {time.time()}\n")  # another host's: not ours to judge
    _write(store, random.Random(4), range(6, 12))
    assert compact_mod.compact_written(store.layout, ("outputs",), JOB).groups == 0
    assert lock.exists()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # until it is stale
    assert compact_mod.compact_written(store.layout, ("outputs",), JOB).groups == 1


def test_status_queries_run_again_when_a_listed_part_is_deleted():
    """fetch_rows (status) runs a query again on a file error, as run_query does for the dashboard."""

    class Deleted:
        """A connection whose first `fail` queries meet a part deleted after it was listed."""

        def __init__(self, con, fail: int):
            self.con, self.fail, self.calls = con, fail, 0

        def execute(self, sql, params=None):
            if sql.startswith(f"SELECT {DATA_DIR_MACRO}"):  # pin_listing's probe: not a store connection
                return self.con.execute(sql)
            self.calls += 1
            if self.calls <= self.fail:
                raise duckdb.IOException('IO Error: No files found that match the pattern "p.parquet"')
            return self.con.execute(sql, params)

    con = duckdb.connect()
    try:
        once = Deleted(con, 1)
        assert fetch_rows(once, "SELECT 42 AS n") == [{"n": 42}] and once.calls == 2
        always = Deleted(con, 100)
        with pytest.raises(duckdb.IOException):
            fetch_rows(always, "SELECT 1")
        assert always.calls == 4
    finally:
        con.close()


def test_writers_leave_big_merges_of_compacted_files_to_the_janitor(tmp_path, counts_at_once, monkeypatch):
    monkeypatch.setattr(compact_mod, "LIVE_MAX_COMPACTED", 2)
    monkeypatch.setattr(compact_mod, "WRITER_MAX_MERGE_BYTES", 1)  # every merge of compacted files is "big"
    store = Store(tmp_path)
    _new_job(store)
    _write(store, random.Random(6), range(0, 24))
    live = _live_compacted(store.layout, "outputs")
    assert len(live) > 3  # the writers only merged raw parts
    before = _answers(tmp_path)
    assert compact_live_job(tmp_path, JOB, min_age_s=0, max_compacted=2).groups >= 1  # the janitor's step
    assert len(_live_compacted(store.layout, "outputs")) < len(live)
    assert _answers(tmp_path) == before


def test_telemetry_groups_share_one_budget_of_raw_parts(tmp_path, monkeypatch):
    """Each worker's iterations are a group: a fleet's workers merge theirs at their share of
    WRITER_TELEMETRY_PARTS, so the workers page reads a bounded number of files however many there are."""
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)
    monkeypatch.setattr(compact_mod, "WRITER_TELEMETRY_PARTS", 15)  # 3 workers: 5 parts each
    store = Store(tmp_path)
    buffers = [store.telemetry_buffer(f"w{i}", flush_interval_s=1e9) for i in range(3)]
    for buf in buffers:
        buf.max_rows = 1  # a part per iteration
    for step in range(5):
        for i, buf in enumerate(buffers):
            buf.append(IterationStats(f"w{i}", step, time.time(), 0.05, 3, 1, 3, 0, 3, 0, 3, 3, 256, 8, 10,
                                      100, 0, 0, 0, [JOB]))
        merged = [bool(_parquet(store.layout.compacted_dir("iterations", f"w{i}"))) for i in range(3)]
        assert merged == [step == 4] * 3, (step, merged)  # at the 5th part, not at WRITER_MIN_PARTS (24)
    con = connect(tmp_path)
    try:
        assert con.execute("SELECT count(*), count(DISTINCT worker_id) FROM iterations").fetchone() == (15, 3)
    finally:
        con.close()


def test_writers_merge_outputs_unsorted_and_the_janitor_sorts_them(tmp_path, counts_at_once, monkeypatch):
    """A writer's merge of outputs skips the sort (`_UNSORTED_BY_WRITERS`: the text makes it most of the
    merge), every other kind's is sorted, every row stays once; the finished job's compaction writes its
    outputs sorted by shard."""
    merges = []
    real = compact_mod._merge

    def spy(layout, kind, inputs, out_dir, *, sort=True):
        merges.append((kind, sort))
        return real(layout, kind, inputs, out_dir, sort=sort)

    monkeypatch.setattr(compact_mod, "_merge", spy)
    monkeypatch.setattr(compact_mod, "LIVE_GRACE_S", 3600.0)  # every input kept: compare with them alone
    data = tmp_path / "data"
    store = Store(data)
    _new_job(store)
    _write(store, random.Random(5), range(24))
    assert ("outputs", False) in merges and ("requests", True) in merges
    assert all(sort for kind, sort in merges if kind != "outputs")
    assert _answers(data) == _without_compaction(data, tmp_path / "copy")
    merges.clear()
    compact_mod.compact_job(data, JOB, force=True)
    assert ("outputs", True) in merges and all(sort for _, sort in merges)
    assert _answers(data) == _without_compaction(data, tmp_path / "copy2")
    [final] = _live_compacted(store.layout, "outputs")
    shards = pq.read_table(final, columns=["_bg_shard_id"]).column(0).to_pylist()
    assert shards == sorted(shards) and len(set(shards)) > 1
