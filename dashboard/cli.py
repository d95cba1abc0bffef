"""`batchgen dashboard`: serve the dashboard over a data dir.

Binds 127.0.0.1 by default. Any other host exposes the outputs and a SQL box to the network, so
the command refuses to start there unless BATCHGEN_DASHBOARD_TOKEN is set; every request must
then carry that token (see `dashboard.auth`).
"""

from __future__ import annotations

import ipaddress
import os

import click

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
              help="Address to bind; a non-loopback one needs BATCHGEN_DASHBOARD_TOKEN.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(0, 65535))
@click.option("--sql-timeout", default=10.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds a query on the SQL page may run before it is interrupted.")
@click.option("--sql-row-cap", default=10_000, show_default=True, type=click.IntRange(1, 10_000_000),
              help="Rows a query on the SQL page returns at most.")
def dashboard(data_dir: str, host: str, port: int, sql_timeout: float, sql_row_cap: int) -> None:
    """Serve the monitoring dashboard (jobs, workers, sweeps, SQL) over DATA_DIR."""
    from werkzeug.serving import run_simple

    from dashboard import create_app

    token = os.environ.get("BATCHGEN_DASHBOARD_TOKEN") or None
    check_bind(host, token)
    app = create_app({"DATA_DIR": data_dir, "TOKEN": token, "SQL_TIMEOUT_S": sql_timeout,
                      "SQL_ROW_CAP": sql_row_cap})
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"batchgen dashboard over {os.path.abspath(data_dir)} on http://{shown}:{port}/"
               + ("  (token required)" if token else ""))
    run_simple(host, port, app, threaded=True, use_reloader=False, use_debugger=False)
