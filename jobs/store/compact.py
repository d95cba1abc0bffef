"""Compaction: many small parts of a group merged into one file, safely under running readers.

A group is one kind's parts of one job (outputs, requests, commits, events, the job record) or of
one worker (iterations) or one sweep. Compacting a group:

1. takes the group's lock (`store/locks/`, O_EXCL file; a stale one is broken after `STALE_LOCK_S`);
2. merges every raw part and earlier compacted file of the group into one Parquet file, each row
   keeping its `_bg_part` (a part that two inputs may hold, which the gc directory tells as a
   listing's `disjoint` does, is taken from one of them), written under a temporary name and renamed
   into `compacted/<group>/c<16 digits>~<uid>.parquet` (newer names sort first);
3. records the merged inputs (relative to the data dir) in a tombstone under `store/gc/`, and deletes
   nothing. A marker `store/gc/<kind>~<group>~<uid>.renaming` is there from before the rename until
   the tombstone is written, so that readers know an output whose inputs they may still list
   (`listing.list_files`); a lock broken while its holder may still run leaves a `.suspect` marker,
   which keeps the group's kind read part by part until the janitor settles it (`settle_suspects`).

Readers stay correct at every instant (catalog.py explains the rule): a compacted file counts only
`ACTIVATION_DELAY_S` after its rename, and then its rows replace those of the parts it merged; until
then the parts count, and a scan that no longer lists a part (deleted) takes its rows from the
compacted file. `collect_garbage` deletes the inputs of a tombstone only after `grace_s` (default 10
minutes for a finished job, far longer than any query the project runs, so a running query never has
a file deleted under it; LIVE_GRACE_S for the parts of a running job and telemetry).

Compaction is physical only: the rows, and so every view's answer, are the same before and after.

A running job is compacted too (`compact_live_job`, from the janitor's `compact`): every view scans
every file of its kind, so a 10M-request job left raw until it ends has its views read 100,000+
small files, seconds a query. A running job's group is merged once LIVE_MIN_PARTS raw parts are older
than `min_age_s`: the raw parts alone go into a new compacted file (the job's earlier compacted files
are not rewritten), and once a group holds more than LIVE_MAX_COMPACTED compacted files the smallest
of them are merged together, so a group keeps a bounded number of files whose sizes grow
geometrically (each row is rewritten a logarithmic number of times, not once per compaction). Their
inputs go after LIVE_GRACE_S, not GRACE_S: until then every query still lists and opens them.

The janitor alone (every 60 s, parts older than 30 s) lets a fast job's parts pile up between its
runs, and every dashboard query opens each of them. So the writers compact too, on a cadence tied to
the file count rather than the clock (`compact_written`, called by `ShardAttempt.commit` and
`TelemetryBuffer.flush`): once WRITER_MIN_PARTS raw parts of a group wait, the writer that notices
merges them (whatever their age; a group another process is compacting is skipped) and deletes the
group's inputs whose grace is over. A group then holds at most about WRITER_MIN_PARTS raw parts, the
inputs of the last LIVE_GRACE_S, and LIVE_MAX_COMPACTED + 1 compacted files.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from jobs.store import catalog, rollups
from jobs.store.catalog import connect, write_catalog
from jobs.store.layout import Layout, StoreError, check_id, codec, init_data_dir, new_uid, write_atomic
from jobs.store.listing import (
    MARKED_UID_PREFIX,
    RENAMING_SUFFIX,
    SUSPECT_SUFFIX,
    compacted_uid,
    execute_listed,
    files_disjoint,
    marker_name,
    parse_marker,
    read_tombstone,
)
from jobs.store.schemas import JOB_KINDS

GRACE_S = 600.0  # inputs of a compaction are deleted this long after it
STALE_LOCK_S = 900.0  # a lock older than this belongs to a dead compactor
# a `.suspect` marker whose holder ran on another host is settled this long after the lock was broken:
# a compactor still running a day after its lock went stale is taken for dead (one on this host is
# settled as soon as its process is gone)
SUSPECT_MAX_AGE_S = 86400.0
TMP_MAX_AGE_S = 3600.0  # temporary files older than this belong to dead writers
TERMINAL = ("completed", "failed", "cancelled")
LIVE_MIN_PARTS = 64  # a running job's group is compacted once this many of its raw parts are old enough
LIVE_MAX_COMPACTED = 8  # past this many compacted files in a running job's group, the smallest are merged
# inputs of a running job's (and telemetry's) compaction are deleted this long after it. Views stay
# correct whenever they go (a scan that does not list a part takes its rows from the compacted file,
# catalog.py); the grace spares the queries that listed an input the retry when it is gone before
# they open it (jobs.store.usersql.run_query runs such a query again, but one slower than the grace
# meets a deleted file each time): the dashboard's limit on a query (PAGE_QUERY_TIMEOUT_S, 30 s), so a
# page's query never does. Every file in it is one more that each query lists and opens.
LIVE_GRACE_S = float(os.environ.get("BATCHGEN_STORE_LIVE_GRACE_S", "30"))
# a writer merges a group's raw parts once this many wait (compact_written); 0 turns writers' compaction off
WRITER_MIN_PARTS = int(os.environ.get("BATCHGEN_STORE_WRITER_COMPACT_PARTS", "24"))
# a writer merges compacted files only while they add up to less than this: bigger merges (a long job's
# large files) are the janitor's, so a commit never waits on rewriting gigabytes
WRITER_MAX_MERGE_BYTES = 64 << 20
# telemetry's groups are workers, and its pages read every worker's parts: a writer merges its group at
# this many raw parts shared among the workers (at least WRITER_MIN_TELEMETRY_PARTS), not at
# WRITER_MIN_PARTS each, so a fleet's telemetry stays a bounded number of files too
WRITER_TELEMETRY_PARTS = 96
WRITER_MIN_TELEMETRY_PARTS = 4
# a merge's DuckDB memory: past it the sort and the deduplication spill to a directory under the store's
# tmp (deleted after), so the memory a merge takes does not grow with the rows merged (without it: 3.9 GB
# for 1M outputs of 1.5 KB, and a 5M-request merge was killed on a 24 GB machine). DuckDB's sort needs
# room per thread: 1M outputs of 1.5 KB fit 1 GB, not 512 MB (`batchgen bench compact-memory`); a merge
# that does not fit fails naming this setting, its inputs untouched
MERGE_MEMORY_ENV = "BATCHGEN_STORE_MERGE_MEMORY"
MERGE_MEMORY_LIMIT = os.environ.get(MERGE_MEMORY_ENV, "1GB")
# ... and a row group of the file it writes is at most this big (the writer holds one whole in memory:
# 100,000 outputs of a few KB each would not fit the limit above)
MERGE_ROW_GROUP_BYTES = "64MB"

# kinds whose merges by a writer (compact_written) are not sorted: the outputs' text makes their sort most
# of a merge (outputs of 17 MB took 13 s in a writer, 10 s of CPU, against 1.3-1.8 s for requests of the
# same size; 5.1M rows: about 7 s sorted, 2 s not). A writer's merge holds the recent shards only, which
# its row groups' statistics still tell from the rest; the janitor's merges sort them (`_SORT`)
_UNSORTED_BY_WRITERS = frozenset({"outputs"})
# kind -> ORDER BY of its compacted file (row groups then prune well for the dashboard's filters)
_SORT = {
    "outputs": "_bg_shard_id, _bg_part",
    "requests": "shard_id, finished_ts",
    "request_digests": "shard_id, attempt",
    "iterations": "ts",
    "commits": "shard_id, committed_ts",
    "shard_events": "shard_id, ts",
}


@dataclass
class CompactionReport:
    """What one call to `compact*` did."""

    groups: int = 0  # groups merged into a new file
    files_in: int = 0  # files merged (raw parts + earlier compacted files)
    rows: int = 0  # rows written to new compacted files
    skipped: list[str] = field(default_factory=list)  # why some groups / jobs were left alone
    deleted: int = 0  # files removed by garbage collection in this call

    def add(self, other: CompactionReport) -> None:
        self.groups += other.groups
        self.files_in += other.files_in
        self.rows += other.rows
        self.skipped += other.skipped
        self.deleted += other.deleted


# ---------------------------------------------------------------- entry points


def compact(data_dir: str | os.PathLike, *, grace_s: float = GRACE_S,
            min_age_s: float = 30.0) -> CompactionReport:
    """Compact every finished job, the parts of running ones (`compact_live_job`) and all telemetry,
    collect garbage, refresh the catalog file."""
    layout = init_data_dir(data_dir)
    report = CompactionReport()
    finished = _finished_jobs(layout)
    for job_id in finished:
        report.add(compact_job(layout.root, job_id, force=True))
    for job_id in sorted(set().union(*(_groups(layout, kind) for kind in JOB_KINDS)) - set(finished)):
        report.add(compact_live_job(layout.root, job_id, min_age_s=min_age_s))
    report.add(compact_telemetry(layout.root, min_age_s=min_age_s))
    report.add(settle_suspects(layout.root))
    report.deleted += collect_garbage(layout.root, grace_s=grace_s)
    write_catalog(layout.root)
    return report


def compact_job(data_dir: str | os.PathLike, job_id: str, *, force: bool = False) -> CompactionReport:
    """Merge a finished job's parts (every job-scoped kind) into one file per kind.

    A job that is not completed, failed or cancelled is skipped unless `force` (compacting a running
    job is still correct, only wasteful: its new parts stay raw until the next compaction).
    """
    layout = init_data_dir(data_dir)
    check_id("job_id", job_id)
    report = CompactionReport()
    if not force and _job_status(layout, job_id) not in TERMINAL:
        report.skipped.append(f"job {job_id} is not finished")
        return report
    for kind in JOB_KINDS:
        report.add(compact_group(layout, kind, job_id))
    return report


def compact_live_job(data_dir: str | os.PathLike, job_id: str, *, min_age_s: float = 30.0,
                     min_parts: int | None = None, max_compacted: int | None = None) -> CompactionReport:
    """Compact a job that is still running, incrementally (see the module docstring): per kind, its raw
    parts older than `min_age_s` once there are `min_parts` (LIVE_MIN_PARTS) of them, with the smallest
    compacted files once there are more than `max_compacted` (LIVE_MAX_COMPACTED)."""
    min_parts = LIVE_MIN_PARTS if min_parts is None else min_parts
    max_compacted = LIVE_MAX_COMPACTED if max_compacted is None else max_compacted
    layout = init_data_dir(data_dir)
    check_id("job_id", job_id)
    report = CompactionReport()
    for kind in JOB_KINDS:
        with _group_lock(layout, kind, job_id) as locked:
            if not locked:
                report.skipped.append(f"{kind}/{job_id}: another compactor holds the lock")
                continue
            report.add(_merge_live(layout, kind, job_id, min_age_s=min_age_s, min_parts=min_parts,
                                   max_compacted=max_compacted))
    return report


def _merge_live(layout: Layout, kind: str, group: str, *, min_age_s: float, min_parts: int,
                max_compacted: int, max_bytes: int | None = None, sort: bool = True) -> CompactionReport:
    """One step of a live group's compaction, its lock held: the raw parts older than `min_age_s` once
    there are `min_parts`, with the smallest compacted files once there are more than `max_compacted`
    (and, with `max_bytes`, they add up to less than that); `sort`: in the kind's order (`_SORT`)."""
    report = CompactionReport()
    compacted, raw = _live_inputs(layout, kind, group, min_age_s)
    inputs = list(raw) if len(raw) >= min_parts else []
    if len(compacted) > max_compacted:  # the smallest first: sizes grow geometrically
        smallest = sorted(compacted, key=lambda p: _size(p))[:max_compacted]
        if max_bytes is None or sum(_size(p) for p in smallest) < max_bytes:
            inputs += smallest
    if len(inputs) < 2:
        return report
    report.rows, output = _merge(layout, kind, inputs, layout.compacted_dir(kind, group), sort=sort)
    _write_tombstone(layout, kind, group, inputs, output, grace_s=LIVE_GRACE_S)
    report.groups, report.files_in = 1, len(inputs)
    return report


