"""The results and telemetry store: Parquet parts are the write path, DuckDB views the read path.

Layout of a data dir (DATA_DIR: `--data-dir`, `$BATCHGEN_DATA_DIR`, default `./data`)::

    DATA_DIR/
      batchgen.duckdb              catalog: the same views, for a user's `duckdb` CLI
                                   (batchgen's own readers never open it)
      store/
        version.json               {"schema_version": N}
        tables/<kind>/
          _schema.parquet          zero rows: keeps the glob non-empty, fixes the base column types
          raw/<group>/<part>       parts as written: <group> is the job id (job kinds), the worker
                                   (iterations) or the sweep id (sweeps)
          compacted/<group>/c<16 digits>~<uid>.parquet   merged parts (newest name sorts first)
        tmp/                       temporary names (outside every glob); renamed into tables/
        gc/                        tombstones: inputs of a compaction, deleted after a grace period
        rollups/iterations/<group>/<compacted file's name>   its per-second rollups (`rollups.py`)
        rollups/request_digests/<group>/<compacted file's name>   its sampled request rows, flat
        locks/                     one lock file per group being compacted
      (samples/, jobs/, ... belong to other parts of batchgen)

    part name: <job>~s<shard:06d>~a<attempt:03d>~<uid>~<kind>~<seq:06d>.parquet   (shard attempt kinds)
               <group>~<uid>~<kind>~<seq:06d>.parquet                            (everything else)

Kinds: job_records, job_events (cancel requests), shard_events, commits (and their revocations,
rows with `lost` set: `Store.revoke_commit`), outputs, requests, request_digests (one per requests
part: `digests.py`), iterations, sweeps (`schemas.py`).
Views: jobs, shards, outputs, requests, requests_live, iterations, sweeps (`catalog.py`).

Nothing in a data dir names its own absolute path (view globs in the catalog file and tombstones are
relative to DATA_DIR): a copied or moved data dir reads and writes only itself.

Public API:

- write: `Store(data_dir)` -> `begin_attempt(...)` -> `ShardAttempt.add_outputs / add_requests /
  add_request / flush / commit / fail / cancel`; `telemetry_buffer(worker_id)` -> `TelemetryBuffer`;
  `record_job`, `record_shard_events` (`record_queued_shards`: a new job's, as columns),
  `request_cancel`, `record_sweep`, `committed` (`parts.py`);
  records `JobRecord`, `ShardEvent`, `SweepRecord`, `CommitRecord` (`schemas.py`).
- read: `connect(data_dir, read_only_user_sql=False, views=None) -> duckdb.DuckDBPyConnection` (`views`:
  only some views, e.g. `STATUS_VIEWS`); `pin_listing(con)`: the store's files listed once for the next
  queries, compaction's merged inputs left out (`listing.py`; `run_query` does it before each query,
  through `listing.over_listing`, which also runs the query in the listed catalog where it can),
  `execute_listed(con, sql, params)`: (columns, rows) of a query over such a listing, listed and run
  again on a deleted part (`run_listed(con, work)`: a few queries over one listing), `JOBS_SELECT`: the
  `jobs` view's SELECT,
  `jobs_over(relation)`: the same over a relation of `shards` rows (or after `JOB_SHARDS_CTES`, over
  their per-job counts), `over_scans(select)`: a SELECT
  with the views above the scans inlined (what `status` reads, on a connection of the scans only:
  `STATUS_BINDS`),
  `write_catalog(data_dir)` (`catalog.py`); `run_query`, `run_user_query`, `QueryResult`,
  `UserSqlError`, `QueryTimeout` (`usersql.py`); `QUERIES`, `run_named`, `README_EXAMPLES`
  (`queries.py`).
- user SQL under hard limits (a child process per query): `run_sandboxed`, `SqlLimits`, `QueryBusy`,
  the `DEFAULT_*` limits (`sqlsandbox.py`); unreadable parts: `connect_reporting`,
  `unreadable_part_message` (`catalog.py`); `check_store`, `missing_rows`, `quarantine`, `CheckReport`
  (`check.py`, behind `batchgen store check`, which lives in jobs.repair: repairing marks shards lost
  through the jobs layer's shard ledger).
- request digests (`digests.py`): `LATENCY_METRICS`, `TIMED_OUTPUT` (the metrics' one definition),
  `DIGEST_LEVELS`, `sampled_rows_sql(level, digests)`, `source_level(rows, undigested)`: what a large job's
  live figures read instead of every request row (`_bg.request_digests_live`; the samples through
  `_bg.request_samples(level)`, from the compacted digests' sample twins).
- per-second rollups of the iterations (`rollups.py`): `ROLLUP_AVERAGED`, `ROLLUP_SUMMED`, `ROLLUP_LATEST`
  (the columns they keep), read through `_bg.iteration_seconds`: what a long job's iteration chart reads.
- maintenance: `compact`, `compact_job`, `compact_telemetry`, `collect_garbage` (`compact.py`).
- layout: `DATA_DIR_ENV`, `DEFAULT_DATA_DIR`, `check_id`, `new_uid`, `write_atomic` (`layout.py`); schema
  constants `INTERNAL_PREFIX`, `OUTPUTS`, `LOGPROBS_TYPE` (`schemas.py`); worker heartbeats `WorkerRecord`,
  `read_worker_records`, `write_worker_record`, `no_worker_warning` (`workers.py`).
- `batchgen sql` (`cli.py`). Its benchmarks live in the benchmarks package: `batchgen bench store` (the
  dashboard's queries) and `batchgen bench dashboard-load` (50 concurrent clients while a job writes).

Everything outside this package imports from here, never from its modules (tests/test_layers.py).
"""

