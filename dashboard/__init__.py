"""The batchgen dashboard: a Flask site over the DuckDB views of one data dir.

    app = create_app({"DATA_DIR": "/path/to/data"})

Pages (jobs, job detail, workers, sweeps, SQL) render their tables on the server and draw their
charts in the browser with uPlot (served from `static/vendor/`, no CDN) from JSON endpoints under
`/api/`. Every read goes through `dashboard.db.get_db()`: a per-request cursor over the store's
views, closed at teardown. User SQL runs on a separate hardened connection (`dashboard.sql`).
"""

from __future__ import annotations

import os

from flask import Flask, jsonify, render_template, request
from werkzeug.exceptions import HTTPException

from dashboard.formatting import register_filters
from dashboard.jsonout import DashboardJSONProvider
from jobs.store import (
    DEFAULT_ADDRESS_SPACE_BYTES,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_MEMORY_LIMIT,
    QueryTimeout,
    UserSqlError,
)

DATA_DIR_ENV = "BATCHGEN_DATA_DIR"
TOKEN_ENV = "BATCHGEN_DASHBOARD_TOKEN"

# Defaults; the environment (data dir, token) and then test_config override them.
DEFAULT_CONFIG = {
    "DATA_DIR": "./data",
    "TOKEN": None,  # when set, every request must carry it (see dashboard.auth)
    "ALLOWED_HOSTS": (),  # Host names served besides the loopback ones and BATCHGEN_DASHBOARD_ALLOWED_HOSTS
    "SQL_ROW_CAP": 10_000,  # rows a user query returns at most (the rest are cut, and it says so)
    "SQL_TIMEOUT_S": 10.0,  # a user query is interrupted after this long
    "SQL_MEMORY_LIMIT": DEFAULT_MEMORY_LIMIT,  # DuckDB memory_limit of the user SQL connection
    "SQL_ADDRESS_SPACE_BYTES": DEFAULT_ADDRESS_SPACE_BYTES,  # RLIMIT_AS of a user query's process
    "SQL_MAX_RESULT_BYTES": DEFAULT_MAX_RESULT_BYTES,  # a bigger user query result is refused
    "SQL_MAX_CONCURRENT": DEFAULT_MAX_CONCURRENT,  # user queries at once (per data dir); beyond: 429
    "PAGE_QUERY_TIMEOUT_S": 30.0,  # the dashboard's own queries are interrupted after this long
    "PAGE_CACHE_ENTRIES": 256,  # query results kept while the store's files are unchanged (0: none)
    "PAGE_CACHE_MAX_STALE_S": 30.0,  # while a newer result is computed, an older one this recent is served
    "MAX_POINTS": 2000,  # iteration series longer than this are bucketed on the server
    "REFRESH_S": 5,  # live pages poll this often while a job is queued or running
    "OUTPUT_SAMPLE_ROWS": 20,  # output rows shown on a job page
    "MAX_CONTENT_LENGTH": 1 << 20,  # request bodies (a SQL query) up to 1 MiB
    "METRICS_MAX_JOBS": 50,  # jobs with series of their own on /metrics (live ones first, then newest)
}

# Everything is served from here: no CDN, no inline script. uPlot sets inline styles.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
                           "base-uri 'none'; form-action 'self'")


def create_app(test_config: dict | None = None) -> Flask:
    """Build the dashboard app. `test_config` (a dict) overrides the defaults, e.g. DATA_DIR."""
    app = Flask(__name__)
    app.json = DashboardJSONProvider(app)
    app.config.from_mapping(DEFAULT_CONFIG)
    app.config["DATA_DIR"] = os.environ.get(DATA_DIR_ENV) or app.config["DATA_DIR"]
    app.config["TOKEN"] = os.environ.get(TOKEN_ENV) or None
    if test_config is not None:
        app.config.from_mapping(test_config)
    app.config["DATA_DIR"] = os.fspath(app.config["DATA_DIR"])

    from dashboard import auth, db, jobs, metrics, sql, sweeps, workers

    db.init_app(app)
    auth.init_app(app)
    register_filters(app)
    for blueprint in (jobs.bp, workers.bp, sweeps.bp, sql.bp, metrics.bp):
        app.register_blueprint(blueprint)
    app.after_request(_security_headers)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(UserSqlError, _query_error)
    return app


def _security_headers(response):
    response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("X-Frame-Options", "DENY")
    # same-origin, not no-referrer: under no-referrer a browser sends `Origin: null` even on the
    # page's own POSTs, and the origin check (dashboard.auth) could not tell them from a foreign one
    response.headers.setdefault("Referrer-Policy", "same-origin")
    return response


def _http_error(exc: HTTPException):
    """JSON errors under /api/, a page elsewhere."""
    if request.path.startswith("/api/"):
        return jsonify(error=exc.description), exc.code
    return render_template("error.html", code=exc.code, name=exc.name, message=exc.description), exc.code


def _query_error(exc: UserSqlError):
    """One of the dashboard's own queries failed or ran out of time: say so, 503 (try again)."""
    what = "timed out" if isinstance(exc, QueryTimeout) else "failed"
    message = f"a dashboard query {what}: {exc}"
    if request.path.startswith("/api/"):
        return jsonify(error=message), 503
    return render_template("error.html", code=503, name="Query " + what, message=message), 503
