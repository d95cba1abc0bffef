"""Running SQL with a time limit and a row cap, and refusing user SQL that is not a plain read.

`run_query(con, sql)` runs any SQL of ours with a deadline enforced by `con.interrupt()` from a
timer and returns at most `max_rows` rows. `run_user_query(con, sql)` first checks SQL a user typed
(dashboard, `batchgen sql`) and refuses, with a message that says why:

- anything but exactly one SELECT statement (COPY, ATTACH, INSTALL/LOAD, SET/RESET, CREATE, INSERT,
  EXPORT, PRAGMA, CALL, ...);
- any function that reads or lists files or runs SQL text (read_csv, read_text, read_blob, glob,
  read_parquet, parquet_metadata, query, ...), and file paths used as tables (`FROM 'x.csv'`).

This is one of two layers: the connection from `connect(..., read_only_user_sql=True)` also has file
access off outside the store's own tables directory and its configuration locked.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import duckdb

from jobs.store.layout import StoreError
from jobs.store.listing import over_listing

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_ROWS = 10_000

_DENIED_PREFIXES = ("read_", "parquet_", "sniff_", "iceberg_", "delta_", "sqlite_", "postgres_", "mysql_")
_DENIED_NAMES = frozenset({
    "glob", "query", "query_table", "csv_scan", "parquet_scan", "json_execute_serialized_sql", "getenv",
    "st_read", "read_xlsx", "load_aws_credentials", "duckdb_secrets",
})


class UserSqlError(StoreError):
    """A query refused before it ran, or one that failed or ran out of time (its message is for users)."""


class QueryTimeout(UserSqlError):
    """A query interrupted at its time limit."""


@dataclass
class QueryResult:
    """Rows of one query, capped."""

    columns: list[str]  # output column names
    rows: list[tuple]  # at most max_rows rows
    truncated: bool  # True when the query had more rows than max_rows
    elapsed_s: float  # wall time of execute + fetch


QUERY_TRIES = 4  # a query whose part file vanished under it (compaction's garbage collection) runs again
RETRY_PAUSE_S = 0.05


def run_query(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any] | list | None = None, *,
              timeout_s: float = DEFAULT_TIMEOUT_S, max_rows: int = DEFAULT_MAX_ROWS,
              tries: int = QUERY_TRIES, job_id: str | None = None) -> QueryResult:
    """Run one query with a deadline (interrupting it) and a row cap. A file error (the compactor
    removed a part the query had listed) runs it again, up to `tries` times in all. `job_id`: the
    query's answer depends on that job's rows alone, so only its files are listed for it."""
    for attempt in range(tries):
        try:
            # the store's files listed once for this try (listing.py); nothing on other connections
            with over_listing(con, job_id=job_id):
                return _run_once(con, sql, params, timeout_s, max_rows)
        except UserSqlError as exc:
            if not isinstance(exc.__cause__, duckdb.IOException) or attempt == tries - 1:
                raise
            time.sleep(RETRY_PAUSE_S * (attempt + 1))
    raise AssertionError("unreachable")


def _run_once(con: duckdb.DuckDBPyConnection, sql: str, params, timeout_s: float,
              max_rows: int) -> QueryResult:
    start = time.perf_counter()
    guard = _Deadline(con, timeout_s)
    try:
        con.execute(sql, params) if params else con.execute(sql)
        columns = [d[0] for d in con.description or []]
        rows = con.fetchmany(max_rows + 1)
        truncated = len(rows) > max_rows
    except duckdb.InterruptException as exc:
        raise QueryTimeout(f"query ran past its {timeout_s:g} s limit and was interrupted") from exc
    except duckdb.Error as exc:
        raise UserSqlError(_with_part_hint(str(exc))) from exc
    finally:
        guard.cancel()
        _finish(con)
    return QueryResult(columns, rows[:max_rows], truncated, time.perf_counter() - start)


def _with_part_hint(message: str) -> str:
    """A DuckDB error; one about a Parquet part (it names the file) says what to do about it."""
    from jobs.store.catalog import unreadable_part_message

    return unreadable_part_message(message) if ".parquet" in message.splitlines()[0] else message


def run_user_query(con: duckdb.DuckDBPyConnection, sql: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                   max_rows: int = DEFAULT_MAX_ROWS) -> QueryResult:
    """Check SQL a user typed (`check_user_sql`), then run it with `run_query`'s limits."""
    statement = check_user_sql(con, sql)
    return run_query(con, statement, timeout_s=timeout_s, max_rows=max_rows)


def check_user_sql(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    """The one SELECT statement in `sql`, or UserSqlError saying why it is refused."""
    if not isinstance(sql, str) or not sql.strip():
        raise UserSqlError("empty query: give one SELECT statement")
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise UserSqlError(str(exc)) from exc
    if len(statements) != 1:
        raise UserSqlError(f"one statement at a time, got {len(statements)}")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise UserSqlError(f"read-only: only SELECT queries are allowed, not {kind.name}")
    _check_tree(con, statements[0].query)
    return statements[0].query


def _check_tree(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0])
    if tree.get("error"):
        raise UserSqlError(f"read-only: this query form is not allowed ({tree.get('error_message')})")
    for node in _walk(tree):
        name = node.get("function_name")
        if isinstance(name, str) and _denied(name):
            raise UserSqlError(f"read-only: {name}() reads files or runs SQL text and is not allowed; "
                               "query the views (jobs, shards, outputs, requests, iterations, sweeps)")
        if node.get("type") == "BASE_TABLE" and _looks_like_path(node.get("table_name", "")):
            raise UserSqlError(f"read-only: reading the file {node['table_name']!r} is not allowed; "
                               "query the views instead")


def _walk(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _denied(name: str) -> bool:
    name = name.lower()
    return name in _DENIED_NAMES or name.startswith(_DENIED_PREFIXES)


def _looks_like_path(name: str) -> bool:
    return any(ch in name for ch in "/\\.:")


def _finish(con: duckdb.DuckDBPyConnection) -> None:
    """Release the connection's open result, if any (DuckDB 2 results stream and own the connection)."""
    try:
        con.abort()
    except duckdb.Error:
        pass


class _Deadline:
    """Interrupts the connection's running query when `timeout_s` passes, unless cancelled first."""

    def __init__(self, con: duckdb.DuckDBPyConnection, timeout_s: float) -> None:
        self._con = con
        self._lock = threading.Lock()
        self._done = False
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._done:
                self._con.interrupt()

    def cancel(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()
