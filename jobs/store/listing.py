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
`over_listing(con)` pins one for the queries inside and runs them in the listed catalog (catalog.py)
where the listing holds each part of every kind in one file (`Listing.disjoint`).
Every scan of a query reads the same pinned list, and the views' time fences use the listing's time
instead of the query's start (a commit counts once `committed_ts <= listed_at`; its parts were renamed
into place before it, so before the listing began: they are listed, or the compacted file holding
them is).

A tombstone (`store/gc/*.json`, written by the compactor after its output is renamed into place)
names the compaction's inputs and, since this module, its output; one without an output (written by
an older batchgen) leaves its inputs listed. Tombstones never change once written, so their content
is kept between listings (`gc_records`).

A listing also tells, per kind, whether no part is in two of its files (`Listing.disjoint`): then a
scan reads the files as they are, without choosing per part the file its rows come from (catalog.py).
Left out the merged inputs, a part is in two listed files only in these cases, each of which the
listing sees in the gc directory, read (twice, one read after the other) after the data:
- a compaction's output renamed in, its tombstone not written yet (or its compactor died): the
  compactor writes a marker `<kind>~<group>~<uid>.renaming` before the rename and removes it after
  the tombstone (`compact._merge`), so the listing sees the marker, the tombstone, or neither, and
  then the tombstone was collected, whose inputs go before it: a listed input deleted before the
  query fails it (it runs again, listed anew). Two reads because a file written or removed during a
  directory read may be missed: the marker is there for all of the first, or the tombstone for all of
  the second, or it is gone with the inputs;
- two compactions that merged the same inputs (a lock broken while its holder still ran): their
  tombstones share an input, or the lock breaker's marker `<kind>~<group>~<uid>.suspect` stays (until
  the janitor, once the holder is gone, merges the group's files deduplicating: `compact.settle_suspects`);
- a tombstone without an output (an older batchgen), whose inputs are listed;
- a compaction by a batchgen from before the markers, which died between its rename and its tombstone.
  Its outputs' names lack MARKED_UID_PREFIX; one that no tombstone names, beside other listed files of
  its group, may be such an output (or one whose tombstone was collected: the listing cannot tell).
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import duckdb

from jobs.store import rollups
from jobs.store.layout import Layout, StoreError, check_id
from jobs.store.schemas import JOB_KINDS, KINDS, SAMPLED_KIND

LISTING_VARIABLE = "_bg_listing"  # struct {listed_at, <kind>: [files]} of the latest pin
# a pinned listing older than this is not used (the views read their globs): a listed file is deleted
# no sooner than ACTIVATION_DELAY_S (5 s) after it was merged, so a listing this young names files
# that are still there, bar one merged at the very moment it was taken (then the query runs again)
MAX_AGE_S = 2.0
DATA_DIR_MACRO = "_bg.data_dir"  # a `connect()` connection's data dir, for `pin`
# A `connect()` connection's views are in two catalogs: the default one's scans read any listing (or
# their globs), the listed one's read the pinned listing as it is (catalog.py). `over_listing` makes the
# listed one the cursor's catalog (`USE`) where the listing holds each part of every kind in one file.
DEFAULT_CATALOG = "memory"  # DuckDB's name for an in-memory connection's own catalog
LISTED_CATALOG = "_bg_listed"
LISTED_CATALOG_MACRO = "_bg.listed_catalog"  # its name, on a connection that has one (for `pin`)


@dataclass(frozen=True)
class Listing:
    listed_at: float  # epoch seconds, taken before the first directory was read
    files: dict[str, list[str]]  # kind -> its Parquet files (absolute paths), merged inputs left out
    left_out: int  # merged inputs left out
    # the rollup twins of the listed compacted iterations files (and the twins' schema file), and the
    # listed iterations files without one (jobs.store.rollups.twins_listed)
    iteration_twins: list[str] = field(default_factory=list)
    iterations_untwinned: list[str] = field(default_factory=list)
    # kind -> no part of it is in two of its listed files (see the module docstring)
    disjoint: dict[str, bool] = field(default_factory=dict)
    # the same for the request digests' sample twins (their schema file first) and the listed digests
    # files without one; and those with one (the digests' schema file first)
    digest_twins: list[str] = field(default_factory=list)
    digests_untwinned: list[str] = field(default_factory=list)
    digests_twinned: list[str] = field(default_factory=list)

    def variable(self) -> dict:
        return {"listed_at": self.listed_at, **self.files, "iteration_twins": self.iteration_twins,
                "iterations_untwinned": self.iterations_untwinned,
                "disjoint": {kind: self.disjoint.get(kind, False) for kind in KINDS},
                "digest_twins": self.digest_twins, "digests_untwinned": self.digests_untwinned,
                "digests_twinned": self.digests_twinned}


