"""The read path: one definition of the views, used for in-memory connections and the catalog file.

`connect(data_dir)` returns an in-memory DuckDB connection with every view defined over the data
dir's Parquet globs. It never opens `DATA_DIR/batchgen.duckdb`: a user's `duckdb` CLI holding that
file would lock every other process out. `write_catalog(data_dir)` (re)creates the same views in the
catalog file for users who want `cd data && duckdb batchgen.duckdb`; it is called on set-up and after
compaction, and skipped quietly while someone holds the file. The catalog's views read paths relative
to the data dir (DuckDB resolves them against the working directory or `file_search_path`), so a
copied or moved data dir reads its own files, never the old one's.

Views (the contract users query; their building blocks are internal views in the schema `_bg`, out of
`SHOW TABLES`; `_bg_*` columns are internal):

- `jobs`, `shards`: status derived from job records, shard events, cancel requests and commits. Their
  counts are the winning commits' totals: rows, tokens and (schema v3) request outcomes and error rows
  (`requests_completed`, `requests_failed`, `requests_cancelled`, `error_rows`; `jobs.counts_complete`
  is false while a job has a committed shard whose commit predates them: count its outputs then).
- `outputs`, `requests`: rows of the one committed attempt per shard (first committed wins; a commit
  revoked because its rows were lost, `Store.revoke_commit`, does not count).
- `requests_live`: also the rows of each uncommitted shard's latest attempt (`committed` = false),
  for live progress; a killed attempt's rows show there until its retry starts writing.
  `_bg.request_digests_live` picks the same attempts' request digests (`jobs.store.digests`): the
  live figures of a large job read those, one row per part, instead of every request row.
- `iterations`, `sweeps`: every written row (not tied to shard attempts).
  `_bg.iteration_seconds`: per-second rollups of the iterations (`jobs.store.rollups`), read from the
  rollup twins of the listed compacted files and computed from the other files' rows, per part as
  the scan chooses: the rollups of the `iterations` rows, exactly.

How a view stays correct while writers and the compactor work. Nothing may depend on the order
in which a query lists files: DuckDB's optimizer may scan one view's glob several times (it turns
`x = min(x) OVER (...)` into a self-join, each side listing the directory anew), and a directory
listing that runs while files are renamed in may return a newer file and miss an older one. What a
listing does guarantee is every file that existed for all of it. So the first two rules are time
fences against `now()`, the start of the query's transaction, which every scan of one query shares:

- A commit counts once `committed_ts <= now() - clock skew`. Its attempt's parts were renamed into
  place before `committed_ts`, so they existed before the query started: every scan lists them.
- A compacted file counts once its name's time (taken just before its rename into place) plus
  `ACTIVATION_DELAY_S` is <= now(). A file that some scans list and others miss was renamed in
  during the query, so it does not count yet for it; the raw parts it merged still count. Each raw
  part's rows (`_bg_part`) are taken from the first active compacted file holding them, else from the
  raw part itself, counted once.
- A raw part that a scan does not list while a compacted file holding its rows is listed was merged
  and then deleted (`compact.collect_garbage`): that scan takes its rows from the first compacted file
  holding them, active or not. So deleting a compaction's inputs never makes rows vanish, however
  early: a listing returns every file that existed for all of it, and the inputs go only after their
  compacted file has been in place for a grace period far longer than a listing (`compact`). The
  grace only spares a query that listed an input the error of opening it once deleted; such a query
  runs again (`jobs.store.usersql.run_query`). Each scan lists its glob once (a materialized CTE), so
  it decides for all its rows from one listing; two scans of one query may take a part from
  different files, which hold the same rows.
- A query over a listing pinned for it (`listing.pin`: run_query and fetch_rows pin one before each
  query, on `connect()` connections) reads that listing instead of the globs, in every scan: one
  listing for the whole query, with compaction's merged inputs left out once their output is listed
  (their rows come from the output by the rule above). Its fences are the listing's time instead of
  now(): a commit made after the listing began is not counted, as its parts may not be listed. A
  listing older than `listing.MAX_AGE_S` is not used (the globs are), so a connection that never pins
  answers as before. Since the list is fixed, a scan of `TWO_READ_KINDS` may read it twice (the
  (file, part) pairs to choose from, then the chosen rows) instead of materializing every row, and
  the other kinds' scans work out each file's facts from the list before reading the rows, which then
  carry their file's rank (`_ranked_scan_sql`). Where the listing tells that no part of a kind is in
  two of its files (`Listing.disjoint`: no compaction between its rename and its tombstone, no two
  compactions of the same inputs), the kind's scan reads them as they are, choosing nothing: every
  row once.
- The listed catalog (`LISTED_CATALOG`, attached to every `connect()` connection, `_create_listed`)
  holds the same views and macros, but each scan is one read of the pinned listing's files as they are
  (`_listed_scan_sql`): DuckDB binds a view each time a query reads it, and the default scans' forms
  (as listed, by rank, over the glob), all bound though one runs, were half of a dashboard query's
  planning. `listing.over_listing` (run_query, execute_listed, run_listed) makes it the cursor's
  catalog for the query where the listing holds each part of every kind in one file, and the default
  one again after. Its scans refuse, when bound, a listing that does not say so for their kind, a
  query from another catalog, or no listing; its fences are the listing's time whatever its age (a
  listed file deleted meanwhile fails the query, which lists anew). A short-lived connection may
  leave the default catalog's views until a listing needs them (`connect_reporting(defer_default=)`).
- Every kind has a zero-row `_schema.parquet`, so an empty data dir gives zero rows, not an error.
- In `connect`'s in-memory views paths are absolute (resolved when the connection is made), so
  they work from any cwd; the catalog file's are relative (above).

Clock skew between machines sharing DATA_DIR (set `BATCHGEN_STORE_CLOCK_SKEW_S`, default 0) must be
below the fences; on one machine the commit fence costs nothing (a committed shard is visible to
the next query).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Collection
from pathlib import Path

import duckdb

from jobs.store import digests, rollups
from jobs.store.digests import SAMPLES_MACRO
from jobs.store.layout import DATA_DIR_ENV, DEFAULT_DATA_DIR, SCHEMA_VERSION, Layout, init_data_dir
from jobs.store.listing import (
    DATA_DIR_MACRO,
    DEFAULT_CATALOG,
    LISTED_CATALOG,
    LISTED_CATALOG_MACRO,
    LISTING_VARIABLE,
    MAX_AGE_S,
    defer_default_views,
    pin,
    schema_listing,
)
from jobs.store.schemas import KINDS

log = logging.getLogger(__name__)

USER_VIEWS = ("jobs", "shards", "outputs", "requests", "requests_live", "iterations", "sweeps")

# a compacted file counts this long after it was named (see the module docstring)
ACTIVATION_DELAY_S = float(os.environ.get("BATCHGEN_STORE_ACTIVATION_DELAY_S", "5"))
CLOCK_SKEW_ENV = "BATCHGEN_STORE_CLOCK_SKEW_S"


def _q(path: str) -> str:
    return "'" + path.replace("'", "''") + "'"


def clock_skew_s() -> float:
    return float(os.environ.get(CLOCK_SKEW_ENV, "0") or 0)


# whether this query reads the files `listing.pin` listed (young enough), not the globs
_PINNED = (f"coalesce(getvariable('{LISTING_VARIABLE}').listed_at >= epoch_us(now()) / 1e6 - {MAX_AGE_S}, "
           "false)")


# whether this query runs in the listed catalog (`LISTED_CATALOG`), whose scans read the pinned listing
# whatever its age: a constant of the query, as `_PINNED` is
_IN_LISTED = f"current_database() = '{LISTED_CATALOG}'"


def _now_s(listed: bool = False) -> str:
    """The query's time in epoch seconds, minus the allowed clock skew: now() (its transaction start),
    or with `listed` (the views of `connect`), the time of the pinned listing when it reads one (in the
    listed catalog, always)."""
    now = "epoch_us(now()) / 1e6"
    if listed:
        now = (f"CASE WHEN {_PINNED} OR {_IN_LISTED} THEN getvariable('{LISTING_VARIABLE}').listed_at "
               f"ELSE {now} END")
    return f"({now} - {clock_skew_s():.6f})"


# kinds whose scans, over a pinned listing, read their files twice (`_scan_sql`): wide rows, many of
# them, few parts per file (a job's telemetry), where reading every column into the one-listing
# form's materialized CTE costs more than a second read. 780k iterations: 159 -> 68 ms.
TWO_READ_KINDS = frozenset({"iterations"})
# compacted files: <kind>/compacted/<group>/c<10**16 - epoch_us>~<uid>.parquet (compact._compacted_name);
# told apart by name, not by a path prefix, as DuckDB may report a relative glob's files resolved
_COMPACTED = "regexp_matches(_bg_file, '/compacted/[^/]+/c[0-9]{16}~[^/]*$')"
_NAMED_AT = "(1e16 - TRY_CAST(regexp_extract(_bg_file, '/c([0-9]{16})~[^/]*$', 1) AS DOUBLE)) / 1e6"


def _active_sql(listed: bool, named_at: str = _NAMED_AT) -> str:
    """Whether a compacted file named at `named_at` counts yet (see the module docstring)."""
    return f"{named_at} + {ACTIVATION_DELAY_S + clock_skew_s():.6f} <= {_now_s(listed)}"


def _pick_sql(listed: bool, source: str, file: str = "_bg_file", active: str | None = None) -> str:
    """Per raw part (`_bg_part`) of `source` (rows with _bg_part, _bg_compacted and `file`, the file's
    name or its rank among the names): the file its rows come from (see `_scan_sql`); NULL where they
    come from the raw part itself. `active`: whether a row's compacted file counts yet (by default from
    its name)."""
    active = active or f"_bg_compacted AND {_active_sql(listed)}"
    return f"""SELECT _bg_part, coalesce(
        min({file}) FILTER (WHERE {active}),
        CASE WHEN NOT bool_or(NOT _bg_compacted) THEN min({file}) END) AS {file}
    FROM {source} GROUP BY _bg_part"""


def _chosen(rows: str, file: str = "_bg_file") -> str:
    """Whether a row of `rows` (joined to `_pick_sql` as `a`) is read: from the file its part's rows
    come from, or from its raw part when they come from it."""
    return f"(a.{file} IS NULL AND NOT {rows}._bg_compacted) OR a.{file} = {rows}.{file}"


def _scan_sql(layout: Layout, kind: str, relative_to: Path | None = None, where: str = "") -> str:
    """Every row of a kind once: per raw part (`_bg_part`), from the first active compacted file holding
    it, else from the raw part itself when this scan lists it, else from the first compacted file holding
    it (the part was merged and deleted: see the module docstring). One listing decides for the whole
    scan (the CTE is materialized: read once): the pinned one (`listing.pin`) while it is young, else
    the glob's. With `relative_to`, the glob is relative to that directory (the catalog file's views,
    which read the glob only). `where`: a filter on the rows as the files are read (it must keep or drop
    each part whole: the choice of files is per part).

    A kind of TWO_READ_KINDS, over a pinned listing, reads it twice instead: first only the (file,
    part) pairs, to choose, then the rows of the chosen pairs, so that the rows are not materialized
    whole. The same pinned list of files feeds both reads, so they decide alike (a file deleted between
    them fails the query, which runs again, as a scan does over any deleted file)."""
    listed = relative_to is None
    glob = layout.glob(kind) if listed else os.path.relpath(layout.glob(kind), relative_to)
    files = (f"CASE WHEN {_PINNED} THEN getvariable('{LISTING_VARIABLE}').{kind} ELSE [{_q(glob)}] END"
             if listed else _q(glob))
    filtered = f" WHERE {where}" if where else ""
    source = f"read_parquet({files}, union_by_name = true, hive_partitioning = false, filename = '_bg_file')"

    def one_listing(rows: str) -> str:
        return f"""
