"""The write path: Parquet part files written under a temporary name and renamed into place.

Callers (the worker runtime, the submitter, `batchgen sweep`) go through `Store`:

    store = Store(data_dir)                                   # sets up DATA_DIR/store (idempotent)
    store.record_job(JobRecord(...))                          # at submission
    store.record_shard_events([ShardEvent(..., "queued")])    # one part for many events
    store.record_queued_shards(job_id, shard_ids, num_requests, ts)   # a new job's, as columns
    attempt = store.begin_attempt(job_id, shard_id, attempt=1, worker_id="w1")   # writes "running"
    attempt.add_outputs([{"request_id": "7", "output_text": "...", "finish_reason": "stop",
                          "prompt_tokens": 12, "output_tokens": 30, "error": None, "topic": "x"}])
    attempt.add_request(request_id="7", finish_reason="stop", stats=request_stats)
    attempt.commit()                                          # only now do its rows count
    # or attempt.fail("CUDA OOM") / attempt.cancel("job cancelled")
    with store.telemetry_buffer(worker_id="w1") as buf:       # one per engine, not per shard
        buf.append(iteration_stats)                           # flushes itself when 2 s are due
    store.request_cancel(job_id, reason="user")
    store.record_sweep(SweepRecord(...))

Buffers flush when `flush_interval_s` (2 s) has passed at the next append, when they reach
`max_buffered_rows`, and on `flush()` / `commit()` / `close()`: there is no background thread, so a
caller that stops appending must call `flush()` itself (the worker does at shard end). Nothing here
grows without bound: a flushed buffer is emptied.

After a commit (and a telemetry part), the writer merges its group's raw parts once enough of them
wait (`jobs.store.compact.compact_written`), so a running job's views read a bounded number of files;
`Store(data_dir, compact_as_written=False)` (or BATCHGEN_STORE_WRITER_COMPACTION=0) leaves that to
the janitor. Its failure never fails the write: it is logged, and the janitor compacts later.

Rows are dicts (or a `pyarrow.Table`); base columns are cast to the kind's schema (`schemas.py`), and a
value that does not fit is an error naming the kind, the column and the row.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.stats import IterationStats, RequestStats
from jobs.store import digests, schemas
from jobs.store.catalog import write_catalog
from jobs.store.layout import (
    Layout,
    StoreError,
    check_id,
    codec,
    init_data_dir,
    new_uid,
    path_safe,
    write_table_atomic,
)
from jobs.store.schemas import (
    ATTEMPT_ID_COLUMN,
    FINISH_REASONS,
    INTERNAL_PREFIX,
    JOB_EVENTS,
    PART_COLUMN,
    SHARD_COLUMN,
    SHARD_EVENTS,
    CommitRecord,
    JobEvent,
    JobRecord,
    ShardEvent,
    SweepRecord,
)

log = logging.getLogger(__name__)

Rows = Sequence[Mapping] | pa.Table

WRITER_COMPACTION_ENV = "BATCHGEN_STORE_WRITER_COMPACTION"  # "0": writers leave compaction to the janitor
FLUSH_INTERVAL_S = 2.0
MAX_BUFFERED_ROWS = 8192
HELD_ROWS_FACTOR = 4  # a telemetry buffer whose writes fail holds at most this many times max_rows


# ---------------------------------------------------------------- tables from rows


def build_table(rows: Rows, schema: pa.Schema, *, kind: str, extra: bool = False,
                extra_schema: pa.Schema | None = None) -> pa.Table:
    """A table with `schema`'s columns first (cast), then any extra columns when `extra` is set."""
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    if isinstance(rows, pa.Table):
        columns, num_rows = {name: rows.column(name) for name in rows.column_names}, rows.num_rows
    else:
        columns, num_rows = _columns_from_dicts(rows, kind), len(rows)
    unknown = [n for n in columns if n not in schema.names]
    if unknown and not extra:
        raise StoreError(f"{kind} rows have unknown column(s) {unknown}; allowed: {schema.names}")
    arrays = [_base_array(columns, f, kind, num_rows) for f in schema]
    fields = list(schema)
    for name in unknown:
        if name.startswith(INTERNAL_PREFIX):
            raise StoreError(f"{kind} column {name!r} uses the reserved prefix {INTERNAL_PREFIX!r}")
        arr = _extra_array(columns[name], name, kind, extra_schema)
        arrays.append(arr)
        fields.append(pa.field(name, arr.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _columns_from_dicts(rows: Sequence[Mapping], kind: str) -> dict[str, list]:
    """Column name -> values, names in first-seen order (a row without a column gives None)."""
    names: dict[str, None] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise StoreError(f"{kind} row {i} is a {type(row).__name__}, not a mapping of column -> value")
        names.update(dict.fromkeys(row))
    return {name: [row.get(name) for row in rows] for name in names}


def _base_array(columns: dict, fld: pa.Field, kind: str, n: int) -> pa.Array:
    values = columns.get(fld.name)
    if values is None:
        return pa.nulls(n, type=fld.type)
    try:
        if isinstance(values, pa.ChunkedArray):
            return values.cast(fld.type).combine_chunks()
        return pa.array(values, type=fld.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError) as exc:
        row = _first_bad_row(values, fld.type)
        raise StoreError(f"{kind} column {fld.name!r} must be {fld.type}: row {row}{_label(columns, row)} "
                         f"holds {_value_at(values, row)!r} ({exc})") from exc


def _label(columns: dict, row: int) -> str:
    """' (request_id=...)' for a row that has one, so an error points at the request."""
    ids = columns.get("request_id")
    return f" (request_id={_value_at(ids, row)!r})" if ids is not None and row >= 0 else ""


def _first_bad_row(values, typ: pa.DataType) -> int:
    for i in range(len(values)):
        try:
            pa.array([_value_at(values, i)], type=typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
            return i
    return -1


def _value_at(values, i: int):
    if i < 0:
        return None
    value = values[i]
    return value.as_py() if isinstance(value, pa.Scalar) else value


def _extra_array(values, name: str, kind: str, extra_schema: pa.Schema | None) -> pa.Array:
    known = extra_schema is not None and name in extra_schema.names
    target = extra_schema.field(name).type if known else None
    try:
        if isinstance(values, pa.ChunkedArray):
            arr = values.combine_chunks()
            return arr.cast(target) if target is not None else arr
        return pa.array(values, type=target)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError) as exc:
        raise StoreError(f"{kind} extra column {name!r} cannot be stored as Parquet ({exc})") from exc


# ---------------------------------------------------------------- the part writer


@dataclass
class PartWriter:
    """Writes one kind's parts for one group (a job, a worker, a sweep) with one name prefix."""

    layout: Layout
    kind: str
    group: str  # directory under raw/: a job id, a path-safe worker id, a sweep id
    prefix: str  # file name prefix: carries job/worker, shard and attempt where there are ones
    uid: str = field(default_factory=new_uid)  # this writer's instance: keeps names unique
    seq: int = 0  # parts written so far (the sequence number in the next name)

    def next_name(self) -> str:
        return f"{self.prefix}~{self.uid}~{self.kind}~{self.seq:06d}.parquet"

    def write(self, table: pa.Table) -> str:
        """Write `table` (with its `_bg_part` column filled here) as the next part; its name."""
        name = self.next_name()
        table = _set_column(table, PART_COLUMN, pa.array([name] * table.num_rows, pa.string()))
        write_table_atomic(table, self.layout.raw_dir(self.kind, self.group) / name, self.layout.tmp,
                           codec(self.kind))
        self.seq += 1
        return name


def _set_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    i = table.schema.get_field_index(name)
    if i < 0:
        return table.append_column(name, values)
    return table.set_column(i, pa.field(name, values.type), values)


# ---------------------------------------------------------------- a shard attempt


class ShardAttempt:
    """Everything one attempt at one shard writes: output rows, request timing rows, then a commit.

    Until `commit()`, the attempt's rows are invisible in `outputs` and `requests` (visible only in
    `requests_live`); a killed attempt therefore leaves nothing behind in the views. If two attempts
    of a shard both commit, the views count the one committed first (ties: smaller attempt id).
    """

    def __init__(self, store: Store, job_id: str, shard_id: int, attempt: int, worker_id: str, *,
                 extra_schema: pa.Schema | None = None, flush_interval_s: float = FLUSH_INTERVAL_S,
                 max_buffered_rows: int = MAX_BUFFERED_ROWS) -> None:
        check_id("job_id", job_id)
        _check_int("shard_id", shard_id, 0)
        _check_int("attempt", attempt, 1)
        self.store = store
        self.job_id, self.shard_id, self.attempt, self.worker_id = job_id, shard_id, attempt, worker_id
        self.attempt_id = f"{job_id}~s{shard_id}~a{attempt}~{new_uid()}"
        self.extra_schema = extra_schema
        self.flush_interval_s, self.max_buffered_rows = flush_interval_s, max_buffered_rows
        self._prefix = f"{job_id}~s{shard_id:06d}~a{attempt:03d}"
        self._writers = {kind: PartWriter(store.layout, kind, job_id, self._prefix)
                         for kind in ("outputs", "requests", "request_digests")}
        self._buffers: dict[str, list[Mapping]] = {"outputs": [], "requests": []}
        self._parts: list[str] = []
        self._totals = {"num_outputs": 0, "num_request_rows": 0, "prompt_tokens": 0, "output_tokens": 0,
                        "error_rows": 0}
        # request id -> its worst sample so far (_OUTCOME_RANK): the commit's request outcome counts
        self._outcomes: dict[str, int] = {}
        self._last_flush = time.monotonic()
        self.closed = False

    # -- rows in

    def add_outputs(self, rows: Iterable[Mapping]) -> None:
        """Output rows: request_id, output_text, finish_reason, prompt_tokens, output_tokens, error,
        plus the job's extra input columns. job_id is filled in (or must match)."""
        self._add("outputs", [self._own_output(row) for row in rows])

    def add_requests(self, rows: Iterable[Mapping]) -> None:
        """Request timing rows: `RequestStats.as_row()` plus request_id and finish_reason (job_id,
        shard_id, worker_id, attempt are filled in, or must match)."""
        self._add("requests", [self._own_request(row) for row in rows])

    def add_request(self, request_id: str, finish_reason: str, stats: RequestStats) -> None:
        """One finished request's timing row from its `RequestStats`."""
        self.add_requests([{"request_id": request_id, "finish_reason": finish_reason, **stats.as_row()}])

    # -- lifecycle

    def flush(self) -> None:
        """Write what is buffered as parts now (they stay invisible until commit)."""
        self._check_open()
        for kind, rows in self._buffers.items():
            if rows:
                self._write(kind, rows)
                self._buffers[kind] = []
        self._last_flush = time.monotonic()

    def commit(self) -> CommitRecord:
        """Flush, then write the commit part that makes this attempt's rows count."""
        self.flush()
        ranks = list(self._outcomes.values())
        record = CommitRecord(self.job_id, self.shard_id, self.attempt, self.attempt_id, self.worker_id,
                              time.time(), parts=list(self._parts), **self._totals,
                              **{f"requests_{outcome}": ranks.count(rank)
                                 for outcome, rank in _OUTCOME_RANK.items()})
        row = _renamed(schemas.record_row(record))
        self.store._write_records("commits", self.job_id, self._prefix, [row])
        self.closed = True
        self.store._compact_written(schemas.JOB_KINDS, self.job_id)
        return record

    def fail(self, error: str) -> None:
        """Record the attempt as failed (its rows never count). Buffered rows are dropped."""
        self._end("failed", error)

    def cancel(self, reason: str = "cancelled") -> None:
        """Record the attempt as cancelled (its rows never count). Buffered rows are dropped."""
        self._end("cancelled", reason)

    # -- internals

    def _end(self, event: str, error: str) -> None:
        self._check_open()
        self._buffers = {"outputs": [], "requests": []}
        self.store.record_shard_events([self._event(event, error=error)])
        self.closed = True

    def _event(self, event: str, error: str | None = None, num_requests: int | None = None) -> ShardEvent:
        return ShardEvent(self.job_id, self.shard_id, event, time.time(), self.attempt, self.worker_id,
                          error, num_requests, self.attempt_id)

    def _add(self, kind: str, rows: list[Mapping]) -> None:
        self._check_open()
        self._buffers[kind].extend(rows)
        due = time.monotonic() - self._last_flush >= self.flush_interval_s
        if due or len(self._buffers[kind]) >= self.max_buffered_rows:
            self.flush()

    def _write(self, kind: str, rows: list[Mapping]) -> None:
        schema = schemas.OUTPUTS if kind == "outputs" else schemas.REQUESTS
        table = build_table(rows, schema, kind=kind, extra=kind == "outputs", extra_schema=self.extra_schema)
        _check_not_null(table, kind, ("request_id", "finish_reason"))
        _check_values(table, kind, "finish_reason", FINISH_REASONS)
        self._parts.append(self._writers[kind].write(table))
        if kind == "outputs":
            self._totals["num_outputs"] += _first_samples(table)
            self._totals["prompt_tokens"] += _sum(table, "prompt_tokens")
            self._totals["output_tokens"] += _sum(table, "output_tokens")
            self._count_outcomes(table)
        else:
            self._totals["num_request_rows"] += table.num_rows
            self._write_digest(table, self._parts[-1])

    def _write_digest(self, requests: pa.Table, part: str) -> None:
        """The digest of a request-timing part just written (jobs.store.digests), beside it: an attempt
        that cannot write it fails (raises) like one that cannot write its rows, so every committed
        attempt's parts have their digests."""
        row = {"job_id": self.job_id, "shard_id": self.shard_id, "attempt": self.attempt,
               "requests_part": part, ATTEMPT_ID_COLUMN: self.attempt_id, **digests.digest(requests)}
        table = build_table([row], schemas.REQUEST_DIGESTS, kind="request_digests")
        self._writers["request_digests"].write(table)

    def _count_outcomes(self, table: pa.Table) -> None:
        """Fold an outputs part into the per-request outcomes (a request's samples may span parts)."""
        outcomes = self._outcomes
        for request_id, reason in zip(table.column("request_id").to_pylist(),
                                      table.column("finish_reason").to_pylist(), strict=True):
            rank = _REASON_RANK[reason]
            if rank > outcomes.get(request_id, -1):
                outcomes[request_id] = rank
            self._totals["error_rows"] += reason == "error"

    def _own_output(self, row: Mapping) -> dict:
        row = _caller_row(row, "outputs")
        _fill_or_match(row, "job_id", self.job_id, "outputs")
        row[SHARD_COLUMN] = self.shard_id
        row[ATTEMPT_ID_COLUMN] = self.attempt_id
        if row.get("request_id") is not None:
            row["request_id"] = str(row["request_id"])
        return row

    def _own_request(self, row: Mapping) -> dict:
        row = _caller_row(row, "requests")
        unknown = [name for name in row if name not in _REQUEST_COLUMNS]
        if unknown:
            allowed = schemas.REQUESTS.names
            raise StoreError(f"requests rows have unknown column(s) {unknown}; allowed: {allowed}")
        for name, value in (("job_id", self.job_id), ("shard_id", self.shard_id),
                            ("worker_id", self.worker_id), ("attempt", self.attempt)):
            _fill_or_match(row, name, value, "requests")
        row[ATTEMPT_ID_COLUMN] = self.attempt_id
        if row.get("request_id") is not None:
            row["request_id"] = str(row["request_id"])
        return row

    def _check_open(self) -> None:
        if self.closed:
            raise StoreError(f"attempt {self.attempt_id} is already committed, failed or cancelled")


_REQUEST_COLUMNS = frozenset(schemas.REQUESTS.names)  # a Schema's .names builds a new list per call

# a request's outcome is its worst sample's (as jobs.request_counts counts the outputs view)
_OUTCOME_RANK = {"completed": 0, "cancelled": 1, "failed": 2}
_REASON_RANK = {"stop": 0, "length": 0, "cancelled": 1, "error": 2}  # every one of FINISH_REASONS


def _caller_row(row: Mapping, kind: str) -> dict:
    if not isinstance(row, Mapping):
        raise StoreError(f"{kind} row is a {type(row).__name__}, not a mapping of column -> value")
    reserved = [name for name in row if str(name).startswith(INTERNAL_PREFIX)]
    if reserved:
        raise StoreError(f"{kind} column(s) {reserved} use the reserved prefix {INTERNAL_PREFIX!r}")
    return dict(row)


def _check_int(name: str, value: int, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise StoreError(f"{name} must be an integer >= {lo}, got {value!r}")


def _fill_or_match(row: dict, name: str, value, kind: str) -> None:
    given = row.get(name)
    if given is None or given == "":
        row[name] = value
    elif given != value:
        raise StoreError(f"{kind} row has {name}={given!r} but the attempt is for {name}={value!r}")


def _check_not_null(table: pa.Table, kind: str, names: Sequence[str]) -> None:
    for name in names:
        col = table.column(name)
        if col.null_count:
            row = next(i for i, v in enumerate(col.to_pylist()) if v is None)
            raise StoreError(f"{kind} column {name!r} is null in row {row}; it is required")


def _check_values(table: pa.Table, kind: str, name: str, allowed: Sequence[str]) -> None:
    for i, value in enumerate(table.column(name).to_pylist()):
        if value not in allowed:
            raise StoreError(f"{kind} column {name!r} row {i} is {value!r}; allowed: {list(allowed)}")


def _sum(table: pa.Table, name: str) -> int:
    total = pc.sum(table.column(name)).as_py()
    return int(total or 0)


def _first_samples(table: pa.Table) -> int:
    """Input rows answered: output rows of sample 0 (a row with n samples writes n output rows)."""
    first = pc.fill_null(pc.equal(table.column("sample_index"), 0), True)
    return int(pc.sum(first).as_py() or 0)


def _renamed(row: dict) -> dict:
    """A record dict with its `attempt_id` under the internal column name."""
    if "attempt_id" in row:
        row[ATTEMPT_ID_COLUMN] = row.pop("attempt_id")
    return row


# ---------------------------------------------------------------- engine telemetry


class TelemetryBuffer:
    """Iteration rows of one engine, buffered and written as `iterations` parts.

    Append every step's `IterationStats` (or its `as_row()`); the buffer writes a part when
    `flush_interval_s` has passed since the last write (checked on append), when `max_rows` rows are
    buffered, and on `flush()` / `close()`. Iteration rows are not tied to a shard attempt (one step
    serves many shards), so they are visible as soon as they are written. A write that fails keeps
    its rows for the next one; while writes keep failing (a full disk) the buffer holds at most
    HELD_ROWS_FACTOR x max_rows rows, the newest.
    """

    def __init__(self, store: Store, worker_id: str, *, flush_interval_s: float = FLUSH_INTERVAL_S,
                 max_rows: int = MAX_BUFFERED_ROWS) -> None:
        if not worker_id:
            raise StoreError("TelemetryBuffer needs a worker_id (it names the iterations' group)")
        self.worker_id = worker_id
        self.flush_interval_s, self.max_rows = flush_interval_s, max_rows
        group = path_safe(worker_id)
        self._store, self._group = store, group
        self._writer = PartWriter(store.layout, "iterations", group, group)
        self._rows: list[dict] = []
        self._last_flush = time.monotonic()
        self.rows_written = 0
        self.rows_dropped = 0  # the oldest rows given up while writes kept failing (a full disk)

    def append(self, stats: IterationStats | Mapping) -> None:
        self.extend((stats,))

    def extend(self, stats: Iterable[IterationStats | Mapping]) -> None:
        """Buffer every row of `stats`, then write a part if one is due. Every row is buffered before
        the write: a write that fails (a full disk) keeps them all, not only those before it."""
        for item in stats:
            row = item.as_row() if isinstance(item, IterationStats) else dict(item)
            if not row.get("worker_id"):
                row["worker_id"] = self.worker_id
            self._rows.append(row)
        if not self._rows:
            return
        due = time.monotonic() - self._last_flush >= self.flush_interval_s
        try:
            if due or len(self._rows) >= self.max_rows:
                self.flush()
        finally:
            if len(self._rows) >= HELD_ROWS_FACTOR * self.max_rows:  # writes keep failing: keep the newest
                self.rows_dropped += len(self._rows) - self.max_rows
                del self._rows[: len(self._rows) - self.max_rows]

    def flush(self) -> str | None:
        """Write the buffered rows as one part now; the part's name, or None when empty."""
        self._last_flush = time.monotonic()
        if not self._rows:
            return None
        table = build_table(self._rows, schemas.ITERATIONS, kind="iterations")
        name = self._writer.write(table)
        self.rows_written += table.num_rows
        self._rows = []
        self._store._compact_written(("iterations",), self._group)
        return name

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> TelemetryBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- the facade


class Store:
    """The write side of one data dir. Cheap to build; holds no open file or connection."""

    def __init__(self, data_dir: str | os.PathLike, *, compact_as_written: bool | None = None) -> None:
        self.layout = init_data_dir(data_dir)
        if compact_as_written is None:
            compact_as_written = os.environ.get(WRITER_COMPACTION_ENV, "1").strip() not in ("0", "false")
        self.compact_as_written = compact_as_written

    @property
    def data_dir(self) -> Path:
        return self.layout.root

    def begin_attempt(self, job_id: str, shard_id: int, attempt: int, worker_id: str, *,
                      num_requests: int | None = None, extra_schema: pa.Schema | None = None,
                      flush_interval_s: float = FLUSH_INTERVAL_S) -> ShardAttempt:
        """Start an attempt at a shard: records the `running` event and returns its writer.

        `extra_schema` (optional) fixes the Arrow types of the job's extra input columns.
        """
        att = ShardAttempt(self, job_id, shard_id, attempt, worker_id, extra_schema=extra_schema,
                           flush_interval_s=flush_interval_s)
        self.record_shard_events([att._event("running", num_requests=num_requests)])
        return att

    def telemetry_buffer(self, worker_id: str, *,
                         flush_interval_s: float = FLUSH_INTERVAL_S) -> TelemetryBuffer:
        return TelemetryBuffer(self, worker_id, flush_interval_s=flush_interval_s)

    def record_job(self, record: JobRecord) -> None:
        check_id("job_id", record.job_id)
        _check_int("num_shards", record.num_shards, 0)
        _check_int("num_requests", record.num_requests, 0)
        self._write_records("job_records", record.job_id, record.job_id, [schemas.record_row(record)])
        if not self.layout.catalog.exists():  # a first job: give `duckdb DATA_DIR/batchgen.duckdb` its views
            write_catalog(self.layout.root)

    def request_cancel(self, job_id: str, reason: str = "", ts: float | None = None) -> None:
        """Ask for a job to be cancelled: its shards that have not completed show as cancelled."""
        ts = time.time() if ts is None else ts
        event = JobEvent(check_id("job_id", job_id), "cancel_requested", ts, reason)
        self._write_records("job_events", job_id, job_id, [schemas.record_row(event)])

    def record_shard_events(self, events: Sequence[ShardEvent]) -> None:
        """Write shard events (any number, one part per job)."""
        by_job: dict[str, list[dict]] = {}
        for ev in events:
            check_id("job_id", ev.job_id)
            if ev.event not in SHARD_EVENTS:
                raise StoreError(f"shard event {ev.event!r} is not one of {SHARD_EVENTS}")
            by_job.setdefault(ev.job_id, []).append(_renamed(schemas.record_row(ev)))
        for job_id, rows in by_job.items():
            self._write_records("shard_events", job_id, job_id, rows)

    def record_queued_shards(self, job_id: str, shard_ids: pa.Array, num_requests: pa.Array,
                             ts: float) -> None:
        """A new job's shards queued for their first attempt, as one part: the rows `record_shard_events`
        writes for `ShardEvent(job_id, shard_id, "queued", ts, num_requests=n)`, built as columns from
        two int64 arrays (a 100M-row job queues 390,625 shards: no Python object per shard)."""
        check_id("job_id", job_id)
        n = len(shard_ids)
        if len(num_requests) != n:
            raise StoreError(f"{n} shard ids but {len(num_requests)} row counts")
        if n == 0:
            return
        text = lambda value: pa.repeat(pa.scalar(value, pa.string()), n)
        table = pa.table({"job_id": text(job_id), "shard_id": shard_ids, "event": text("queued"),
                          "ts": pa.repeat(pa.scalar(float(ts), pa.float64()), n),
                          "attempt": pa.repeat(pa.scalar(0, pa.int64()), n), "worker_id": text(""),
                          "error": pa.nulls(n, pa.string()), "num_requests": num_requests,
                          ATTEMPT_ID_COLUMN: text("")})
        self._write_records("shard_events", job_id, job_id, table)

    def record_sweep(self, records: SweepRecord | Sequence[SweepRecord]) -> None:
        records = [records] if isinstance(records, SweepRecord) else list(records)
        for sweep_id in {r.sweep_id for r in records}:
            rows = [schemas.record_row(r) for r in records if r.sweep_id == sweep_id]
            self._write_records("sweeps", check_id("sweep_id", sweep_id), sweep_id, rows)

    def committed(self, job_id: str, shard_id: int) -> CommitRecord | None:
        """The commit that counts for a shard (first committed; ties: smaller attempt id), or None.

        Workers use it to skip a shard that is already done (tasks are idempotent).
        """
        rows = [r for r in _read_commits(self.layout, check_id("job_id", job_id), shard_id)
                if r["shard_id"] == shard_id]
        revoked = {r[ATTEMPT_ID_COLUMN] for r in rows if r.get("lost") is not None}
        rows = [r for r in rows if r.get("lost") is None and r[ATTEMPT_ID_COLUMN] not in revoked]
        if not rows:
            return None
        best = min(rows, key=lambda r: (r["committed_ts"], r[ATTEMPT_ID_COLUMN]))
        fields = {k: best[k] for k in CommitRecord.__dataclass_fields__ if k in best}
        return CommitRecord(**fields, attempt_id=best[ATTEMPT_ID_COLUMN])

    def revoke_commit(self, record: CommitRecord, reason: str) -> None:
        """Make a shard's commit no longer count (its rows were lost): the shard is then not committed,
        and its next attempt's commit counts. Written under the shard's name prefix, so `committed`
        finds it beside the commit."""
        row = _renamed(schemas.record_row(CommitRecord(
            record.job_id, record.shard_id, record.attempt, record.attempt_id, record.worker_id, time.time(),
            lost=reason or "lost")))
        prefix = f"{record.job_id}~s{record.shard_id:06d}~a{record.attempt:03d}"
        self._write_records("commits", record.job_id, prefix, [row])

    def _compact_written(self, kinds: tuple[str, ...], group: str) -> None:
        """Merge the group's raw parts once enough wait (`compact.compact_written`); never raises."""
        if not self.compact_as_written:
            return
        from jobs.store.compact import compact_written  # compact imports the read path, not this module

        try:
            compact_written(self.layout, kinds, group)
        except Exception as exc:  # noqa: BLE001 -- a write that succeeded stays a success
            log.warning("store %s: compacting %s of %s after a write failed (the janitor will): %s",
                        self.layout.root, "/".join(kinds), group, exc)

    def _write_records(self, kind: str, group: str, prefix: str, rows: Rows) -> str:
        if kind == "job_events":
            _check_values(pa.table({"event": [r["event"] for r in rows]}), kind, "event", JOB_EVENTS)
        table = build_table(rows, schemas.KIND_SCHEMAS[kind], kind=kind)
        return PartWriter(self.layout, kind, group, prefix).write(table)


def _read_commits(layout: Layout, job_id: str, shard_id: int) -> list[dict]:
    """Commit rows of a job's shard: its raw commit parts (found by name) and the job's compacted
    commit files (retrying if garbage collection removes a file meanwhile)."""
    kind_dir = layout.kind_dir("commits")
    patterns = (str(kind_dir / "raw" / job_id / f"{job_id}~s{shard_id:06d}~*.parquet"),
                str(kind_dir / "compacted" / job_id / "*.parquet"))
    for _ in range(5):
        paths = sorted(path for pattern in patterns for path in glob.glob(pattern))
        try:
            return [row for path in paths for row in pq.read_table(path).to_pylist()]
        except FileNotFoundError:
            continue
    raise StoreError(f"commits of job {job_id} keep disappearing under {layout.kind_dir('commits')}")
