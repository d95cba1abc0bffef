"""The store's files as a query should see them: one listing per query, compaction's merged inputs left out.

A view over a glob opens every file the glob matches, and while a job runs most of them are the inputs
of compactions waiting out their grace period (`compact.LIVE_GRACE_S`): a fast job's store holds a few
hundred live files and a few thousand merged ones, and each query opened them all. `list_files(layout)`
lists each kind's files the way the glob does, then leaves out every input of a compaction whose
output is in the same listing: that output holds the input's rows (`_bg_part` kept), so the scan takes
them from there (catalog.py's rule for a part it does not list). The inputs stay on disk through their
grace, so a query that listed one before it was merged still opens it.

`pin(con)` puts a fresh listing in the connection's variable LISTING_VARIABLE; the views of a
`connect()` connection read it (catalog.py) while it is younger than MAX_AGE_S, and their glob
otherwise, so a connection that never pins, or pinned long ago, still answers right: only slower.
Every scan of a query reads the same pinned list, and the views' time fences use the listing's time
instead of the query's start (a commit counts once `committed_ts <= listed_at`; its parts were renamed
into place before it, so before the listing began: they are listed, or the compacted file holding
them is).

A tombstone (`store/gc/*.json`, written by the compactor after its output is renamed into place)
names the compaction's inputs and, since this module, its output; one without an output (written by
an older batchgen) leaves its inputs listed. Tombstones never change once written, so their content
is kept between listings (`merged_files`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import duckdb

from jobs.store import rollups
from jobs.store.layout import Layout, StoreError, check_id
from jobs.store.schemas import JOB_KINDS, KINDS

LISTING_VARIABLE = "_bg_listing"  # struct {listed_at, <kind>: [files]} of the latest pin
# a pinned listing older than this is not used (the views read their globs): a listed file is deleted
# no sooner than ACTIVATION_DELAY_S (5 s) after it was merged, so a listing this young names files
# that are still there, bar one merged at the very moment it was taken (then the query runs again)
MAX_AGE_S = 2.0
DATA_DIR_MACRO = "_bg.data_dir"  # a `connect()` connection's data dir, for `pin`


@dataclass(frozen=True)
class Listing:
    listed_at: float  # epoch seconds, taken before the first directory was read
    files: dict[str, list[str]]  # kind -> its Parquet files (absolute paths), merged inputs left out
    left_out: int  # merged inputs left out
    # the rollup twins of the listed compacted iterations files (and the twins' schema file), and the
    # listed iterations files without one (jobs.store.rollups.twins_listed)
    iteration_twins: list[str] = field(default_factory=list)
    iterations_untwinned: list[str] = field(default_factory=list)

    def variable(self) -> dict:
        return {"listed_at": self.listed_at, **self.files, "iteration_twins": self.iteration_twins,
                "iterations_untwinned": self.iterations_untwinned}


def list_files(layout: Layout, job_id: str | None = None) -> Listing:
    """Every kind's Parquet files under its directory (as `Layout.glob` matches them), less the inputs
    of compactions whose output this listing holds. With `job_id`, the job kinds' files of that job only
    (and their `_schema.parquet`): for a query whose answer depends on that job's rows alone, which then
    opens none of the other jobs' files."""
    listed_at = time.time()
    files = {kind: _walk(layout.kind_dir(kind)) if job_id is None or kind not in JOB_KINDS
             else _job_files(layout, kind, job_id) for kind in KINDS}
    listed = {path for paths in files.values() for path in paths}
    merged: set[str] = set()
    for output, inputs in merged_files(layout):  # after the data: a tombstone follows its output
        if output in listed:
            merged.update(inputs)
    # a kind with no file at all (its `_schema.parquet` gone) keeps its glob: the same error as before
    kept = {kind: [p for p in paths if p not in merged] or [layout.glob(kind)]
            for kind, paths in files.items()}
    twins, untwinned = rollups.twins_listed(layout, kept[rollups.KIND])
    twins = [str(rollups.schema_file(layout)), *twins]
    return Listing(listed_at, kept, len(merged & listed), twins, untwinned)