WITH s AS MATERIALIZED (
    SELECT *, {_COMPACTED} AS _bg_compacted FROM {rows}{filtered}
), pick AS (
    {_pick_sql(listed, "s")}
)
SELECT s.* EXCLUDE (_bg_file, _bg_compacted)
FROM s LEFT JOIN pick AS a ON a._bg_part = s._bg_part
WHERE {_chosen("s")}
"""
    if not listed:
        return one_listing(source)
    # Over a pinned listing whose files hold each part once, the files are read as they are. The planner
    # drops the forms whose constant condition is false, so each query runs one of them; they all read
    # the files through `r`, not materialized (each form that runs reads them itself) so that a view
    # binds them once, not once per form (3 forms: 9.9 -> 3.9 ms to create a scan over 6 files)
    disjoint = _disjoint_sql(kind)
    as_listed = f"SELECT * EXCLUDE (_bg_file) FROM r{filtered}"
    if kind not in TWO_READ_KINDS:
        # over a pinned listing, the files are known before the rows: each file's facts (compacted,
        # active, its rank by name) are worked out once per file, and the rows carry the file's rank, so
        # the per-part choice groups and compares integers, not paths (77k shard events: 22 -> 15 ms).
        # Without one, or where the listing kept the kind's glob (no file of it was found), the
        # one-listing form answers
        ranked = (f"{_PINNED} AND len(list_filter(getvariable('{LISTING_VARIABLE}').{kind}, "
                  "lambda p: contains(p, '*'))) = 0")
        return f"""
WITH r AS NOT MATERIALIZED (SELECT * FROM {source})
SELECT * FROM ({as_listed}) WHERE {disjoint}
UNION ALL BY NAME
SELECT * FROM ({_ranked_scan_sql(files, filtered, "r")}) WHERE {ranked} AND NOT {disjoint}
UNION ALL BY NAME
SELECT * FROM ({one_listing("r")}) WHERE NOT ({ranked})
"""
    # without a pinned listing (a connection that pinned none) the one-listing form answers
    return f"""
WITH r AS NOT MATERIALIZED (SELECT * FROM {source}), fp AS (
    SELECT _bg_file, _bg_part, {_COMPACTED} AS _bg_compacted
    FROM (SELECT DISTINCT _bg_file, _bg_part FROM r{filtered})
), pick AS (
    {_pick_sql(listed, "fp")}
), chosen AS (
    SELECT fp._bg_file, fp._bg_part FROM fp LEFT JOIN pick AS a ON a._bg_part = fp._bg_part
    WHERE {_chosen("fp")}
)
SELECT rows.* EXCLUDE (_bg_file) FROM r AS rows
SEMI JOIN chosen AS c ON rows._bg_file = c._bg_file AND rows._bg_part = c._bg_part
WHERE {_PINNED} AND NOT {disjoint}{f" AND ({where})" if where else ""}
UNION ALL BY NAME
SELECT * FROM ({as_listed}) WHERE {disjoint}
UNION ALL BY NAME
SELECT * FROM ({one_listing("r")}) WHERE NOT {_PINNED}
"""


def _listed_files_sql(kind: str, field: str | None = None) -> str:
    """The pinned listing's files of `kind` (its `field` of them: the rollup twins' lists), for a scan of
    the listed catalog: read as they are, so only where the listing holds each part of `kind` in one
    file, and only in that catalog, whose fences are the listing's time. Anything else fails the query
    when it is bound, never reading a part twice."""
    listing = f"getvariable('{LISTING_VARIABLE}')"
    refusal = (f"the listed catalog's views ({LISTED_CATALOG}) read a pinned listing in which no part of "
               f"{kind} is in two files, from that catalog only; query the views of the default catalog")
    return (f"CASE WHEN {_IN_LISTED} AND coalesce({listing}.disjoint.{kind}, false) "
            f"THEN {listing}.{field or kind} ELSE error({_q(refusal)}) END")


def _listed_scan_sql(kind: str, where: str = "") -> str:
    """A scan of the listed catalog (`LISTED_CATALOG`): the pinned listing's files of `kind` read as they
    are (`_listed_files_sql`), with the columns of `_scan_sql`'s rows. One read, no choice of files per
    part: it binds in a fraction of `_scan_sql`'s time, which binds every form a listing may need."""
    filtered = f" WHERE {where}" if where else ""
    return (f"SELECT * FROM read_parquet({_listed_files_sql(kind)}, union_by_name = true, "
            f"hive_partitioning = false){filtered}")


def _disjoint_sql(kind: str) -> str:
    """Whether the pinned listing, young enough to be read, holds each part of `kind` in one file only
    (`listing.Listing.disjoint`): a constant of the query."""
    return f"({_PINNED} AND coalesce(getvariable('{LISTING_VARIABLE}').disjoint.{kind}, false))"