from jobs.store.catalog import (
    JOB_SHARDS_CTES,
    JOBS_SELECT,
    SHARD_WORKERS,
    SHARDS_PAGE,
    SHARDS_PAGE_ORDER,
    STATUS_BINDS,
    STATUS_VIEWS,
    UNCOMMITTED_DIGESTS,
    WORKER_LATEST_SHARDS,
    connect,
    connect_reporting,
    jobs_over,
    over_scans,
    unreadable_part_message,
    write_catalog,
)
from jobs.store.check import CheckReport, check_store, missing_rows, quarantine
from jobs.store.compact import collect_garbage, compact, compact_job, compact_telemetry
from jobs.store.digests import LATENCY_METRICS, TIMED_OUTPUT, sampled_rows_sql, source_level
from jobs.store.digests import LEVELS as DIGEST_LEVELS
from jobs.store.layout import (
    DATA_DIR_ENV,
    DEFAULT_DATA_DIR,
    SCHEMA_VERSION,
    Layout,
    StoreError,
    check_id,
    new_uid,
    write_atomic,
)
from jobs.store.listing import execute_listed, run_listed
from jobs.store.listing import pin as pin_listing
from jobs.store.parts import ShardAttempt, Store, TelemetryBuffer
from jobs.store.queries import QUERIES, README_EXAMPLES, run_named
from jobs.store.schemas import (
    INTERNAL_PREFIX,
    LOGPROBS_TYPE,
    OUTPUTS,
    ROLLUP_AVERAGED,
    ROLLUP_LATEST,
    ROLLUP_SUMMED,
    CommitRecord,
    JobRecord,
    ShardEvent,
    SweepRecord,
)
from jobs.store.sqlsandbox import (
    DEFAULT_ADDRESS_SPACE_BYTES,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_MEMORY_LIMIT,
    QueryBusy,
    SqlLimits,
    run_sandboxed,
)
from jobs.store.usersql import QueryResult, QueryTimeout, UserSqlError, run_query, run_user_query
from jobs.store.workers import WorkerRecord, no_worker_warning, read_worker_records, write_worker_record

__all__ = [
    "DEFAULT_ADDRESS_SPACE_BYTES", "DEFAULT_MAX_CONCURRENT", "DEFAULT_MAX_RESULT_BYTES",
    "DEFAULT_MEMORY_LIMIT",
    "QueryBusy", "SHARD_WORKERS", "SHARDS_PAGE", "SHARDS_PAGE_ORDER", "UNCOMMITTED_DIGESTS",
    "WORKER_LATEST_SHARDS",
    "STATUS_BINDS", "STATUS_VIEWS", "SqlLimits", "connect_reporting", "run_sandboxed",
    "unreadable_part_message",
    "CheckReport", "check_store", "missing_rows", "quarantine",
    "DIGEST_LEVELS", "LATENCY_METRICS", "TIMED_OUTPUT", "sampled_rows_sql", "source_level",
    "DATA_DIR_ENV", "DEFAULT_DATA_DIR", "INTERNAL_PREFIX", "JOB_SHARDS_CTES", "JOBS_SELECT", "LOGPROBS_TYPE",
    "OUTPUTS", "QUERIES", "ROLLUP_AVERAGED", "ROLLUP_LATEST", "ROLLUP_SUMMED", "README_EXAMPLES",
    "SCHEMA_VERSION",
    "CommitRecord", "JobRecord", "Layout",
    "QueryResult", "QueryTimeout", "ShardAttempt", "ShardEvent", "Store", "StoreError", "SweepRecord",
    "TelemetryBuffer",
    "UserSqlError", "WorkerRecord", "check_id", "collect_garbage", "compact", "compact_job",
    "compact_telemetry", "connect", "execute_listed", "jobs_over", "new_uid",
    "no_worker_warning", "over_scans", "pin_listing", "read_worker_records", "run_listed", "run_named",
    "run_query", "run_user_query", "write_atomic", "write_catalog",
    "write_worker_record",
]