def list_files(layout: Layout, job_id: str | None = None) -> Listing:
    """Every kind's Parquet files under its directory (as `Layout.glob` matches them), less the inputs
    of compactions whose output this listing holds. With `job_id`, the job kinds' files of that job only
    (and their `_schema.parquet`): for a query whose answer depends on that job's rows alone, which then
    opens none of the other jobs' files."""
    listed_at = time.time()
    files = {kind: _walk(layout.kind_dir(kind)) if job_id is None or kind not in JOB_KINDS
             else _job_files(layout, kind, job_id) for kind in KINDS}
    listed = {path for paths in files.values() for path in paths}
    # after the data: a tombstone follows its output (twice: see the module docstring)
    first, second = gc_records(layout), gc_records(layout)
    tombstones = {**first.tombstones, **second.tombstones}
    merged: set[str] = set()
    for output, inputs in tombstones.values():
        if output in listed:
            merged.update(inputs)
    # a kind with no file at all (its `_schema.parquet` gone) keeps its glob: the same error as before
    kept = {kind: [p for p in paths if p not in merged] or [layout.glob(kind)]
            for kind, paths in files.items()}
    twins, untwinned = _twins(layout, kept, rollups.KIND)
    digest_twins, digests_untwinned = _twins(layout, kept, SAMPLED_KIND)
    overlapping = _overlapping(tombstones.values(), {p for paths in kept.values() for p in paths})
    overlapping |= _unmarked_leftovers(layout, kept, {output for output, _ in tombstones.values()})
    renaming, suspect = first.renaming | second.renaming, first.suspect | second.suspect
    disjoint = {kind: _disjoint(layout, kind, paths, overlapping, renaming, suspect)
                for kind, paths in kept.items()}
    untwinned_set = set(digests_untwinned)
    twinned = [str(layout.schema_file(SAMPLED_KIND)),
               *(p for p in kept[SAMPLED_KIND] if p not in untwinned_set)]
    return Listing(listed_at, kept, len(merged & listed), twins, untwinned, disjoint, digest_twins,
                   digests_untwinned, twinned)


def _twins(layout: Layout, kept: dict[str, list[str]], kind: str) -> tuple[list[str], list[str]]:
    """(the kind's twins, its schema file first; its listed files without one): jobs.store.rollups."""
    twins, untwinned = rollups.twins_listed(layout, kept[kind], kind)
    return [str(rollups.schema_file(layout, kind)), *twins], untwinned


def _overlapping(tombstones, kept: set[str]) -> set[str]:
    """Listed files that may share a part with another listed file: the outputs of tombstones that share
    an input, and the listed inputs of a tombstone without an output."""
    found: set[str] = set()
    owner: dict[str, str] = {}
    for output, inputs in tombstones:
        if output is None:
            found.update(p for p in inputs if p in kept)
        elif output in kept:
            for p in inputs:
                other = owner.setdefault(p, output)
                if other != output:
                    found.update((other, output))
    return found


def _unmarked_leftovers(layout: Layout, kept: dict[str, list[str]], outputs: set[str | None]) -> set[str]:
    """Compacted files written before the markers (their uid lacks MARKED_UID_PREFIX) that no tombstone
    names and that share their group with other listed files: each may be the output of a compaction
    that died before its tombstone, beside its inputs. Alone in its group (a finished job compacted
    whole), such a file holds each of its parts once."""
    found: set[str] = set()
    for kind, paths in kept.items():
        unmarked = [p for p in paths if p not in outputs and _unmarked(p)]
        if not unmarked:
            continue
        groups = _groups_of(layout, kind, paths)
        per_group: dict[str | None, int] = {}
        for group in groups.values():
            per_group[group] = per_group.get(group, 0) + 1
        found.update(p for p in unmarked if per_group[groups[p]] > 1)
    return found


def _disjoint(layout: Layout, kind: str, paths: list[str], overlapping: set[str],
              renaming: set[str], suspect: set[tuple[str, str]]) -> bool:
    """Whether no part of `kind` is in two of `paths` (see the module docstring)."""
    if any("*" in p for p in paths) or overlapping.intersection(paths):
        return False
    if suspect and any((kind, g) in suspect for g in _groups_of(layout, kind, paths).values()):
        return False
    return not renaming or not any(compacted_uid(p) in renaming for p in paths)