def compact_telemetry(data_dir: str | os.PathLike, *, min_age_s: float = 30.0) -> CompactionReport:
    """Merge each worker's iterations parts (and each sweep's parts) older than `min_age_s`; their
    inputs go after LIVE_GRACE_S (telemetry keeps coming)."""
    layout = init_data_dir(data_dir)
    report = CompactionReport()
    for kind in ("iterations", "sweeps"):
        for group in _groups(layout, kind):
            report.add(compact_group(layout, kind, group, min_age_s=min_age_s, grace_s=LIVE_GRACE_S))
    return report


def compact_written(layout: Layout, kinds: tuple[str, ...], group: str) -> CompactionReport:
    """What a writer does after writing a group's parts (see the module docstring): per kind, once
    WRITER_MIN_PARTS raw parts of the group wait, merge them (any age) and, past LIVE_MAX_COMPACTED,
    the smallest compacted files; delete the group's inputs whose grace is over. One directory
    listing per kind when there is nothing to do; a group another process holds is skipped."""
    report = CompactionReport()
    if WRITER_MIN_PARTS <= 0:
        return report
    for kind in kinds:
        min_parts = _telemetry_min_parts(layout, kind) if kind in _PER_WORKER else WRITER_MIN_PARTS
        if _count_files(layout.raw_dir(kind, group)) < min_parts:
            continue
        with _group_lock(layout, kind, group) as locked:
            if not locked:
                report.skipped.append(f"{kind}/{group}: another compactor holds the lock")
                continue
            report.deleted += _collect_group(layout, kind, group)
            report.add(_merge_live(layout, kind, group, min_age_s=0.0, min_parts=min_parts,
                                   max_compacted=LIVE_MAX_COMPACTED, max_bytes=WRITER_MAX_MERGE_BYTES,
                                   sort=kind not in _UNSORTED_BY_WRITERS))
    return report


