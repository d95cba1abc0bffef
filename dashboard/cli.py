"""`batchgen dashboard`: serve the dashboard over a data dir.

Binds 127.0.0.1 by default. Any other host exposes the outputs and a SQL box to the network, so
the command refuses to start there unless BATCHGEN_DASHBOARD_TOKEN is set; every request must
then carry that token (see `dashboard.auth`). Requests whose `Host` header names neither a loopback
name, `--host` nor one of BATCHGEN_DASHBOARD_ALLOWED_HOSTS are refused (DNS rebinding), and so are
cross-origin POSTs.

Served by waitress, a production WSGI server (pure Python, a pool of threads; the page queries run
in DuckDB, which releases the GIL). `--dev` serves with werkzeug's development server and its
reloader instead (the process restarts when a source file changes); its debugger stays off.
"""

from __future__ import annotations

import ipaddress
import logging
import os

import click

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8265


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost' (names other than localhost are not trusted)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback host without a token (click.UsageError, naming the variable)."""
    if not is_loopback(host) and not token:
        raise click.UsageError(
            f"--host {host} is reachable from other machines: set BATCHGEN_DASHBOARD_TOKEN to a secret "
            "(every request must then carry it), or bind 127.0.0.1"
        )


@click.command("dashboard")
@click.option("--data-dir", envvar="BATCHGEN_DATA_DIR", default="./data", show_default=True,
              type=click.Path(file_okay=False), help="Data dir to read (env BATCHGEN_DATA_DIR).")
@click.option("--host", default=DEFAULT_HOST, show_default=True,
              help="Address to bind; a non-loopback one needs BATCHGEN_DASHBOARD_TOKEN. Requests must name "
                   "it, a loopback name or one of BATCHGEN_DASHBOARD_ALLOWED_HOSTS in their Host header.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(0, 65535))
@click.option("--sql-timeout", default=10.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds a query on the SQL page may run before it is interrupted.")
@click.option("--sql-row-cap", default=10_000, show_default=True, type=click.IntRange(1, 10_000_000),
              help="Rows a query on the SQL page returns at most.")
@click.option("--threads", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Requests served at once (waitress's thread pool).")
@click.option("--page-cache-entries", default=256, show_default=True, type=click.IntRange(0, 100_000),
              help="Page query results kept while the store's files are unchanged (0: no cache).")
@click.option("--dev", is_flag=True,
              help="Serve with werkzeug's reloader instead of waitress (development only).")
def dashboard(data_dir: str, host: str, port: int, sql_timeout: float, sql_row_cap: int, threads: int,
              page_cache_entries: int, dev: bool) -> None:
    """Serve the monitoring dashboard (jobs, workers, sweeps, SQL, /metrics) over DATA_DIR."""
    from dashboard import create_app

    token = os.environ.get("BATCHGEN_DASHBOARD_TOKEN") or None
    check_bind(host, token)
    app = create_app({"DATA_DIR": data_dir, "TOKEN": token, "SQL_TIMEOUT_S": sql_timeout,
                      "SQL_ROW_CAP": sql_row_cap, "ALLOWED_HOSTS": [host],
                      "PAGE_CACHE_ENTRIES": page_cache_entries})
    if dev:
        _serve_dev(app, host, port, data_dir, token)
    else:
        _serve(app, host, port, threads, data_dir, token)


def _announce(host: str, port: int, data_dir: str, token: str | None, server: str) -> None:
    shown = f"[{host}]" if ":" in host else host
    log.info("batchgen dashboard over %s on http://%s:%d/ (%s)%s", os.path.abspath(data_dir), shown, port,
             server, "  (token required)" if token else "")


def _serve(app, host: str, port: int, threads: int, data_dir: str, token: str | None) -> None:
    """waitress until SIGINT/SIGTERM; port 0 binds a free port (the announced URL says which)."""
    from waitress.server import create_server

    try:
        server = create_server(app, host=host, port=port, threads=threads)
    except OSError as exc:
        raise click.ClickException(f"cannot serve on --host {host} --port {port}: {exc}") from None
    _announce(host, int(server.effective_port), data_dir, token, f"waitress, {threads} threads")
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def _serve_dev(app, host: str, port: int, data_dir: str, token: str | None) -> None:
    from werkzeug.serving import run_simple

    if os.environ.get("WERKZEUG_RUN_MAIN") != "true":  # the reloader's parent: announce once
        _announce(host, port, data_dir, token, "werkzeug development server with reloader")
    run_simple(host, port, app, threaded=True, use_reloader=True, use_debugger=False)