def _ranked_scan_sql(files: str, filtered: str, rows: str | None = None) -> str:
    """The one-listing form's rows, over a list of files known in advance (a pinned listing): the facts
    of each file come from the list (`f`), the rows join them by file name and carry the file's rank
    among the names (`_bg_fi`), so the choice per part is `_pick_sql`'s over ranks. A row whose file is
    not in the list fails the query (it would otherwise be dropped unseen). `rows`: a relation with
    `_bg_file` and `_bg_part` to choose from instead of the files' rows (the rollups: `_rollup_scan_sql`)."""
    rows = rows or (f"read_parquet({files}, union_by_name = true, hive_partitioning = false, "
                    "filename = '_bg_file')")
    return f"""
WITH f AS MATERIALIZED (
    SELECT _bg_file, row_number() OVER (ORDER BY _bg_file) AS _bg_fi, _bg_compacted,
           _bg_compacted AND {_active_sql(True, "_bg_named_at")} AS _bg_active
    FROM (SELECT DISTINCT _bg_file, {_COMPACTED} AS _bg_compacted, {_NAMED_AT} AS _bg_named_at
          FROM unnest({files}) AS u(_bg_file))
), s AS MATERIALIZED (
    SELECT r.* EXCLUDE (_bg_file),
           coalesce(f._bg_fi, error('a part file outside the pinned listing: ' || r._bg_file)::BIGINT)
               AS _bg_fi,
           f._bg_compacted, f._bg_active
    FROM {rows} AS r LEFT JOIN f ON f._bg_file = r._bg_file{filtered}
), pick AS (
    {_pick_sql(True, "s", file="_bg_fi", active="_bg_active")}
)
SELECT s.* EXCLUDE (_bg_fi, _bg_compacted, _bg_active)
FROM s LEFT JOIN pick AS a ON a._bg_part = s._bg_part
WHERE {_chosen("s", file="_bg_fi")}
"""


ROLLUP_VIEW = "_bg.iteration_seconds"  # the per-second rollups of the iterations (jobs.store.rollups)


def _rollup_scan_sql(layout: Layout, relative_to: Path | None = None, pinned: bool = False) -> str:
    """The per-second rollups of the iterations (`jobs.store.rollups`): over a pinned listing, the twins
    of its compacted files read, the rollups of its other iterations files computed from their rows,
    and per part the file chosen as `_ranked_scan_sql` chooses; otherwise computed from the iterations'
    scan (the catalog file's view, a connection that pinned no listing). `pinned`: the listed
    catalog's, over the pinned listing as it is (`_listed_files_sql`)."""
    computed = rollups.rollup_select("_bg.scan_iterations")
    if relative_to is not None:
        return computed
    listing = f"getvariable('{LISTING_VARIABLE}')"
    twin_prefix, compacted_prefix = rollups.twin_prefixes(layout)
    schema, glob = _q(str(rollups.schema_file(layout))), _q(layout.glob(rollups.KIND))
    if pinned:
        twins = _listed_files_sql(rollups.KIND, "iteration_twins")
        untwinned = _listed_files_sql(rollups.KIND, "iterations_untwinned")
    else:
        twins = f"CASE WHEN {_PINNED} THEN {listing}.iteration_twins ELSE [{schema}] END"
        untwinned = f"CASE WHEN {_PINNED} THEN {listing}.iterations_untwinned ELSE [{glob}] END"
    files = f"CASE WHEN {_PINNED} THEN {listing}.{rollups.KIND} ELSE []::VARCHAR[] END"
    read = "union_by_name = true, hive_partitioning = false"
    untwinned_rows = f"read_parquet({untwinned}, {read}, filename = '_bg_file')"
    rows = f"""(
        SELECT * EXCLUDE (_bg_twin),
               {_q(compacted_prefix)} || substr(_bg_twin, {len(twin_prefix) + 1}) AS _bg_file
        FROM read_parquet({twins}, {read}, filename = '_bg_twin')
        UNION ALL BY NAME
        {rollups.rollup_select(untwinned_rows, keep=("_bg_file",))}
    )"""
    if pinned:  # the listed catalog's: the listing holds each part in one file (`_listed_files_sql`)
        return f"SELECT * EXCLUDE (_bg_file) FROM {rows}"
    disjoint = _disjoint_sql(rollups.KIND)
    return f"""
SELECT * EXCLUDE (_bg_file) FROM {rows} WHERE {disjoint}
UNION ALL BY NAME
SELECT * FROM ({_ranked_scan_sql(files, "", rows)}) WHERE {_PINNED} AND NOT {disjoint}
UNION ALL BY NAME
SELECT * FROM ({computed}) WHERE NOT {_PINNED}
"""


def _samples_macro_sql(layout: Layout, pinned: bool, broken: dict[str, str]) -> str:
    """The body of `SAMPLES_MACRO(lvl)`: the sampled request rows of level >= lvl of every request digest
    (`digests.sample_rows_select`). The listed catalog's (`pinned`) read, at a level a sample twin holds
    (`digests.TWIN_MIN_LEVEL` and up), the twins of the listed compacted digests files
    (`jobs.store.rollups`), else those files' sample columns, and the samples of the other listed
    digests files: the listing holds each part in one file, and a twin the same digests as its file.
    The default catalog's (over any listing, or none) read those of the digests' scan, as does the
    listed one's where the digests are unreadable (the scan's stand-in names the file)."""
    kind = rollups.SAMPLED_KIND
    if not pinned or kind in broken:
        return digests.sample_rows_select(f"_bg.scan_{kind}", "lvl")
    read = "union_by_name = true, hive_partitioning = false"
    twins = _listed_files_sql(kind, "digest_twins")
    untwinned = f"read_parquet({_listed_files_sql(kind, 'digests_untwinned')}, {read})"
    twinned = f"read_parquet({_listed_files_sql(kind, 'digests_twinned')}, {read})"
    # `lvl` is a constant of the query: the branch it rules out reads nothing
    return f"""
SELECT * EXCLUDE ({digests.SAMPLE_TWIN_LEVEL}) FROM read_parquet({twins}, {read})
WHERE {digests.SAMPLE_TWIN_LEVEL} >= lvl AND lvl >= {digests.TWIN_MIN_LEVEL}
UNION ALL BY NAME
SELECT * FROM ({digests.sample_rows_select(twinned, "lvl")}) WHERE lvl < {digests.TWIN_MIN_LEVEL}
UNION ALL BY NAME
{digests.sample_rows_select(untwinned, "lvl")}
"""


def _winners_sql(listed: bool = False) -> str:
    """The commit that counts per shard: the first, among those no revocation (`lost`) names. One scan
    of the commits (a revocation is a commits row of the same attempt id): each scan lists every file.
    `listed`: the fence is the pinned listing's time when the scans read it (`_now_s`). Most shards
    have one commit: the window that picks the first runs over the shards with several only (37k
    commits: the view 40 -> 31 ms, its scan 26 ms)."""
    return f"""
WITH c AS MATERIALIZED (
    SELECT * FROM _bg.scan_commits WHERE committed_ts <= {_now_s(listed)}
), ok AS (
    -- (not NOT IN: a NULL attempt id among the revocations would make it NULL for every commit)
    SELECT c.* EXCLUDE (lost) FROM c
    ANTI JOIN (SELECT DISTINCT _bg_attempt_id FROM c WHERE lost IS NOT NULL) AS r
        ON c._bg_attempt_id IS NOT DISTINCT FROM r._bg_attempt_id
    WHERE c.lost IS NULL
), several AS (
    SELECT job_id, shard_id FROM ok GROUP BY job_id, shard_id HAVING count(*) > 1
)
SELECT * FROM ok ANTI JOIN several USING (job_id, shard_id)
UNION ALL
SELECT * FROM (SELECT * FROM ok SEMI JOIN several USING (job_id, shard_id))
QUALIFY row_number() OVER (PARTITION BY job_id, shard_id ORDER BY committed_ts, _bg_attempt_id) = 1
"""


_JOB_RECORDS = """
SELECT * FROM _bg.scan_job_records
QUALIFY row_number() OVER (PARTITION BY job_id ORDER BY submitted_ts, _bg_part) = 1
"""

_CANCELS = """
SELECT job_id, min(ts) AS cancel_ts, arg_min(reason, ts) AS cancel_reason
FROM _bg.scan_job_events WHERE event = 'cancel_requested' GROUP BY job_id
"""

_OUTPUTS = """
SELECT o.* EXCLUDE (_bg_shard_id, _bg_attempt_id, _bg_part)
FROM _bg.winners AS w
JOIN _bg.scan_outputs AS o ON o.job_id = w.job_id AND o._bg_attempt_id = w._bg_attempt_id
"""

_REQUESTS = """
SELECT r.* EXCLUDE (_bg_attempt_id, _bg_part)
FROM _bg.winners AS w
JOIN _bg.scan_requests AS r ON r.job_id = w.job_id AND r._bg_attempt_id = w._bg_attempt_id
"""