def files_disjoint(layout: Layout, kind: str, paths: list[str]) -> bool:
    """Whether no part of `kind` is in two of `paths`: files of one group, none of them a merged input
    (a compactor's inputs, read with the group's lock held, so no other compaction of the group writes
    the gc records meanwhile: one read of them is enough). The same cases as a listing's `disjoint`."""
    records = gc_records(layout)
    tombstones = records.tombstones.values()
    overlapping = _overlapping(tombstones, set(paths))
    overlapping |= _unmarked_leftovers(layout, {kind: paths}, {output for output, _ in tombstones})
    return _disjoint(layout, kind, paths, overlapping, records.renaming, records.suspect)


def _groups_of(layout: Layout, kind: str, paths: list[str]) -> dict[str, str | None]:
    """path -> the group (job, worker, sweep directory) of each of `paths` of `kind`: raw/<group>/... or
    compacted/<group>/...; None for a file of no group (`_schema.parquet`)."""
    base = str(layout.kind_dir(kind)) + os.sep
    out: dict[str, str | None] = {}
    for path in paths:
        rel = path[len(base):].split(os.sep) if path.startswith(base) else []
        out[path] = rel[1] if len(rel) >= 3 else None
    return out


def _unmarked(path: str) -> bool:
    """Whether `path` is a compacted file named by a compactor from before the markers."""
    uid = compacted_uid(path)
    return uid is not None and not uid.startswith(MARKED_UID_PREFIX)


def compacted_uid(path: str | os.PathLike) -> str | None:
    """The uid in a compacted file's name (`c<16 digits>~<uid>.parquet`), else None."""
    name = os.path.basename(path)
    if not (name.startswith("c") and name.endswith(".parquet") and "~" in name):
        return None
    return name[:-len(".parquet")].split("~", 1)[1]


def _job_files(layout: Layout, kind: str, job_id: str) -> list[str]:
    schema = layout.schema_file(kind)
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
RENAMING_SUFFIX = ".renaming"  # <kind>~<group>~<uid>.renaming: an output renamed in before its tombstone
# the uids of compaction outputs named by a compactor that writes the markers start with this (new_uid()
# is hex: an older compactor's never do)
MARKED_UID_PREFIX = "m"
SUSPECT_SUFFIX = ".suspect"  # <kind>~<group>~<uid>.suspect: a group whose lock was broken while held


@dataclass(frozen=True)
class GcRecords:
    """What one read of the gc directory found (see the module docstring)."""

    tombstones: dict[str, tuple[str | None, tuple[str, ...]]]  # path -> (output, inputs), absolute
    renaming: set[str]  # uids of compaction outputs whose tombstone was not written yet
    suspect: set[tuple[str, str]]  # (kind, group) that two compactors may have merged alike


def gc_records(layout: Layout) -> GcRecords:
    """One read of the gc directory: its tombstones (each read once per process) and its markers."""
    try:
        with os.scandir(layout.gc) as entries:
            names = [e.name for e in entries]
    except FileNotFoundError:
        names = []
    renaming, suspect = set(), set()
    for name in names:
        if (marker := parse_marker(name, RENAMING_SUFFIX)) is not None:
            renaming.add(marker[2])
        elif (marker := parse_marker(name, SUSPECT_SUFFIX)) is not None:
            suspect.add(marker[:2])
    tombstones = _read_tombstones(layout, [os.path.join(layout.gc, n) for n in names if n.endswith(".json")])
    return GcRecords(tombstones, renaming, suspect)


def marker_name(kind: str, group: str, uid: str, suffix: str) -> str:
    return f"{kind}~{group}~{uid}{suffix}"


def parse_marker(name: str, suffix: str) -> tuple[str, str, str] | None:
    """(kind, group, uid) of a marker named `marker_name(..., suffix)`, else None."""
    if not name.endswith(suffix):
        return None
    fields = name[:-len(suffix)].split("~")
    return (fields[0], fields[1], fields[2]) if len(fields) == 3 else None


def read_tombstone(path: Path) -> dict | None:
    """A tombstone's content, or None when another collector removed it meanwhile."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _read_tombstones(layout: Layout, names: list[str]) -> dict[str, tuple[str | None, tuple[str, ...]]]:
    """path -> (output, inputs) of the tombstones `names` (paths in the gc directory) still there."""
    gc_dir = str(layout.gc)
    out = {}
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
            out[name] = found
    return out


def pin(con: duckdb.DuckDBPyConnection, layout: Layout | None = None, *,
        job_id: str | None = None) -> Listing | None:
    """List the store's files for the next queries on this cursor (see the module docstring), the job
    kinds' of `job_id` only when given (`list_files`). The data dir is the connection's own (`connect`
    records it); None, pinning nothing, on a connection that is not a `connect()` one. The queries run
    in the cursor's catalog: `over_listing` also chooses it."""
    if layout is None:
        root = data_dir_of(con)
        if root is None:
            return None
        layout = Layout.of(root)
    listing = list_files(layout, job_id)
    con.execute(f"SET VARIABLE {LISTING_VARIABLE} = $1", [listing.variable()])
    return listing