def _job_files(layout: Layout, kind: str, job_id: str) -> list[str]:
    schema = layout.kind_dir(kind) / "_schema.parquet"
    try:
        check_id("job_id", job_id)
    except StoreError:  # no such job can have parts
        return [str(schema)]
    found = _walk(layout.raw_dir(kind, job_id)) + _walk(layout.compacted_dir(kind, job_id))
    return sorted(found + [str(schema)] if schema.exists() else found)


def _walk(directory: Path) -> list[str]:
    """Files named *.parquet under `directory`, at any depth (the glob `**/*.parquet`), sorted."""
    found: list[str] = []
    stack = [str(directory)]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=True):
                        stack.append(entry.path)
                    elif entry.name.endswith(".parquet"):
                        found.append(entry.path)
        except (FileNotFoundError, NotADirectoryError):  # a group directory removed meanwhile
            continue
    return sorted(found)


# tombstone path -> (its output, its inputs), absolute; a tombstone is written once, atomically
_TOMBSTONES: dict[str, tuple[str | None, tuple[str, ...]]] = {}
_TOMBSTONES_LOCK = threading.Lock()


def read_tombstone(path: Path) -> dict | None:
    """A tombstone's content, or None when another collector removed it meanwhile."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def merged_files(layout: Layout) -> list[tuple[str | None, tuple[str, ...]]]:
    """(output, inputs) of every compaction whose tombstone is in the data dir now, as absolute paths;
    the output is None in a tombstone written before they named it. Each tombstone is read once per
    process."""
    gc_dir = str(layout.gc)
    try:
        names = [e.path for e in os.scandir(gc_dir) if e.name.endswith(".json")]
    except FileNotFoundError:
        return []
    out = []
    with _TOMBSTONES_LOCK:
        for gone in set(_TOMBSTONES).difference(names):
            if os.path.dirname(gone) == gc_dir:
                del _TOMBSTONES[gone]
        for name in names:
            found = _TOMBSTONES.get(name)
            if found is None:
                info = read_tombstone(Path(name))
                if info is None:
                    continue
                output = info.get("output")
                found = (None if output is None else str(layout.file(output)),
                         tuple(str(layout.file(p)) for p in info["files"]))
                _TOMBSTONES[name] = found
            out.append(found)
    return out


def pin(con: duckdb.DuckDBPyConnection, layout: Layout | None = None, *,
        job_id: str | None = None) -> Listing | None:
    """List the store's files for the next queries on this cursor (see the module docstring), the job
    kinds' of `job_id` only when given (`list_files`). The data dir is the connection's own (`connect`
    records it); None, pinning nothing, on a connection that is not a `connect()` one."""
    if layout is None:
        root = data_dir_of(con)
        if root is None:
            return None
        layout = Layout.of(root)
    listing = list_files(layout, job_id)
    con.execute(f"SET VARIABLE {LISTING_VARIABLE} = $1", [listing.variable()])
    return listing


def data_dir_of(con: duckdb.DuckDBPyConnection) -> str | None:
    """The data dir whose views a `connect()` connection (or a cursor of one) holds, else None."""
    try:
        return con.execute(f"SELECT {DATA_DIR_MACRO}()").fetchone()[0]
    except duckdb.CatalogException:
        return None


T = TypeVar("T")
LISTED_TRIES = 4  # a query whose part the compactor deleted after the listing runs again (listed anew)


def execute_listed(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None, *,
                   layout: Layout | None = None, job_id: str | None = None,
                   tries: int = LISTED_TRIES) -> duckdb.DuckDBPyConnection:
    """`con.execute(sql, params)` over a listing pinned for it (`pin`); on a file error (a part listed,
    then deleted by garbage collection before it was read: the views stay correct, the query only has
    to list again) listed and run again, up to `tries` times in all."""
    return run_listed(con, lambda c: c.execute(sql, params or []), layout=layout, job_id=job_id, tries=tries)


def run_listed(con: duckdb.DuckDBPyConnection, work: Callable[[duckdb.DuckDBPyConnection], T], *,
               layout: Layout | None = None, job_id: str | None = None, tries: int = LISTED_TRIES) -> T:
    """`work(con)`, a few queries, over one listing pinned for all of them (`pin`), made again and
    `work` run again from its start on a file error, as `execute_listed` does for one query."""
    for attempt in range(tries):
        try:
            pin(con, layout, job_id=job_id)
            return work(con)
        except duckdb.IOException:
            if attempt == tries - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")