# A shard's rows that live figures count: the winning attempt's of a committed shard, else its latest
# attempt's. One choice for `requests_live` (over the request rows) and `_bg.request_digests_live` (over
# the digests of the same attempts' request-timing parts, jobs.store.digests), which keeps the attempt id
_LIVE_ATTEMPTS = """
WITH j AS MATERIALIZED (
    SELECT r.* EXCLUDE (_bg_part), w._bg_attempt_id IS NOT NULL AS committed
    FROM _bg.winners AS w RIGHT JOIN {scan} AS r ON r.job_id = w.job_id AND r.shard_id = w.shard_id
    WHERE w._bg_attempt_id IS NULL OR r._bg_attempt_id = w._bg_attempt_id
)
SELECT *{drop} FROM j WHERE committed
UNION ALL
-- the window only over the uncommitted shards' rows (a large job's running ones): over every row it was
-- the view's largest operator (75k digests: the view 100 -> 69 ms)
SELECT *{drop} FROM j WHERE NOT committed
{latest}
"""
# a shard's latest attempt among its rows (`attempt`, `_bg_attempt_id`): the one live figures count while
# the shard has no winning commit
_LATEST_ATTEMPT = ("QUALIFY (attempt, _bg_attempt_id) = max((attempt, _bg_attempt_id)) "
                   "OVER (PARTITION BY job_id, shard_id)")
_REQUESTS_LIVE = _LIVE_ATTEMPTS.format(scan="_bg.scan_requests", drop=" EXCLUDE (_bg_attempt_id)",
                                       latest=_LATEST_ATTEMPT)
_REQUEST_DIGESTS_LIVE = _LIVE_ATTEMPTS.format(scan="_bg.scan_request_digests", drop="",
                                              latest=_LATEST_ATTEMPT)

# The rows of `_bg.request_digests_live` of the shards without a winning commit (each one's latest
# attempt's digests), for a figure that takes the committed shards' totals from their winning commits
# (their request rows, `num_request_rows`) and reads none of their digests: the job summaries' live rows
# and tokens (75,704 digests at 95% of a 10M-request job: the summary 50 -> 47 ms at rest)
UNCOMMITTED_DIGESTS = f"""
SELECT d.* EXCLUDE (_bg_part)
FROM _bg.scan_request_digests AS d ANTI JOIN _bg.winners AS w USING (job_id, shard_id)
{_LATEST_ATTEMPT}
"""

# The last event of the latest attempt decides (a zombie attempt's late event does not win over a
# newer attempt). A retry's `queued` event carries the attempt number about to run. Each key is
# (attempt, ts, rank). Every shard has a first `queued` event (attempt 0, from submit), a job's shards
# once each: those are aggregated on their own with plain maxima (of the time: their attempt and rank
# are 0), and the few other events with the full set, then the larger key decides per shard (the two
# halves of one arg_max), so a 400,000-shard job does not run the costly aggregates 400,000 times.
_SHARD_EVENT_AGG_OVER = """
WITH e AS MATERIALIZED (
    SELECT *, CASE event WHEN 'queued' THEN 0 WHEN 'running' THEN 1 ELSE 2 END AS rank,
           event = 'queued' AND attempt = 0 AS first_queued
    FROM {events}
), q AS (
    -- attempt and rank are 0 here: the largest key and the arg_max are the latest time's
    SELECT job_id, shard_id, (min(attempt), max(ts), min(rank)) AS k, arg_max(error, ts) AS last_error,
           CASE WHEN count(error) > 0
                THEN (min(attempt), max(ts) FILTER (WHERE error IS NOT NULL), min(rank)) END AS ek,
           max(ts) AS last_ts, max(num_requests) AS num_requests
    FROM e WHERE first_queued GROUP BY job_id, shard_id
), o AS (
    SELECT job_id, shard_id, max((attempt, ts, rank)) AS k,
        arg_max(event, (attempt, ts, rank)) AS last_event,
        arg_max(error, (attempt, ts, rank)) AS last_error,
        max((attempt, ts, rank)) FILTER (WHERE error IS NOT NULL) AS ek,
        arg_max(ts, (attempt, ts, rank)) AS last_ts,
        arg_max(worker_id, (attempt, ts)) FILTER (WHERE event = 'running') AS last_worker,
        -- attempts started: distinct attempt ids, or distinct attempt numbers where events carry no id
        greatest(count(DISTINCT nullif(_bg_attempt_id, '')) FILTER (WHERE event = 'running'),
                 count(DISTINCT attempt) FILTER (WHERE event = 'running')) AS attempts_started,
        max(num_requests) AS num_requests,
        min(ts) FILTER (WHERE event = 'running') AS first_running_ts
    FROM e WHERE NOT first_queued GROUP BY job_id, shard_id
)
SELECT coalesce(o.job_id, q.job_id) AS job_id, coalesce(o.shard_id, q.shard_id) AS shard_id,
    CASE WHEN o.k IS NULL OR q.k > o.k THEN 'queued' ELSE o.last_event END AS last_event,
    -- arg_max skips NULL: the error is that of the latest event that has one (`ek`)
    CASE WHEN o.ek IS NULL OR q.ek > o.ek THEN q.last_error ELSE o.last_error END AS last_error,
    CASE WHEN o.k IS NULL OR q.k > o.k THEN q.last_ts ELSE o.last_ts END AS last_ts,
    o.last_worker, coalesce(o.attempts_started, 0) AS attempts_started,
    greatest(o.num_requests, q.num_requests) AS num_requests, o.first_running_ts
FROM o FULL JOIN q ON q.job_id = o.job_id AND q.shard_id = o.shard_id
"""
_SHARD_EVENT_AGG = _SHARD_EVENT_AGG_OVER.format(events="_bg.scan_shard_events")


# A `shards` row: from the shard's keys `k`, its event aggregate `a`, its winning commit `w` and its job's
# cancel `c` (after the CTEs that define them: `_SHARDS`, `_UNCOMMITTED_SHARDS_CTES`)
_SHARD_ROWS = """
SELECT k.job_id, k.shard_id,
    CASE WHEN w.job_id IS NOT NULL THEN 'completed'
         WHEN a.last_event IN ('failed', 'cancelled') THEN a.last_event
         WHEN c.cancel_ts IS NOT NULL THEN 'cancelled'
         WHEN a.last_event IN ('running', 'completed') THEN 'running'
         ELSE 'queued' END AS status,
    greatest(coalesce(a.attempts_started, 0), CASE WHEN w.job_id IS NULL THEN 0 ELSE 1 END) AS attempts,
    coalesce(w.worker_id, a.last_worker) AS worker_id,
    coalesce(a.num_requests, w.num_outputs) AS num_requests,
    to_timestamp(a.first_running_ts) AS started_at,
    to_timestamp(CASE WHEN w.job_id IS NOT NULL THEN w.committed_ts
                      WHEN a.last_event IN ('failed', 'cancelled') THEN a.last_ts
                      ELSE c.cancel_ts END) AS finished_at,
    CASE WHEN w.job_id IS NULL AND a.last_event IN ('failed', 'cancelled') THEN a.last_error END AS error,
    coalesce(w.num_outputs, 0) AS rows_done,
    coalesce(w.prompt_tokens, 0) AS prompt_tokens,
    coalesce(w.output_tokens, 0) AS output_tokens,
    w.attempt AS committed_attempt,
    -- the committed attempt's request outcomes (null: not committed, or committed before schema v3)
    w.requests_completed, w.requests_failed, w.requests_cancelled, w.error_rows
FROM keys AS k
LEFT JOIN a ON a.job_id = k.job_id AND a.shard_id = k.shard_id
LEFT JOIN w ON w.job_id = k.job_id AND w.shard_id = k.shard_id
LEFT JOIN _bg.cancels AS c ON c.job_id = k.job_id
"""

# winners and the event aggregate each read once (materialized), not once per reference: a scan of
# the commits or events is a listing and every file opened
_SHARDS = """
WITH w AS MATERIALIZED (
    SELECT * FROM _bg.winners
), a AS MATERIALIZED (
    SELECT * FROM _bg.shard_event_agg
), keys AS (
    SELECT job_id, shard_id FROM a
    UNION SELECT job_id, shard_id FROM w
    UNION SELECT job_id, unnest(range(num_shards)) AS shard_id FROM _bg.job_records
)""" + _SHARD_ROWS

