"""Submitting large inputs in bounded memory: the duplicate id check over a spill file, the version 2
manifest (no shard list) beside version 1 ones, and a reader that never holds the whole input."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs import input_contract
from jobs import submit as submit_mod
from jobs.broker import resolve_broker
from jobs.cli import ARROW_POOL_ENV
from jobs.input_contract import InputError, RequestIds
from jobs.manifest import (
    MANIFEST_VERSION,
    REQUEST_ID_COLUMN,
    JobManifest,
    JobPaths,
    RegularShards,
    ShardInfo,
    ShardWriter,
    load_manifest,
    shard_sizes,
    write_manifest,
)
from jobs.shards.ledger import ShardLedger
from jobs.status import job_status
from jobs.store import ShardEvent, Store, StoreError
from jobs.store.schemas import PART_COLUMN
from jobs.submit import JobRequest, job_config_json, prepare_job, publish_job


def _prepare(tmp_path, source, shard_size=4):
    data_dir = tmp_path / "data"
    req = JobRequest(source=str(source), data_dir=str(data_dir), engine={"model": "tiny-random"},
                     sampling={}, shard_size=shard_size)
    return prepare_job(req, resolve_broker(data_dir, embedded=True))


def _ids_file(path, ids, row_group_size):
    pq.write_table(pa.table({"id": ids, "prompt": [f"p{i}" for i in range(len(ids))]}), path,
                   row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("partition_rows", [None, 3000])  # one check; ids split by hash into 7 checks
def test_a_duplicate_far_apart_in_a_many_row_group_file_is_named(tmp_path, monkeypatch, partition_rows):
    if partition_rows:
        monkeypatch.setattr(input_contract, "ID_CHECK_PARTITION_ROWS", partition_rows)
    ids = [f"r{i}" for i in range(20_000)]
    ids[17_321] = "r10"  # the 35th row group repeats an id of the first
    src = _ids_file(tmp_path / "big.parquet", ids, row_group_size=500)
    assert pq.ParquetFile(src).num_row_groups == 40
    with pytest.raises(InputError) as info:
        _prepare(tmp_path, src)
    assert str(info.value) == f"{src} row 17321: duplicate id 'r10' (first used by input row 10)"
    jobs = tmp_path / "data" / "jobs"
    assert not jobs.exists() or not list(jobs.iterdir()), "nothing left behind, staging included"


def test_the_first_repeat_in_input_order_is_named_across_files_and_int_ids(tmp_path):
    d = tmp_path / "many"
    d.mkdir()
    _ids_file(d / "a.parquet", list(range(0, 3000)), row_group_size=700)
    # b.parquet repeats 2999 at its row 5 and 7 at its row 9: the one met first in input order is named
    _ids_file(d / "b.parquet", [3000 + i for i in range(5)] + [2999, 3005, 3006, 3007, 7], row_group_size=3)
    with pytest.raises(InputError) as info:
        _prepare(tmp_path, d)
    assert str(info.value) == f"{d / 'b.parquet'} row 5: duplicate id '2999' (first used by input row 2999)"


def test_a_duplicate_jsonl_line_far_apart_is_named_by_line(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"k{i}", "prompt": "x"}) for i in range(9000)]
    lines[8000] = json.dumps({"id": "k3", "prompt": "y"})
    src.write_text("\n".join(lines[:100]) + "\n\n" + "\n".join(lines[100:]) + "\n")  # a blank line
    with pytest.raises(InputError) as info:
        _prepare(tmp_path, src)
    assert str(info.value) == f"{src} line 8002: duplicate id 'k3' (first used by input row 3)"


def test_the_earliest_repeat_of_all_partitions_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(input_contract, "ID_CHECK_PARTITION_ROWS", 500)
    ids = [f"q{i}" for i in range(6000)]
    ids[5990], ids[4000], ids[2500] = "q7", "q3999", "q2400"  # three repeats, likely in three partitions
    src = _ids_file(tmp_path / "p.parquet", ids, row_group_size=1000)
    with pytest.raises(InputError) as info:
        _prepare(tmp_path, src)
    assert str(info.value) == f"{src} row 2500: duplicate id 'q2400' (first used by input row 2400)"


def test_unique_ids_pass_and_reach_the_shards(tmp_path):
    src = _ids_file(tmp_path / "ok.parquet", [f"u{i}" for i in range(1000)], row_group_size=128)
    m = _prepare(tmp_path, src, shard_size=300)
    assert [s.num_requests for s in m.shards] == [300, 300, 300, 100]
    got = [i for s in m.shards for i in pq.read_table(s.path).column(REQUEST_ID_COLUMN).to_pylist()]
    assert got == [f"u{i}" for i in range(1000)]


def test_regular_shards_are_computed_not_listed(tmp_path):
    shards = RegularShards(JobPaths.of(tmp_path, "j"), 10, 4)
    assert len(shards) == 3
    assert [(s.shard_id, s.num_requests, s.first_row) for s in shards] == [(0, 4, 0), (1, 4, 4), (2, 2, 8)]
    assert shards[-1] == shards[2] and shards[1:] == [shards[1], shards[2]]
    assert shards[2].path == str(JobPaths.of(tmp_path, "j").shard_file(2))
    with pytest.raises(IndexError):
        shards[3]
    assert shards == list(shards) and len(RegularShards(JobPaths.of(tmp_path, "j"), 8, 4)) == 2


def test_the_manifest_lists_no_shard_and_a_version_1_manifest_still_reads(tmp_path):
    src = _ids_file(tmp_path / "in.parquet", [f"v{i}" for i in range(10)], row_group_size=3)
    m = _prepare(tmp_path, src, shard_size=4)
    paths = JobPaths.of(m.data_dir, m.job_id)
    written = json.loads(paths.manifest.read_text())
    assert written["version"] == MANIFEST_VERSION == 2 and "shards" not in written
    assert "shards" not in json.loads(job_config_json(m))
    # the same job as batchgen 1 wrote it: every shard listed
    old = {**written, "version": 1, "shards": [
        {"shard_id": i, "path": f"shards/shard-{i:06d}.parquet", "num_requests": n, "first_row": 4 * i}
        for i, n in enumerate([4, 4, 2])]}
    paths.manifest.write_text(json.dumps(old))
    again = load_manifest(m.data_dir, m.job_id)
    assert isinstance(again.shards, list) and again.shards == list(m.shards) and again.version == 1
    assert again.shard(2).path == str(paths.shard_file(2))
    publish_job(again, resolve_broker(m.data_dir, embedded=True))
    assert job_status(again)["shard_counts"]["queued"] == 3
    # written again (a repair, a resume), the regular list becomes version 2
    write_manifest(again, paths)
    assert "shards" not in json.loads(paths.manifest.read_text())


def test_shards_no_regular_cut_describes_stay_listed(tmp_path):
    paths = JobPaths.of(tmp_path, "odd")
    shards = [ShardInfo(0, str(paths.shard_file(0)), 3, 0), ShardInfo(1, str(paths.shard_file(1)), 4, 3)]
    m = JobManifest("odd", str(tmp_path), [], 7, 4, shards, {"model": "m"}, {}, "q", "embedded", 0, 1.0, [],
                    0.0)
    write_manifest(m, paths)
    written = json.loads(paths.manifest.read_text())
    assert written["version"] == 1 and [s["num_requests"] for s in written["shards"]] == [3, 4]
    assert load_manifest(tmp_path, "odd").shards == shards


def test_a_newer_manifest_version_is_refused_by_name(tmp_path):
    src = _ids_file(tmp_path / "in.parquet", ["a", "b"], row_group_size=1)
    m = _prepare(tmp_path, src)
    paths = JobPaths.of(m.data_dir, m.job_id)
    paths.manifest.write_text(json.dumps({**json.loads(paths.manifest.read_text()), "version": 3}))
    with pytest.raises(ValueError, match="manifest version 3: this batchgen reads versions 1 to 2"):
        load_manifest(m.data_dir, m.job_id)


def test_queued_events_are_written_a_part_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(submit_mod, "QUEUED_EVENTS_PER_PART", 4)
    src = _ids_file(tmp_path / "in.parquet", [f"e{i}" for i in range(21)], row_group_size=5)
    m = _prepare(tmp_path, src, shard_size=2)  # 11 shards: parts of 4, 4 and 3 events
    publish_job(m, resolve_broker(m.data_dir, embedded=True))
    parts = list((tmp_path / "data").rglob("*shard_events*.parquet"))
    assert sorted(pq.read_metadata(p).num_rows for p in parts) == [3, 4, 4]
    status = job_status(m)
    assert status["shard_counts"]["queued"] == 11 and status["shard_counts"]["total"] == 11
    assert Store(m.data_dir).committed(m.job_id, 10) is None


def test_queued_events_as_columns_are_the_rows_of_their_shard_events(tmp_path):
    as_events, as_columns = Store(tmp_path / "events"), Store(tmp_path / "columns")
    as_events.record_shard_events([ShardEvent("job-c", s, "queued", 12.5, num_requests=n)
                                   for s, n in [(0, 4), (1, 4), (2, 1)]])
    as_columns.record_queued_shards("job-c", pa.array([0, 1, 2], pa.int64()), pa.array([4, 4, 1], pa.int64()),
                                    12.5)
    parts = [list((tmp_path / name).rglob("*shard_events*.parquet")) for name in ("events", "columns")]
    assert [len(p) for p in parts] == [1, 1]
    one, other = (pq.read_table(p[0]) for p in parts)
    assert one.drop_columns([PART_COLUMN]).equals(other.drop_columns([PART_COLUMN]))
    assert one.schema == other.schema
    with pytest.raises(StoreError, match="2 shard ids but 1 row counts"):
        as_columns.record_queued_shards("job-c", pa.array([0, 1]), pa.array([4]), 1.0)


def _apart(fn, *args):
    """`fn(*args)` in a fresh interpreter (spawned), for a peak of Python's heap: tracemalloc counts every
    thread of its process, and a pytest-xdist worker runs many test files in one process, whose leftover
    threads allocated about 7.7 MB during one measurement here."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def _queue_peak(data_dir, num_shards: int) -> int:
    """Peak Python heap while the ledger queues a new job of `num_shards` shards (as publish_job does)."""
    ledger = ShardLedger(data_dir, f"job-{num_shards}")
    shards = RegularShards(JobPaths.of(data_dir, f"job-{num_shards}"), num_shards * 3 - 1, 3)
    tracemalloc.start()
    try:
        ledger.queue_new(shard_sizes(shards), per_part=submit_mod.QUEUED_EVENTS_PER_PART)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _queue_peaks(data_dir) -> tuple[int, int]:
    _queue_peak(data_dir, 50)  # the store's layout and catalog, once
    return _queue_peak(data_dir, 4_000), _queue_peak(data_dir, 40_000)


