"""SQL page: a query box over the views, results as a table, CSV download, example queries.

    GET  /sql            the page
    POST /api/sql        {"sql": "..."} -> {"columns": [...], "rows": [[...], ...], "truncated", "row_cap",
                         "elapsed_s"}, or HTTP 400 {"error": "..."} for a refused or failed query
    POST /api/sql.csv    the same query (form field or JSON "sql") as a CSV attachment; 400 with the error

Each query runs in a process of its own (`jobs.store.sqlsandbox.run_sandboxed`): a capped address
space, a hardened connection (`jobs.store.connect(..., read_only_user_sql=True)`: file access
outside the store's tables off, extension autoload/autoinstall off, DuckDB's memory limit, the
configuration locked), one SELECT only, killed at the time limit, rows and result bytes capped.
The server's own memory never holds more than the capped result. Whatever goes wrong comes back as
a 400 with a message, never a 500; a query beyond the cap on concurrent queries gets a 429.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

import duckdb
from flask import Blueprint, Response, current_app, jsonify, render_template, request

from dashboard.jsonout import plain_value
from jobs.store import (
    README_EXAMPLES,
    QueryBusy,
    QueryResult,
    SqlLimits,
    StoreError,
    UserSqlError,
    connect,
    run_sandboxed,
)

bp = Blueprint("sql", __name__)

MAX_SQL_CHARS = 100_000

# (title, SQL) offered on the page beside the README's examples
EXAMPLES: list[tuple[str, str]] = [
    ("Jobs, newest first",
     "SELECT job_id, status, model, num_requests, rows_done, output_tokens, submitted_at\n"
     "FROM jobs ORDER BY submitted_at DESC"),
    ("Finish reasons per job",
     "SELECT job_id, finish_reason, count(*) AS n\nFROM outputs GROUP BY ALL ORDER BY ALL"),
    ("Running vs waiting, per worker", "SELECT worker_id, avg(num_running) AS mean_running, "
                                       "avg(num_waiting) AS mean_waiting,\n"
                                       "       max(num_running) AS max_running, count(*) AS iterations\n"
                                       "FROM iterations GROUP BY worker_id ORDER BY worker_id"),
    *README_EXAMPLES,
]


class RefusedQuery(Exception):
    """A user query that will not run or did not finish; its message is shown as it is."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status  # 400, or 429 when too many queries run already


@bp.get("/sql")
def sql_page():
    return render_template("sql.html", examples=EXAMPLES, row_cap=current_app.config["SQL_ROW_CAP"],
                           timeout_s=current_app.config["SQL_TIMEOUT_S"])


@bp.post("/api/sql")
def api_sql():
    try:
        result = run_user_sql(_sql_from_request())
    except RefusedQuery as exc:
        return jsonify(error=str(exc)), exc.status
    rows = [[plain_value(v) for v in row] for row in result.rows]
    return jsonify(columns=result.columns, rows=rows, truncated=result.truncated,
                   row_cap=current_app.config["SQL_ROW_CAP"], elapsed_s=result.elapsed_s)


@bp.post("/api/sql.csv")
def api_sql_csv():
    try:
        result = run_user_sql(_sql_from_request())
    except RefusedQuery as exc:
        return Response(f"error: {exc}\n", status=exc.status, mimetype="text/plain")
    return Response(_csv_lines(result), mimetype="text/csv",
                    headers={"Content-Disposition": "attachment; filename=query.csv"})


def user_connection() -> duckdb.DuckDBPyConnection:
    """A fresh connection hardened for user SQL (file access, extensions, memory, config locked)."""
    cfg = current_app.config
    return connect(cfg["DATA_DIR"], read_only_user_sql=True, memory_limit=cfg["SQL_MEMORY_LIMIT"])


def sql_limits() -> SqlLimits:
    cfg = current_app.config
    return SqlLimits(timeout_s=cfg["SQL_TIMEOUT_S"], max_rows=cfg["SQL_ROW_CAP"],
                     max_result_bytes=cfg["SQL_MAX_RESULT_BYTES"], memory_limit=cfg["SQL_MEMORY_LIMIT"],
                     address_space_bytes=cfg["SQL_ADDRESS_SPACE_BYTES"],
                     max_concurrent=cfg["SQL_MAX_CONCURRENT"])


def run_user_sql(sql: str) -> QueryResult:
    """Run SQL a user typed in a limited process of its own; RefusedQuery says why it did not."""
    try:
        return run_sandboxed(current_app.config["DATA_DIR"], sql, sql_limits())
    except QueryBusy as exc:
        raise RefusedQuery(str(exc), status=429) from exc
    except (UserSqlError, StoreError) as exc:
        raise RefusedQuery(str(exc)) from exc


def _sql_from_request() -> str:
    body = request.get_json(silent=True) if request.is_json else None
    sql = body.get("sql") if isinstance(body, dict) else request.form.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        raise RefusedQuery('send the query as JSON {"sql": "SELECT ..."} (or form field "sql")')
    if len(sql) > MAX_SQL_CHARS:
        raise RefusedQuery(f"query is {len(sql):,} characters; at most {MAX_SQL_CHARS:,}")
    return sql


def _csv_lines(result: QueryResult) -> Iterator[str]:
    buf = io.StringIO()
    writer = csv.writer(buf)
    for row in [result.columns, *result.rows]:
        writer.writerow(["" if v is None else plain_value(v) for v in row])
        yield buf.getvalue()
        buf.seek(0)
        buf.truncate()