# The CTEs (after `w`, the winners, and `ev`, the shard events) from which _SHARD_ROWS are the `shards`
# rows of the shards without a winning commit (status never 'completed'). A committed shard is
# 'completed' whatever its events say, so the shard event aggregate runs over the other shards' events
# only: a running 10M-request job's last few percent (39,063 shards, 95% committed: the aggregate's
# operators about 30 -> 4 ms)
_UNCOMMITTED_SHARDS_CTES = f"""ue AS (
    SELECT * FROM ev ANTI JOIN w USING (job_id, shard_id)
), a AS MATERIALIZED ({_SHARD_EVENT_AGG_OVER.format(events="ue")}), keys AS (
    SELECT * FROM (SELECT job_id, shard_id FROM a
                   UNION SELECT job_id, unnest(range(num_shards)) AS shard_id FROM _bg.job_records)
    ANTI JOIN w USING (job_id, shard_id)
)"""


_JOB_SHARDS = """
SELECT job_id,
    count(*) AS n,
    count(*) FILTER (WHERE status = 'completed') AS completed,
    count(*) FILTER (WHERE status = 'failed') AS failed,
    count(*) FILTER (WHERE status = 'running') AS running,
    count(*) FILTER (WHERE status = 'queued') AS queued,
    min(started_at) AS started_at,
    max(finished_at) AS finished_at,
    sum(rows_done) AS rows_done,
    sum(prompt_tokens) AS prompt_tokens,
    sum(output_tokens) AS output_tokens,
    arg_min(error, finished_at) FILTER (WHERE status = 'failed') AS error,
    sum(requests_completed)::BIGINT AS requests_completed, sum(requests_failed)::BIGINT AS requests_failed,
    sum(requests_cancelled)::BIGINT AS requests_cancelled, sum(error_rows)::BIGINT AS error_rows,
    count(*) FILTER (WHERE status = 'completed' AND requests_completed IS NULL) AS commits_without_counts
FROM {shards} GROUP BY job_id
"""

# `_JOB_SHARDS` over the `shards` view, computed per job without a row per committed shard: the CTEs of
# `_bg.job_shards` (the `jobs` view's: the summaries, `status`), after which a query may add its own.
# `u` holds the `shards` rows of the shards without a winning commit, counted as _JOB_SHARDS counts
# them; the committed ones add up from the winners per job (`wj`); a job's start is its first `running`
# event; `job_shards` is the result. 39,063 shards, 95% committed: 87 -> 63 ms.
JOB_SHARDS_CTES = """w AS MATERIALIZED (
    SELECT * FROM _bg.winners
), ev AS MATERIALIZED (
    SELECT * FROM _bg.scan_shard_events
), {uncommitted}, u AS MATERIALIZED ({shard_rows}), uj AS ({job_shards}), wj AS (
    SELECT job_id, count(*) AS n, max(committed_ts) AS finished_ts, sum(num_outputs) AS rows_done,
        sum(prompt_tokens) AS prompt_tokens, sum(output_tokens) AS output_tokens,
        sum(requests_completed)::BIGINT AS requests_completed,
        sum(requests_failed)::BIGINT AS requests_failed,
        sum(requests_cancelled)::BIGINT AS requests_cancelled, sum(error_rows)::BIGINT AS error_rows,
        count(*) FILTER (WHERE requests_completed IS NULL) AS commits_without_counts
    FROM w GROUP BY job_id
), started AS (
    SELECT job_id, to_timestamp(min(ts)) AS started_at FROM ev WHERE event = 'running' GROUP BY job_id
), job_shards AS (
    SELECT coalesce(wj.job_id, uj.job_id) AS job_id,
        coalesce(wj.n, 0) + coalesce(uj.n, 0) AS n,
        coalesce(wj.n, 0) AS completed, coalesce(uj.failed, 0) AS failed,
        coalesce(uj.running, 0) AS running, coalesce(uj.queued, 0) AS queued,
        started.started_at,
        greatest(to_timestamp(wj.finished_ts), uj.finished_at) AS finished_at,
        coalesce(wj.rows_done, 0) AS rows_done, coalesce(wj.prompt_tokens, 0) AS prompt_tokens,
        coalesce(wj.output_tokens, 0) AS output_tokens, uj.error,
        wj.requests_completed, wj.requests_failed, wj.requests_cancelled, wj.error_rows,
        coalesce(wj.commits_without_counts, 0) AS commits_without_counts
    FROM wj FULL JOIN uj ON uj.job_id = wj.job_id
    LEFT JOIN started ON started.job_id = coalesce(wj.job_id, uj.job_id)
)""".format(uncommitted=_UNCOMMITTED_SHARDS_CTES, shard_rows=_SHARD_ROWS,
            job_shards=_JOB_SHARDS.format(shards="u"))

# The ordering of a page of shards (the dashboard's job page): the ones that need a look first (failed,
# then running), then the rest, each by shard id
SHARDS_PAGE_ORDER = "CASE status WHEN 'failed' THEN 0 WHEN 'running' THEN 1 ELSE 2 END, shard_id"

# One page of one job's `shards` rows (parameters $job_id, $status: NULL for every status, $limit,
# $offset), in SHARDS_PAGE_ORDER, without a row per committed shard but the page's: the statuses come
# from the rows of the shards without a winning commit (as `JOB_SHARDS_CTES` makes them, their events
# aggregated) and the winning commits (a committed shard is 'completed'), and only the page's committed
# shards have their events aggregated for their rows. 39,063 shards, 95% committed: the page's events
# aggregate ran over every shard's events.
_PAGE_EVENTS = "(SELECT * FROM ev SEMI JOIN keys USING (job_id, shard_id))"  # the events of `keys`' shards
# $job_id's winning commits `w`, shard events `ev` and the `shards` rows `u` of its shards without a
# winning commit (`_UNCOMMITTED_SHARDS_CTES`)
_ONE_JOBS_UNCOMMITTED = f"""WITH w AS MATERIALIZED (
    SELECT * FROM _bg.winners WHERE job_id = $job_id
), ev AS MATERIALIZED (
    SELECT * FROM _bg.scan_shard_events WHERE job_id = $job_id
), {_UNCOMMITTED_SHARDS_CTES}, u AS MATERIALIZED (
    SELECT * FROM ({_SHARD_ROWS}) WHERE job_id = $job_id
)"""
SHARDS_PAGE = f"""
{_ONE_JOBS_UNCOMMITTED}, page AS MATERIALIZED (
    SELECT shard_id, status
    FROM (SELECT shard_id, status FROM u UNION ALL SELECT shard_id, 'completed' AS status FROM w)
    WHERE $status IS NULL OR status = $status
    ORDER BY {SHARDS_PAGE_ORDER} LIMIT $limit OFFSET $offset
)
SELECT * FROM u SEMI JOIN page USING (shard_id)
UNION ALL BY NAME
SELECT * FROM (
    WITH keys AS (
        SELECT $job_id AS job_id, shard_id FROM page WHERE status = 'completed'
    ), a AS ({_SHARD_EVENT_AGG_OVER.format(events=_PAGE_EVENTS)})
    {_SHARD_ROWS}
)
"""


# `SELECT DISTINCT worker_id FROM shards WHERE job_id = $job_id AND worker_id IS NOT NULL ORDER BY
# worker_id LIMIT $limit` (the workers that ran a job's shards) without a row per committed shard: a
# committed shard's worker is its winning commit's, or where that names none its events' last `running`
# one (only those shards' events aggregated)
SHARD_WORKERS = f"""
{_ONE_JOBS_UNCOMMITTED}
SELECT DISTINCT worker_id FROM (
    SELECT worker_id FROM u
    UNION ALL
    SELECT worker_id FROM w
    UNION ALL
    SELECT * FROM (
        WITH keys AS (
            SELECT job_id, shard_id FROM w WHERE worker_id IS NULL
        ), a AS ({_SHARD_EVENT_AGG_OVER.format(events=_PAGE_EVENTS)})
        SELECT last_worker FROM a
    )
) WHERE worker_id IS NOT NULL ORDER BY worker_id LIMIT $limit
"""


# Each worker's latest started shard (`started_at`) and its job: `SELECT worker_id, arg_max(job_id,
# (started_at, job_id)) AS job_id, max(started_at) AS started_at FROM shards WHERE worker_id IS NOT NULL
# AND started_at IS NOT NULL GROUP BY worker_id`, from the `running` events alone (a shard's first is its
# start, the latest attempt's names its worker where its winning commit names none, as in the shards'
# event aggregate), without that aggregate over every shard's events (the dashboard's workers page)
WORKER_LATEST_SHARDS = """
WITH r AS (
    SELECT job_id, shard_id, min(ts) AS started_ts, arg_max(worker_id, (attempt, ts)) AS last_worker
    FROM _bg.scan_shard_events WHERE event = 'running' GROUP BY job_id, shard_id
), s AS (
    SELECT coalesce(w.worker_id, r.last_worker) AS worker_id, r.job_id, r.started_ts
    FROM r LEFT JOIN _bg.winners AS w ON w.job_id = r.job_id AND w.shard_id = r.shard_id
)
SELECT worker_id, arg_max(job_id, (started_ts, job_id)) AS job_id, to_timestamp(max(started_ts)) AS started_at
FROM s WHERE worker_id IS NOT NULL GROUP BY worker_id
"""