_PER_WORKER = ("iterations",)  # kinds grouped by worker (see WRITER_TELEMETRY_PARTS)


def _telemetry_min_parts(layout: Layout, kind: str) -> int:
    """WRITER_TELEMETRY_PARTS shared among the kind's groups (every worker that wrote some), between
    WRITER_MIN_TELEMETRY_PARTS and WRITER_MIN_PARTS."""
    groups = max(_count_files(layout.kind_dir(kind) / "raw"), 1)
    return max(WRITER_MIN_TELEMETRY_PARTS, min(WRITER_MIN_PARTS, WRITER_TELEMETRY_PARTS // groups))


def compact_group(layout: Layout, kind: str, group: str, *, min_age_s: float = 0.0,
                  grace_s: float | None = None) -> CompactionReport:
    """Merge one group's raw parts and compacted files into one new compacted file (its inputs go
    after `grace_s`, default GRACE_S)."""
    report = CompactionReport()
    with _group_lock(layout, kind, group) as locked:
        if not locked:
            report.skipped.append(f"{kind}/{group}: another compactor holds the lock")
            return report
        inputs = _inputs(layout, kind, group, min_age_s)
        if len(inputs) < 2 and not any(p.parent.parent.name == "raw" for p in inputs):
            return report  # nothing, or one file that is already compacted
        report.rows, output = _merge(layout, kind, inputs, layout.compacted_dir(kind, group))
        _write_tombstone(layout, kind, group, inputs, output, grace_s=grace_s)
        report.groups, report.files_in = 1, len(inputs)
    return report


def settle_suspects(data_dir: str | os.PathLike, *, now: float | None = None) -> CompactionReport:
    """Settle the `.suspect` markers whose lock holder is gone (see SUSPECT_MAX_AGE_S): merge every file
    of the group that no compaction merged yet into one, each part once (the marker makes the merge
    deduplicate: listing.files_disjoint), then remove the marker. Outputs of the same inputs by the holder
    and by the lock breaker are then merged inputs, left out of every listing, and the kind's scans read
    its files as they are again."""
    layout = init_data_dir(data_dir)
    now = time.time() if now is None else now
    report = CompactionReport()
    for marker in sorted(layout.gc.glob(f"*{SUSPECT_SUFFIX}")):
        fields = parse_marker(marker.name, SUSPECT_SUFFIX)
        if fields is None or not _suspect_settled(marker, now):
            continue
        kind, group, _ = fields
        merged = compact_group(layout, kind, group)  # deduplicating: the marker is still there
        report.add(merged)
        if not merged.skipped:  # it held the lock: each part of the group is in one unmerged file now
            marker.unlink(missing_ok=True)
    return report


def _suspect_settled(marker: Path, now: float) -> bool:
    """Whether the holder of the lock a `.suspect` marker was written for is gone: its process on this
    host no longer runs, or the marker is older than SUSPECT_MAX_AGE_S (another host, or a marker that
    does not say)."""
    return now - _mtime(marker, now) > SUSPECT_MAX_AGE_S or _process_gone(_read(marker))


def collect_garbage(data_dir: str | os.PathLike, *, grace_s: float = GRACE_S) -> int:
    """Delete the inputs of compactions older than `grace_s`, and stale temporary files; how many.

    Never before the compacted file that replaces them counts in the views (`ACTIVATION_DELAY_S`
    plus the clock skew), whatever `grace_s` says; the default grace also lets every query that
    started before that moment finish.
    """
    layout = init_data_dir(data_dir)
    deleted = 0
    now = time.time()
    for tomb in sorted(layout.gc.glob("*.json")):
        info = read_tombstone(tomb)
        if info is None or not _due(info, grace_s, now):
            continue
        with _group_lock(layout, info["kind"], info["group"]) as locked:
            if locked and tomb.exists():  # a writer (compact_written) may have collected it meanwhile
                deleted += _delete(_superseded(layout, info))
                tomb.unlink()
    stale = [p for p in layout.tmp.iterdir() if now - _mtime(p, now) > TMP_MAX_AGE_S]
    return deleted + _delete(stale + rollups.orphans(layout, now) + _stale_markers(layout, now))


def _stale_markers(layout: Layout, now: float) -> list[Path]:
    """`.renaming` markers of dead compactors whose output is gone (never renamed in, or merged and
    collected since): one whose output is still there keeps its group read part by part."""
    stale = []
    for marker in layout.gc.glob(f"*{RENAMING_SUFFIX}"):
        fields = parse_marker(marker.name, RENAMING_SUFFIX)
        if fields is None or now - _mtime(marker, now) <= STALE_LOCK_S:
            continue
        kind, group, uid = fields
        if not any(layout.compacted_dir(kind, group).glob(f"c*~{uid}.parquet")):
            stale.append(marker)
    return stale


def _superseded(layout: Layout, info: dict) -> list[Path]:
    """The files a tombstone lets go: its inputs, and the twins of its compacted ones."""
    files = [layout.file(p) for p in info["files"]]
    if info["kind"] in rollups.TWINNED_KINDS:
        files += [rollups.twin_of(layout, p) for p in files if p.parent.parent.name == "compacted"]
    return files


def _due(info: dict, grace_s: float, now: float) -> bool:
    """Whether a tombstone's inputs may go: after the smaller of `grace_s` and its own grace, and never
    before the compacted file that replaces them counts (ACTIVATION_DELAY_S plus the clock skew)."""
    floor = catalog.ACTIVATION_DELAY_S + catalog.clock_skew_s()
    grace = max(min(max(grace_s, floor), info.get("grace_s", grace_s)), floor)
    return now - info["superseded_at"] >= grace


def _collect_group(layout: Layout, kind: str, group: str) -> int:
    """Delete the inputs of the group's tombstones that are due (its lock held); how many files."""
    deleted, now = 0, time.time()
    for tomb in sorted(layout.gc.glob(f"{kind}~{group}~*.json")):
        info = read_tombstone(tomb)
        if info is None or info["kind"] != kind or info["group"] != group or not _due(info, GRACE_S, now):
            continue
        deleted += _delete(_superseded(layout, info))
        tomb.unlink(missing_ok=True)
    return deleted


# ---------------------------------------------------------------- internals


def _finished_jobs(layout: Layout) -> list[str]:
    rows = _query(layout, "SELECT job_id FROM jobs WHERE status IN ('completed', 'failed', 'cancelled') "
                          "ORDER BY job_id")
    return [r[0] for r in rows]


def _job_status(layout: Layout, job_id: str) -> str | None:
    rows = _query(layout, "SELECT status FROM jobs WHERE job_id = ?", [job_id])
    return rows[0][0] if rows else None


def _query(layout: Layout, sql: str, params: list | None = None) -> list[tuple]:
    """Rows of a query over the views; run again when a part it listed was deleted before it was read
    (another process's garbage collection)."""
    con = connect(layout.root)
    try:
        return execute_listed(con, sql, params, layout=layout)[1]
    finally:
        con.close()


def _groups(layout: Layout, kind: str) -> list[str]:
    raw = layout.kind_dir(kind) / "raw"
    return sorted(p.name for p in raw.iterdir() if p.is_dir()) if raw.is_dir() else []


def _inputs(layout: Layout, kind: str, group: str, min_age_s: float) -> list[Path]:
    """The group's files not yet merged by an earlier compaction (those wait for garbage collection)."""
    now = time.time()
    merged = _merged_already(layout, kind, group)
    compacted = sorted(p for p in layout.compacted_dir(kind, group).glob("*.parquet") if p not in merged)
    raw = sorted(p for p in layout.raw_dir(kind, group).glob("*.parquet")
                 if p not in merged and now - _mtime(p, now) >= min_age_s)
    return compacted + raw


def _live_inputs(layout: Layout, kind: str, group: str, min_age_s: float) -> tuple[list[Path], list[Path]]:
    """(compacted files, raw parts older than `min_age_s`) of a group, none merged already."""
    files = _inputs(layout, kind, group, min_age_s)
    return ([p for p in files if p.parent.parent.name == "compacted"],
            [p for p in files if p.parent.parent.name == "raw"])


def _count_files(directory: Path) -> int:
    """Entries in a directory (0 when it does not exist): a cheap upper bound on its parts."""
    try:
        with os.scandir(directory) as entries:
            return sum(1 for _ in entries)
    except FileNotFoundError:
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _merged_already(layout: Layout, kind: str, group: str) -> set[Path]:
    files: set[Path] = set()
    for tomb in layout.gc.glob(f"{kind}~{group}~*.json"):
        info = read_tombstone(tomb)
        if info is not None:
            files.update(layout.file(p) for p in info["files"])
    return files


def _compacted_name(uid: str) -> str:
    """c<10**16 - epoch_us>~<uid>.parquet: the views read the time back from the name (a compacted
    file counts ACTIVATION_DELAY_S after it), and newer files sort first within a group."""
    return f"c{10**16 - time.time_ns() // 1000:016d}~{uid}.parquet"


def _merge(layout: Layout, kind: str, inputs: list[Path], out_dir: Path, *,
           sort: bool = True) -> tuple[int, Path]:
    """Write the deduplicated union of `inputs` (files of one group, its lock held) into out_dir (temp
    name, then rename), in the kind's order (`_SORT`) unless not `sort`; (rows written, the file)."""
    files = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in inputs) + "]"
    order = f" ORDER BY {_SORT[kind]}" if sort and kind in _SORT else ""
    tmp = layout.tmp / f"{new_uid()}.compacted.tmp"
    twin_tmp = layout.tmp / f"{new_uid()}.rollups.tmp"
    if files_disjoint(layout, kind, [str(p) for p in inputs]):
        # no part is in two inputs (listing.files_disjoint): their union is already deduplicated. Without
        # the window over every row, 1M short outputs merge unsorted in a fifth less CPU (sorted: 8%)
        select = (f"SELECT * FROM read_parquet({files}, union_by_name = true, hive_partitioning = false)"
                  f"{order}")
    else:  # a part in two inputs is taken from one of them
        select = (f"SELECT * EXCLUDE (_bg_file) FROM read_parquet({files}, union_by_name = true, "
                  "hive_partitioning = false, filename = '_bg_file') "
                  f"QUALIFY _bg_file = min(_bg_file) OVER (PARTITION BY _bg_part){order}")
    spill = layout.tmp / f"{new_uid()}.spill"
    uid = None
    # rows in any order but ORDER BY's: kept in the inputs' order, an unsorted merge without the window
    # buffered them (200,000 outputs of 1.5 KB: 3.4-3.9 s of CPU and 740 MB, against 2.3-3.1 s and 560 MB)
    con = duckdb.connect(":memory:", config={"memory_limit": MERGE_MEMORY_LIMIT, "temp_directory": str(spill),
                                             "preserve_insertion_order": False})
    try:
        try:
            con.execute(f"COPY ({select}) TO '{tmp}' (FORMAT parquet, COMPRESSION {codec(kind)}, "
                        f"ROW_GROUP_SIZE 100000, ROW_GROUP_SIZE_BYTES '{MERGE_ROW_GROUP_BYTES}')")
        except duckdb.OutOfMemoryException as exc:
            raise StoreError(f"merging {len(inputs)} {kind} file(s) into {out_dir} needs more than "
                             f"{MERGE_MEMORY_LIMIT} ({MERGE_MEMORY_ENV}); nothing was changed: "
                             f"{str(exc).splitlines()[0]}") from exc
        rows = con.execute(f"SELECT count(*) FROM read_parquet('{tmp}')").fetchall()[0][0]
        _fsync(tmp)
        if kind in rollups.TWINNED_KINDS:  # its twin, renamed in before it (jobs.store.rollups)
            con.execute("SET preserve_insertion_order = true")  # a twin's ORDER BY is kept as written
            con.execute(f"COPY ({rollups.twin_select(kind, f'read_parquet({_q(tmp)})')}) TO {_q(twin_tmp)} "
                        f"({rollups.twin_copy_options(kind)})")
            _fsync(twin_tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        # the marker names the output before it is in place (removed with the tombstone)
        uid = MARKED_UID_PREFIX + new_uid()
        write_atomic(layout.gc / marker_name(kind, out_dir.name, uid, RENAMING_SUFFIX), b"", layout.tmp)
        output = out_dir / _compacted_name(uid)
        if kind in rollups.TWINNED_KINDS:
            twin = rollups.twin_of(layout, output)
            twin.parent.mkdir(parents=True, exist_ok=True)
            os.replace(twin_tmp, twin)
        os.replace(tmp, output)  # named at the last moment: see _compacted_name
    except BaseException:
        if uid is not None and not any(out_dir.glob(f"c*~{uid}.parquet")):  # nothing renamed in
            (layout.gc / marker_name(kind, out_dir.name, uid, RENAMING_SUFFIX)).unlink(missing_ok=True)
        raise
    finally:
        con.close()
        for path in (tmp, twin_tmp):
            if path.exists():
                path.unlink()
        shutil.rmtree(spill, ignore_errors=True)
    return rows, output


def _q(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def _fsync(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def _write_tombstone(layout: Layout, kind: str, group: str, inputs: list[Path], output: Path,
                     grace_s: float | None = None) -> None:
    """Record a compaction: its inputs (deleted after the grace) and the output that holds their rows
    (readers leave the inputs out of their listing once they list the output: `listing.list_files`)."""
    body = {"kind": kind, "group": group, "superseded_at": time.time(),
            "files": [layout.relative(p) for p in inputs], "output": layout.relative(output)}
    if grace_s is not None:  # shorter than collect_garbage's (a running job's parts: LIVE_GRACE_S)
        body["grace_s"] = grace_s
    write_atomic(layout.gc / f"{kind}~{group}~{new_uid()}.json", json.dumps(body).encode(), layout.tmp)
    (layout.gc / marker_name(kind, group, compacted_uid(output), RENAMING_SUFFIX)).unlink(missing_ok=True)


@contextmanager
def _group_lock(layout: Layout, kind: str, group: str) -> Iterator[bool]:
    """Yield True holding the group's lock, False when another live process holds it."""
    path = layout.locks / f"{kind}~{group}.lock"
    fd = _try_lock(path)
    holder = _read(path) if fd is None else ""
    gone = fd is None and _process_gone(holder)
    if fd is None and (gone or time.time() - _mtime(path, time.time()) > STALE_LOCK_S):
        if not gone:  # its holder may still run, and write an output of the inputs the next one merges
            write_atomic(layout.gc / marker_name(kind, group, new_uid(), SUSPECT_SUFFIX), holder.encode(),
                         layout.tmp)
        path.unlink(missing_ok=True)
        fd = _try_lock(path)
    if fd is None:
        yield False
        return
    try:
        os.write(fd, f"{socket.gethostname()} {os.getpid()} {time.time()}\n".encode())
        os.close(fd)
        yield True
    finally:
        path.unlink(missing_ok=True)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):  # gone, or half-written
        return ""


def _process_gone(holder: str) -> bool:
    """Whether a lock's holder ("<host> <pid> <time>", as `_group_lock` writes it) is a process of this host
    that no longer runs (a writer killed while it compacted: writers compact too, so a lock should not
    wait STALE_LOCK_S for them)."""
    try:
        host, pid = holder.split()[:2]
        if host != socket.gethostname() or int(pid) == os.getpid():
            return False
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):  # half-written (the holder is writing it), or not ours
        return False
    return False


def _try_lock(path: Path) -> int | None:
    try:
        return os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None


def _mtime(path: Path, default: float) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return default


def _delete(paths) -> int:
    n = 0
    for p in paths:
        try:
            if p.is_dir():  # a merge's spill directory left by a dead compactor
                shutil.rmtree(p)
            else:
                p.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n


__all__ = ["CompactionReport", "GRACE_S", "StoreError", "collect_garbage", "compact", "compact_group",
           "compact_job", "compact_telemetry", "compact_written", "settle_suspects"]