# connections whose default catalog's views wait for the first listing that needs them (a short-lived
# connection's, catalog.connect_reporting's `defer_default`): the connection -> what makes them
_DEFERRED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def defer_default_views(con: duckdb.DuckDBPyConnection,
                        make: Callable[[duckdb.DuckDBPyConnection], object]) -> None:
    """Have `over_listing` run `make(con)` (it lists for itself) before the first query on `con` that
    the default catalog must answer."""
    _DEFERRED[con] = make


@contextmanager
def over_listing(con: duckdb.DuckDBPyConnection, layout: Layout | None = None, *,
                 job_id: str | None = None) -> Iterator[Listing | None]:
    """`pin`, and the queries inside run in the listed catalog where every kind's listed files hold each
    part once (`Listing.disjoint`), in the default one otherwise; the cursor is back in the default one
    after (a later query that pins nothing reads the globs there, as the listing ages). Fetch the rows
    inside: leaving runs a statement, which drops a pending result."""
    root, listed = _pin_target(con)
    if layout is None and root is not None:
        layout = Layout.of(root)
    listing = pin(con, layout, job_id=job_id) if layout is not None else None
    chosen = listed is not None and listing is not None and all(listing.disjoint.values())
    if listing is not None and not chosen and con in _DEFERRED:
        _DEFERRED[con](con)  # kept until it succeeds: a try that failed is made again next time
        del _DEFERRED[con]
        listing = pin(con, layout, job_id=job_id)  # made again: the views were bound over their own
        chosen = listed is not None and all(listing.disjoint.values())
    if chosen:
        con.execute(f"USE {listed}")
    try:
        yield listing
    finally:
        if chosen:
            con.execute(f"USE {DEFAULT_CATALOG}")


def schema_listing(layout: Layout) -> Listing:
    """A listing of each kind's `_schema.parquet` only, every kind disjoint: what the listed catalog's
    views are bound over when they are created (catalog.py), so that no part file is opened then."""
    files = {kind: [str(layout.schema_file(kind))] for kind in KINDS}
    return Listing(time.time(), files, 0, [str(rollups.schema_file(layout))], files[rollups.KIND],
                   dict.fromkeys(KINDS, True), [str(rollups.schema_file(layout, SAMPLED_KIND))],
                   files[SAMPLED_KIND], files[SAMPLED_KIND])


def _pin_target(con: duckdb.DuckDBPyConnection) -> tuple[str | None, str | None]:
    """(data dir, listed catalog) of a `connect()` connection; (None, None) on any other, or on one
    whose set-up has not made them yet (its catalogs' macros come last)."""
    try:
        return con.execute(f"SELECT {DATA_DIR_MACRO}(), {LISTED_CATALOG_MACRO}()").fetchone()
    except duckdb.CatalogException:
        return None, None


def data_dir_of(con: duckdb.DuckDBPyConnection) -> str | None:
    """The data dir whose views a `connect()` connection (or a cursor of one) holds, else None."""
    return _pin_target(con)[0]


T = TypeVar("T")
LISTED_TRIES = 4  # a query whose part the compactor deleted after the listing runs again (listed anew)


def execute_listed(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None, *,
                   layout: Layout | None = None, job_id: str | None = None,
                   tries: int = LISTED_TRIES) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of `con.execute(sql, params)` over a listing pinned for it (`over_listing`);
    on a file error (a part listed, then deleted by garbage collection before it was read: the views stay
    correct, the query only has to list again) listed and run again, up to `tries` times in all."""
    def work(c: duckdb.DuckDBPyConnection) -> tuple[list[str], list[tuple]]:
        cur = c.execute(sql, params or [])
        rows = cur.fetchall()
        return [d[0] for d in cur.description or []], rows
    return run_listed(con, work, layout=layout, job_id=job_id, tries=tries)


def run_listed(con: duckdb.DuckDBPyConnection, work: Callable[[duckdb.DuckDBPyConnection], T], *,
               layout: Layout | None = None, job_id: str | None = None, tries: int = LISTED_TRIES) -> T:
    """`work(con)`, a few queries that fetch their rows, over one listing pinned for all of them
    (`over_listing`), made again and `work` run again from its start on a file error, as
    `execute_listed` does for one query."""
    for attempt in range(tries):
        try:
            with over_listing(con, layout, job_id=job_id):
                return work(con)
        except duckdb.IOException:
            if attempt == tries - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")