# `SELECT job_id, status, count(*) AS n FROM shards GROUP BY ALL` without a row per committed shard (the
# dashboard's shard counts by state)
_SHARD_STATUS_COUNTS = f"""
WITH {JOB_SHARDS_CTES}
SELECT job_id, 'completed' AS status, count(*) AS n FROM w GROUP BY job_id
UNION ALL
SELECT job_id, status, count(*) AS n FROM u GROUP BY job_id, status
"""


_JOBS = """
WITH j AS (
    SELECT coalesce(r.job_id, s.job_id) AS job_id,
        -- a cancel that lands while the last shards run still ends 'cancelled' (their unfinished
        -- rows are marked so) even when every shard commits; one asked after the end changes nothing
        CASE WHEN coalesce(s.completed, 0) = coalesce(r.num_shards, s.n)
                  AND (c.cancel_ts IS NULL OR epoch(s.finished_at) <= c.cancel_ts) THEN 'completed'
             WHEN c.cancel_ts IS NOT NULL THEN 'cancelled'
             WHEN coalesce(s.queued, 0) + coalesce(s.running, 0) = 0 AND s.failed > 0 THEN 'failed'
             WHEN coalesce(s.running, 0) + coalesce(s.completed, 0) > 0 THEN 'running'
             ELSE 'queued' END AS status,
        r.model, r.num_requests, coalesce(r.num_shards, s.n) AS num_shards,
        to_timestamp(r.submitted_ts) AS submitted_at, s.started_at, s.finished_at AS last_shard_finished_at,
        to_timestamp(c.cancel_ts) AS cancel_requested_at, r.config, r.output_path,
        coalesce(s.completed, 0) AS shards_completed, coalesce(s.failed, 0) AS shards_failed,
        coalesce(s.running, 0) AS shards_running, coalesce(s.rows_done, 0) AS rows_done,
        coalesce(s.prompt_tokens, 0) AS prompt_tokens, coalesce(s.output_tokens, 0) AS output_tokens,
        coalesce(s.error, c.cancel_reason) AS error,
        coalesce(s.requests_completed, 0) AS requests_completed,
        coalesce(s.requests_failed, 0) AS requests_failed,
        coalesce(s.requests_cancelled, 0) AS requests_cancelled,
        coalesce(s.error_rows, 0) AS error_rows, coalesce(s.commits_without_counts, 0) = 0 AS counts_complete
    FROM _bg.job_records AS r FULL JOIN {job_shards} AS s ON s.job_id = r.job_id
    LEFT JOIN _bg.cancels AS c ON c.job_id = coalesce(r.job_id, s.job_id)
)
SELECT job_id, status, model, num_requests, num_shards, submitted_at, started_at,
    CASE WHEN status IN ('completed', 'failed', 'cancelled')
         THEN greatest(last_shard_finished_at, cancel_requested_at) END AS finished_at,
    config, output_path, shards_completed, shards_failed, shards_running, rows_done, prompt_tokens,
    output_tokens, error, cancel_requested_at, requests_completed, requests_failed, requests_cancelled,
    error_rows, counts_complete
FROM j
"""


# the `jobs` view's SELECT (over_scans inlines what it reads, for a connection of scans only)
JOBS_SELECT = _JOBS.format(job_shards="_bg.job_shards")


def jobs_over(shards: str | None = None, *, job_shards: str | None = None) -> str:
    """The `jobs` view's SELECT with its shard counts taken from `shards`, a relation with the `shards`
    view's columns (e.g. a table of one job's `shards` rows, which then answers that job's `jobs` row
    as the view does: `batchgen status JOB` reads the job's shards once for both). It reads the job
    records and cancels as the view does. `job_shards`: a SELECT of `_JOB_SHARDS`' columns instead
    (after `JOB_SHARDS_CTES`: `SELECT * FROM job_shards`)."""
    if (shards is None) == (job_shards is None):
        raise ValueError("jobs_over takes one of `shards` (a relation) or `job_shards` (a SELECT)")
    return _JOBS.format(job_shards=f"({job_shards or _JOB_SHARDS.format(shards=shards)})")


# The outputs of one job's shards lo..hi, as the `outputs` view has them: the shard filter is applied as
# the files are read (row groups whose shards are all outside it are skipped: compacted outputs are
# sorted by shard), before the scan's choice of files per part, which a filter on the view itself
# comes after (every output row of the store read). A part holds one shard's rows, so the choice is
# the view's. For `connect()` connections: the dashboard's sample of a job's outputs.
OUTPUTS_OF_SHARDS_MACRO = "_bg.outputs_of_shards"


def _outputs_of_shards_sql(layout: Layout, pinned: bool = False) -> str:
    where = "job_id = job AND _bg_shard_id BETWEEN lo AND hi"
    scan = _listed_scan_sql("outputs", where) if pinned else _scan_sql(layout, "outputs", where=where)
    return f"""
SELECT o.* EXCLUDE (_bg_shard_id, _bg_attempt_id, _bg_part)
FROM _bg.winners AS w JOIN ({scan}) AS o ON o.job_id = w.job_id AND o._bg_attempt_id = w._bg_attempt_id
WHERE w.job_id = job
"""


INTERNAL_SCHEMA = "_bg"  # the views' building blocks, out of `SHOW TABLES` (`SHOW ALL TABLES` lists them)


def view_definitions(layout: Layout, relative_to: Path | None = None, *,
                     pinned: bool = False) -> list[tuple[str, str]]:
    """(name, SELECT) of every view, in creation order: the one shared definition. Paths are absolute,
    or relative to `relative_to` (the catalog file's, so a copied or moved data dir reads its own files).
    `pinned`: the listed catalog's (`LISTED_CATALOG`), whose scans read a pinned listing as it is."""
    views = [(f"{INTERNAL_SCHEMA}.scan_{kind}",
              _listed_scan_sql(kind) if pinned else _scan_sql(layout, kind, relative_to)) for kind in KINDS]
    views += [
        ("_bg.winners", _winners_sql(relative_to is None)), ("_bg.job_records", _JOB_RECORDS),
        ("_bg.cancels", _CANCELS), ("_bg.shard_event_agg", _SHARD_EVENT_AGG),
        ("outputs", _OUTPUTS), ("requests", _REQUESTS), ("requests_live", _REQUESTS_LIVE),
        ("_bg.request_digests_live", _REQUEST_DIGESTS_LIVE),
        ("iterations", "SELECT * EXCLUDE (_bg_part) FROM _bg.scan_iterations"),
        (ROLLUP_VIEW, _rollup_scan_sql(layout, relative_to, pinned)),
        ("sweeps", "SELECT * EXCLUDE (_bg_part) FROM _bg.scan_sweeps"),
        ("shards", _SHARDS), ("_bg.job_shards", f"WITH {JOB_SHARDS_CTES} SELECT * FROM job_shards"),
        ("_bg.shard_status_counts", _SHARD_STATUS_COUNTS),
        ("jobs", JOBS_SELECT),
    ]
    return views


# view -> the views it reads (a view's scans are bound each time a view over them is created, so a
# connection that needs only some views binds only those: `connect(views=...)`)
_READS: dict[str, tuple[str, ...]] = {
    "_bg.winners": ("_bg.scan_commits",), "_bg.job_records": ("_bg.scan_job_records",),
    "_bg.cancels": ("_bg.scan_job_events",), "_bg.shard_event_agg": ("_bg.scan_shard_events",),
    "outputs": ("_bg.winners", "_bg.scan_outputs"), "requests": ("_bg.winners", "_bg.scan_requests"),
    "requests_live": ("_bg.winners", "_bg.scan_requests"),
    "_bg.request_digests_live": ("_bg.winners", "_bg.scan_request_digests"),
    "iterations": ("_bg.scan_iterations",),
    ROLLUP_VIEW: ("_bg.scan_iterations",),
    "sweeps": ("_bg.scan_sweeps",),
    "shards": ("_bg.shard_event_agg", "_bg.winners", "_bg.job_records", "_bg.cancels"),
    "_bg.job_shards": ("_bg.winners", "_bg.scan_shard_events", "_bg.job_records", "_bg.cancels"),
    "_bg.shard_status_counts": ("_bg.winners", "_bg.scan_shard_events", "_bg.job_records", "_bg.cancels"),
    "jobs": ("_bg.job_records", "_bg.job_shards", "_bg.cancels"),
}
# The views above the scans that `over_scans` can inline, in creation order (each after what it reads)
_INLINABLE = ("_bg.winners", "_bg.job_records", "_bg.cancels", "_bg.shard_event_agg", "shards",
              "_bg.job_shards", "_bg.request_digests_live", "jobs")