def test_queueing_a_jobs_shards_holds_nothing_per_shard(tmp_path):
    """Ten times the shards, each time in one part of `queued` events: the same peak of Python's heap.
    An object per shard (a ShardEvent and its row dict, as before, about 500 bytes a shard) made it
    2.4 MB at 4,000 shards and 22 MB at 40,000."""
    data_dir = tmp_path / "data"
    small, large = _apart(_queue_peaks, data_dir)
    assert large < small + 1_000_000, (small, large)
    parts = list(data_dir.rglob("*job-40000*shard_events*.parquet"))
    table = pa.concat_tables(pq.read_table(p) for p in parts)
    assert len(parts) == 1 and table.column("shard_id").to_pylist() == list(range(40_000))
    assert table.column("num_requests").to_pylist() == [3] * 39_999 + [2]
    assert set(table.column("event").to_pylist()) == {"queued"}


def _peak_during_submit(tmp_path, rows: int) -> tuple[int, int]:
    """(peak Python heap bytes, peak Arrow pool bytes) while submitting `rows` rows (many row groups)."""
    src = tmp_path / f"in-{rows}.parquet"
    with pq.ParquetWriter(src, pa.schema([("id", pa.string()), ("prompt", pa.string())])) as w:
        for start in range(0, rows, 2000):
            n = min(2000, rows - start)
            w.write_table(pa.table({"id": [f"id-{start + i}" for i in range(n)],
                                    "prompt": [f"prompt number {start + i} " + "x" * 40 for i in range(n)]}))
    arrow_peak = [0]
    add = ShardWriter.add

    def counting_add(self, batch, ids):
        arrow_peak[0] = max(arrow_peak[0], pa.total_allocated_bytes())
        return add(self, batch, ids)

    ShardWriter.add = counting_add
    tracemalloc.start()
    try:
        (tmp_path / str(rows)).mkdir()
        m = _prepare(tmp_path / str(rows), src, shard_size=256)
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        ShardWriter.add = add
    assert m.num_requests == rows and len(m.shards) == -(-rows // 256)
    return python_peak, arrow_peak[0]


def _submit_peaks(tmp_path) -> tuple[tuple[int, int], tuple[int, int]]:
    RequestIds.SPILL_ROWS = 8192  # both sizes write several spill row groups (in a process of its own)
    _peak_during_submit(tmp_path, 3_000)  # lazy imports (DuckDB) and caches, before measuring
    return _peak_during_submit(tmp_path, 60_000), _peak_during_submit(tmp_path, 240_000)


def test_submit_memory_does_not_grow_with_the_rows(tmp_path):
    """Four times the rows (30 and 120 row groups): the same peak of Python's heap (a set or dict of
    the ids would add 180,000 entries, over 15 MB), and Arrow's pool never near the input's size."""
    small, large = _apart(_submit_peaks, tmp_path)
    assert large[0] < small[0] * 1.3 + 1_000_000, (small, large)
    assert large[1] < 8_000_000 < 240_000 * 70, (small, large)  # the input: about 70 bytes a row in Arrow


def test_the_input_is_read_without_keeping_what_was_read(tmp_path):
    """pyarrow pre-buffers by default and keeps every column chunk it read until the file is closed: a
    100M-row input held its whole compressed size (issue 38). Reading here holds about a row group."""
    rng = np.random.default_rng(0)
    src = tmp_path / "in.parquet"
    with pq.ParquetWriter(src, pa.schema([("id", pa.string()), ("prompt", pa.string())])) as w:
        for start in range(0, 200_000, 5_000):  # 40 row groups of poorly compressible prompts
            w.write_table(pa.table({"id": [f"i{start + i}" for i in range(5_000)],
                                    "prompt": pa.array(rng.integers(0, 10**15, 5_000)).cast(pa.string())}))
    size = src.stat().st_size
    rows, peak = _apart(_read_peak, src)
    assert rows == 200_000 and peak < size / 4, (peak, size)


def _read_peak(src) -> tuple[int, int]:
    """(rows, peak of Arrow's pool above where it started) while the input is read batch by batch."""
    base, peak, rows = pa.total_allocated_bytes(), 0, 0
    for batch, _ in submit_mod._open_input(src).batches():
        peak, rows = max(peak, pa.total_allocated_bytes() - base), rows + batch.num_rows
    return rows, peak


def test_shard_sizes_are_the_shards_ids_and_row_counts(tmp_path):
    regular = RegularShards(JobPaths.of(tmp_path, "j"), 10, 4)
    assert list(shard_sizes(regular)) == [(s.shard_id, s.num_requests) for s in regular] == [(0, 4), (1, 4),
                                                                                              (2, 2)]
    listed = [ShardInfo(0, "a", 3, 0), ShardInfo(1, "b", 5, 3)]
    assert list(shard_sizes(listed)) == [(0, 3), (1, 5)]


@pytest.mark.parametrize("preset", [None, "mimalloc"])
def test_the_cli_gives_arrow_the_system_allocator_unless_one_was_chosen(preset):
    """Arrow C++'s default pool (the Parquet writer's) is chosen once, when pyarrow is imported: the CLI
    sets it first, so a submit's shard writing keeps no freed pages (issue 38)."""
    code = ("import jobs.cli as c; "
            "c.cli = lambda: print(__import__('pyarrow').default_memory_pool().backend_name); c.main()")
    env = {k: v for k, v in os.environ.items() if k != ARROW_POOL_ENV}
    if preset:
        env[ARROW_POOL_ENV] = preset
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd=Path(__file__).resolve().parents[2], check=True)
    assert done.stdout.split() == [preset or "system"]
