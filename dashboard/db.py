"""The read connection: `get_db()` for a request, closed by the teardown (as in Flask's flaskr).

One in-memory DuckDB database per app holds the store's views (`jobs.store.connect`); each request
gets its own cursor on it (a DuckDB connection is not safe to share between threads, its cursors
are) and closes it at teardown. The views read the Parquet parts afresh on every query (each query
lists the store's files first: `jobs.store.pin_listing`, through run_query), so a cursor always sees
what the writers have renamed into place; a query about one job (`queries.JOB_SCOPED`) lists only
that job's parts.

A data dir that does not exist yet is not an error: `get_db()` returns None and pages show their
empty state. Page queries run with a time limit, and one that meets a part file removed under it
(the compactor at work) runs again.
"""

from __future__ import annotations

import threading
import time

import duckdb
from flask import Flask, current_app, g

from dashboard.cache import Listing, QueryCache, list_store
from dashboard.queries import job_scope
from jobs.store import Layout, QueryResult, connect_reporting, run_query

BROKEN_RETRY_S = 5.0  # a base connection made while parts were unreadable is made anew after this

# Rows one page query may return: the series are bucketed in SQL far below this.
MAX_PAGE_ROWS = 200_000

Params = dict | list | None


class ViewSource:
    """The app's base connection with the views; created on first use, once the data dir exists.

    A base made while some kind's parts were unreadable (its views fail naming the file, the others
    answer) is made anew after BROKEN_RETRY_S, so the pages recover once the file is quarantined."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir  # as configured; resolved by the store
        self._base: duckdb.DuckDBPyConnection | None = None  # holds the views; never queried directly
        self._broken_since: float | None = None  # when a base with unreadable kinds was made
        self._lock = threading.Lock()  # guards _base and cursor() calls on it

    def cursor(self) -> duckdb.DuckDBPyConnection | None:
        """A new cursor over the views, or None while the data dir does not exist."""
        with self._lock:
            if self._broken_since is not None and time.monotonic() - self._broken_since > BROKEN_RETRY_S:
                self._base = None  # open cursors keep the old database alive until they close
            if self._base is None:
                if not Layout.of(self.data_dir).root.is_dir():
                    return None
                self._base, broken = connect_reporting(self.data_dir)
                self._broken_since = time.monotonic() if broken else None
            return self._base.cursor()

    def close(self) -> None:
        with self._lock:
            if self._base is not None:
                self._base.close()
                self._base = None


def init_app(app: Flask) -> None:
    app.extensions["batchgen_views"] = ViewSource(app.config["DATA_DIR"])
    entries = app.config["PAGE_CACHE_ENTRIES"]
    kept = QueryCache(entries, app.config["PAGE_CACHE_MAX_STALE_S"]) if entries else None
    app.extensions["batchgen_query_cache"] = kept
    app.teardown_appcontext(close_db)


def get_db() -> duckdb.DuckDBPyConnection | None:
    """This request's cursor over the views (None when the data dir does not exist yet)."""
    if "db" not in g:
        g.db = current_app.extensions["batchgen_views"].cursor()
    return g.db


def close_db(exc: BaseException | None = None) -> None:
    db = g.pop("db", None)
    if db is not None:
        db.close()


def run(sql: str, params: Params = None, *, cache: bool = True) -> QueryResult | None:
    """Run one of the dashboard's parameterized queries on this request's cursor.

    The store's `run_query` bounds it in time (PAGE_QUERY_TIMEOUT_S) and runs it again when a part
    file vanishes under it (the compactor at work). With `cache` (the default), a result computed
    since the store's files last changed is served instead (`dashboard.cache`). None when there is
    no data dir.
    """
    db = get_db()
    if db is None:
        return None

    # a query about one job lists only that job's parts (the other jobs' are not opened)
    job_id = job_scope(sql, params)

    def compute() -> QueryResult:
        return run_query(db, sql, params, timeout_s=current_app.config["PAGE_QUERY_TIMEOUT_S"],
                         max_rows=MAX_PAGE_ROWS, job_id=job_id)

    kept = current_app.extensions["batchgen_query_cache"]
    if not cache or kept is None:
        return compute()
    return kept.get(sql, params, _listing(), compute)


def _listing() -> Listing:
    """What this request saw of the store, listed before its first cached query."""
    if "store_listing" not in g:
        g.store_listing = list_store(Layout.of(current_app.config["DATA_DIR"]).store / "tables")
    return g.store_listing


def fetch_dicts(sql: str, params: Params = None, *, cache: bool = True) -> list[dict]:
    """Rows as dicts (column name -> Python value); [] when there is no data dir yet."""
    result = run(sql, params, cache=cache)
    if result is None:
        return []
    return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


def fetch_one(sql: str, params: Params = None) -> dict | None:
    rows = fetch_dicts(sql, params)
    return rows[0] if rows else None


def fetch_columns(sql: str, params: Params = None) -> dict[str, list]:
    """Columns as lists (name -> values), the shape uPlot draws from; {} without a data dir."""
    result = run(sql, params)
    if result is None:
        return {}
    return {name: [row[i] for row in result.rows] for i, name in enumerate(result.columns)}