_INLINED_REF = re.compile(
    r"\b_bg[._](winners|job_records|cancels|shard_event_agg|shards|job_shards|request_digests_live|jobs)\b")
_USER_VIEW_NAMES = frozenset(USER_VIEWS)


def over_scans(select: str, *, once: bool = False) -> str:
    """`select` with the views above the scans that it reads (`_INLINABLE`, named `_bg_<name>` in it:
    `_bg_shards`, `_bg_winners`, `_bg_jobs`, ...) as common table expressions, NOT MATERIALIZED:
    expanded where they are read, as DuckDB expands a view. It runs on a connection that created only
    the scans (`connect(views=...)` of `_bg.scan_*` views): creating a view binds it, and each view over
    others binds those again, a third of a short-lived connection's set-up (`batchgen status`).

    `once`: MATERIALIZED instead, each computed once however many times the query reads it (a view
    over views reads the winning commits, the job records and the cancels each from several places:
    the dashboard's job summaries 129 -> 107 ms at 39,063 shards). A filter on such a view is then not
    pushed into its scans."""
    defs = dict(view_definitions(Layout(Path("/"))))  # the views above the scans name no path

    def named(sql: str) -> str:
        return _INLINED_REF.sub(lambda m: f"_bg_{m.group(1)}", sql)

    wanted, todo = set(), [m.group(1) for m in _INLINED_REF.finditer(select)]
    while todo:
        name = todo.pop()
        view = name if name in _USER_VIEW_NAMES else f"_bg.{name}"
        if view not in wanted:
            wanted.add(view)
            todo += [m.group(1) for m in _INLINED_REF.finditer(defs[view])]
    how = "MATERIALIZED" if once else "NOT MATERIALIZED"
    ctes = [f"_bg_{view.removeprefix('_bg.')} AS {how} ({named(defs[view])})"
            for view in _INLINABLE if view in wanted]
    return (f"WITH {', '.join(ctes)}\n" if ctes else "") + f"SELECT * FROM ({named(select)})"


# what `batchgen status` answers from: the jobs and their shards (request counts come with `jobs`, from
# the winning commits), and the outputs' scan, bound only so that unreadable outputs parts are reported
STATUS_VIEWS = ("jobs", "shards", "_bg.scan_outputs")
# what its connection creates: the scans it reads (the outputs' too, bound only so that unreadable
# outputs parts are reported); its queries inline the views above them (`over_scans`), and compute the
# `jobs` rows from the `shards` rows (`jobs_over`)
STATUS_BINDS = ("_bg.scan_job_records", "_bg.scan_job_events", "_bg.scan_shard_events", "_bg.scan_commits",
                "_bg.scan_outputs")


def _with_dependencies(names: Collection[str]) -> set[str]:
    known = {name for name, _ in view_definitions(Layout(Path("/")))}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"no such view(s) {unknown}; views: {sorted(known)}")
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(_READS.get(name, ()))
    return wanted


def create_views(con: duckdb.DuckDBPyConnection, layout: Layout, relative_to: Path | None = None,
                 views: Collection[str] | None = None) -> dict[str, str]:
    """Create every view (or only `views` and the views they read); {kind: error} for kinds whose parts
    cannot be read (see `_unreadable_sql`)."""
    return _create_view_set(con, layout, relative_to, views)


def _create_view_set(con: duckdb.DuckDBPyConnection, layout: Layout, relative_to: Path | None = None,
                     views: Collection[str] | None = None, *, pinned: bool = False,
                     broken: dict[str, str] | None = None) -> dict[str, str]:
    """`create_views`; `pinned`: the listed catalog's views (`_create_listed`), whose scans open no file
    when created, and `broken` ({kind: error}, the default catalog's) gets them the same stand-ins."""
    con.execute(f"CREATE SCHEMA IF NOT EXISTS {INTERNAL_SCHEMA}")
    broken = dict(broken or {})
    scan_prefix = f"{INTERNAL_SCHEMA}.scan_"
    wanted = None if views is None else _with_dependencies(views)
    for name, select in view_definitions(layout, relative_to, pinned=pinned):
        if wanted is not None and name not in wanted:
            continue
        # the views that read files: the scans, and the rollups (their twins)
        kind = (name.removeprefix(scan_prefix) if name.startswith(scan_prefix)
                else ROLLUP_VIEW.removeprefix(f"{INTERNAL_SCHEMA}.") if name == ROLLUP_VIEW else None)
        if kind is not None and kind not in broken and not pinned:
            try:
                _create_scan(con, name, select, layout if relative_to is None else None)
                continue
            except (duckdb.IOException, duckdb.InvalidInputException) as exc:
                broken[kind] = unreadable_part_message(str(exc))
        if kind not in broken:
            con.execute(f"CREATE OR REPLACE VIEW {name} AS {select}")
            continue
        schema = rollups.schema_file(layout) if name == ROLLUP_VIEW else None
        stand_in = _unreadable_sql(layout, kind, broken[kind], relative_to, schema)
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {stand_in}")
    return broken


def _create_scan(con: duckdb.DuckDBPyConnection, name: str, select: str,
                 layout: Layout | None = None) -> None:
    """Create a scan's view; bind it again (list anew: the pinned listing of `layout`'s files too, when
    given) when a part it listed was gone before it was opened: garbage collection deleted it, and the
    compacted file holding its rows is listed next time. A part that stays unreadable through BIND_TRIES
    is the caller's to report."""
    for attempt in range(BIND_TRIES):
        try:
            con.execute(f"CREATE OR REPLACE VIEW {name} AS {select}")
            return
        except (duckdb.IOException, duckdb.InvalidInputException):
            if attempt == BIND_TRIES - 1:
                raise
            time.sleep(0.02 * (attempt + 1))
            if layout is not None:
                pin(con, layout)


def unreadable_part_message(duckdb_error: str) -> str:
    """DuckDB's error as one line; when it is about a Parquet file (DuckDB names the file), with what
    to do about it."""
    first = duckdb_error.strip().splitlines()[0] if duckdb_error.strip() else "unreadable part file"
    if ".parquet" not in first or QUARANTINE_HINT in first:
        return first
    first = re.sub(r"^(?:[A-Za-z]+ )+Error: ", "", first)  # DuckDB's class ("Invalid Input Error: ")
    return f"{first} ({QUARANTINE_HINT})"


QUARANTINE_HINT = ("a part file of the store is corrupt or missing: `batchgen store check --repair` "
                   "moves bad files aside and marks the shards whose rows they held for re-run")


def _unreadable_sql(layout: Layout, kind: str, message: str, relative_to: Path | None = None,
                    schema_file: Path | None = None) -> str:
    """A stand-in for a kind's scan whose files cannot be read: it has the kind's base columns (those of
    `schema_file` when given), and every query that reads it fails with `message` (naming the file),
    while queries on views over other kinds (and `SELECT 1`) still answer."""
    schema = str(schema_file or layout.schema_file(kind))
    if relative_to is not None:
        schema = os.path.relpath(schema, relative_to)
    return (f"SELECT s.* FROM (SELECT 1 AS one WHERE error({_q(message)}) IS NULL) AS t "
            f"LEFT JOIN read_parquet({_q(schema)}) AS s ON true")


# ---------------------------------------------------------------- connections


def resolve_data_dir(data_dir: str | os.PathLike | None) -> str | os.PathLike:
    """data_dir, else $BATCHGEN_DATA_DIR, else ./data."""
    return data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV, DEFAULT_DATA_DIR)


def connect(data_dir: str | os.PathLike | None = None, *, read_only_user_sql: bool = False,
            memory_limit: str = "2GB", threads: int | None = None,
            views: Collection[str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the store's views over `data_dir`.

    With `read_only_user_sql=True` the connection is hardened for SQL typed by a user (the dashboard,
    `batchgen sql`): after the views exist, file access is limited to the store's tables directory,
    extension autoload/autoinstall is off, `memory_limit` applies and the configuration is locked.
    Run user SQL through `jobs.store.usersql.run_user_query`, which also refuses anything but one
    SELECT (DuckDB itself would still let COPY write inside the allowed directory).

    A kind whose part files cannot be read (a corrupt or vanished file) does not stop the connection:
    queries over its views fail with an error naming the file, all others answer (`create_views`).

    `views` (e.g. STATUS_VIEWS): only these views and those they read, for a short-lived connection
    that needs a few of them (creating a view binds it: every file of its scans is opened).
    """
    return connect_reporting(data_dir, read_only_user_sql=read_only_user_sql, memory_limit=memory_limit,
                             threads=threads, views=views)[0]


def connect_reporting(data_dir: str | os.PathLike | None = None, *, read_only_user_sql: bool = False,
                      memory_limit: str = "2GB", threads: int | None = None,
                      views: Collection[str] | None = None, defer_default: bool = False,
                      ) -> tuple[duckdb.DuckDBPyConnection, dict[str, str]]:
    """`connect`, and {kind: error} for the kinds whose parts could not be read.

    `defer_default`: for a short-lived connection queried only through `listing.over_listing`
    (`batchgen status`). Where the first listing holds each part of every kind once, only the listed
    catalog's views are made now, bound over that listing (which opens every file of their scans, as
    the default catalog's would: an unreadable part makes them the usual way instead); the default
    catalog's, a third of such a connection's set-up, wait for a listing that needs them."""
    layout = init_data_dir(resolve_data_dir(data_dir), create=False)
    con = duckdb.connect(":memory:")
    try:
        if threads is not None:
            con.execute(f"SET threads = {int(threads)}")
        if con.execute("SELECT current_database()").fetchone()[0] != DEFAULT_CATALOG:
            raise AssertionError(f"an in-memory connection's catalog is named {DEFAULT_CATALOG!r}")
        con.execute(f"CREATE SCHEMA IF NOT EXISTS {INTERNAL_SCHEMA}")
        broken = _create_listed_only(con, layout, views) if defer_default else None
        if broken is None:
            broken = _create_views_retrying(con, layout, views)
            _create_listed(con, layout, views, broken)
        _create_macros(con, layout, views, broken)
        # queries run over the globs, each listing anew, unless the caller pins a listing for them
        # (`listing.over_listing`: run_query and fetch_rows do, before each query, and choose the catalog)
        con.execute(f"RESET VARIABLE {LISTING_VARIABLE}")
        for kind, message in broken.items():
            log.warning("store %s: %s parts unreadable: %s", layout.root, kind, message)
        if read_only_user_sql:
            harden(con, layout, memory_limit)
    except Exception:
        con.close()
        raise
    return con, broken


def _create_macros(con: duckdb.DuckDBPyConnection, layout: Layout, views: Collection[str] | None,
                   broken: dict[str, str], pinned: bool = False) -> None:
    """The macros of the current catalog: the outputs of some shards, the data dir and the listed
    catalog's name (`listing.over_listing` reads them: the default catalog's come last, so that a pin
    during the set-up chooses no catalog)."""
    if views is None or "outputs" in _with_dependencies(views):
        # over unreadable outputs parts, the view's stand-in: its error names the file
        body = ("SELECT * FROM outputs WHERE job_id = job" if "outputs" in broken
                else _outputs_of_shards_sql(layout, pinned))
        con.execute(f"CREATE MACRO {OUTPUTS_OF_SHARDS_MACRO}(job, lo, hi) AS TABLE {body}")
    if views is None or f"_bg.scan_{rollups.SAMPLED_KIND}" in _with_dependencies(views):
        body = _samples_macro_sql(layout, pinned, broken)
        con.execute(f"CREATE MACRO {SAMPLES_MACRO}(lvl) AS TABLE {body}")
    con.execute(f"CREATE MACRO {DATA_DIR_MACRO}() AS {_q(str(layout.root))}")
    con.execute(f"CREATE MACRO {LISTED_CATALOG_MACRO}() AS {_q(LISTED_CATALOG)}")


def _create_listed(con: duckdb.DuckDBPyConnection, layout: Layout, views: Collection[str] | None,
                   broken: dict[str, str], *, over_pinned: bool = False) -> None:
    """The listed catalog (`LISTED_CATALOG`): the same views and macros, with every scan reading the
    pinned listing's files as they are (`_listed_scan_sql`). `listing.over_listing` makes it the
    query's catalog (`USE`) where the listing holds each part of every kind in one file, the default
    catalog otherwise. Its views are bound over a listing of the schema files (no part file opened),
    or with `over_pinned` over the listing pinned now; a kind the default catalog found unreadable
    gets the same stand-in."""
    con.execute(f"ATTACH ':memory:' AS {LISTED_CATALOG}")
    con.execute(f"USE {LISTED_CATALOG}")
    try:
        if not over_pinned:
            con.execute(f"SET VARIABLE {LISTING_VARIABLE} = $1", [schema_listing(layout).variable()])
        _create_view_set(con, layout, views=views, pinned=True, broken=broken)
        _create_macros(con, layout, views, broken, pinned=True)
    finally:
        con.execute(f"USE {DEFAULT_CATALOG}")


def _create_listed_only(con: duckdb.DuckDBPyConnection, layout: Layout,
                        views: Collection[str] | None) -> dict[str, str] | None:
    """`connect_reporting(defer_default=True)`'s listed catalog, bound over the first listing, with the
    default catalog's views left to `listing.over_listing` ({}: no kind unreadable); None, and nothing
    made, where that listing may hold a part twice or a part could not be read (a corrupt one, or one
    deleted since it was listed): then both catalogs are made the usual way."""
    if not all(pin(con, layout).disjoint.values()):
        return None
    try:
        _create_listed(con, layout, views, {}, over_pinned=True)
    except (duckdb.IOException, duckdb.InvalidInputException):
        con.execute(f"DETACH {LISTED_CATALOG}")
        return None
    defer_default_views(con, lambda c: _create_views_retrying(c, layout, views))
    return {}


BIND_TRIES = 4  # a view is bound again when a part it listed was deleted before it was opened


def _create_views_retrying(con: duckdb.DuckDBPyConnection, layout: Layout,
                           views: Collection[str] | None) -> dict[str, str]:
    """`create_views`, again when binding a view over other views met a part that garbage collection
    deleted after the listing (a compacted file holds its rows: the next listing is right). A scan's
    own unreadable part is reported, not retried (`create_views`)."""
    for attempt in range(BIND_TRIES):
        try:
            pin(con, layout)  # bind over a fresh listing (each try lists anew)
            return create_views(con, layout, views=views)
        except duckdb.IOException:
            if attempt == BIND_TRIES - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


def harden(con: duckdb.DuckDBPyConnection, layout: Layout, memory_limit: str) -> None:
    """Lock a connection down to reading the store's views (see `connect`)."""
    tables = str(layout.store / "tables") + os.sep
    for stmt in (
        "SET autoinstall_known_extensions = false",
        "SET autoload_known_extensions = false",
        "SET allow_community_extensions = false",
        f"SET memory_limit = {_q(memory_limit)}",
        f"SET allowed_directories = [{_q(tables)}]",
        "SET enable_external_access = false",
        "SET lock_configuration = true",
    ):
        con.execute(stmt)


# ---------------------------------------------------------------- the catalog file and migrations


def write_catalog(data_dir: str | os.PathLike) -> bool:
    """(Re)create the views in DATA_DIR/batchgen.duckdb; False when the file is held by another process."""
    layout = init_data_dir(data_dir)
    try:
        con = duckdb.connect(str(layout.catalog))
    except duckdb.IOException as exc:
        log.info("catalog %s is in use, views not refreshed: %s", layout.catalog, exc)
        return False
    try:
        for name in _stale_objects(con):  # objects of older catalogs (internal views were in main)
            con.execute(f"DROP VIEW IF EXISTS {name}")
        # DuckDB binds a view when it is created: resolve the relative paths against the data dir
        con.execute(f"SET file_search_path = {_q(str(layout.root))}")
        for attempt in range(4):  # a part listed while a view was bound, then deleted: bind again
            try:
                create_views(con, layout, relative_to=layout.root)
                break
            except duckdb.IOException:
                if attempt == 3:
                    raise
                time.sleep(0.05 * (attempt + 1))
        # no data dir in it: the catalog of a copied data dir is the copy's (paths above are relative)
        con.execute(f"CREATE OR REPLACE TABLE {INTERNAL_SCHEMA}.meta AS "
                    "SELECT ? AS schema_version, ? AS written_at", [SCHEMA_VERSION, time.time()])
        con.execute("DROP TABLE IF EXISTS batchgen_meta")
        con.execute("CHECKPOINT")
    finally:
        con.close()
    return True


def _stale_objects(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute(
        "SELECT view_name FROM duckdb_views() WHERE schema_name = 'main' AND NOT internal "
        "AND starts_with(view_name, '_')").fetchall()]
