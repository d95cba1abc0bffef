"""`batchgen sql "QUERY"`: read-only SQL over the store's views.

The query runs in a process of its own (`jobs.store.sqlsandbox.run_sandboxed`) on a hardened
in-memory connection: one SELECT only, no file access beyond the views, its address space capped,
killed at the time limit, rows and result bytes capped, at most a few queries at once per data dir.
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
import uuid

import click

from jobs.store.catalog import resolve_data_dir
from jobs.store.layout import DATA_DIR_ENV, StoreError
from jobs.store.queries import README_EXAMPLES
from jobs.store.sqlsandbox import (
    DEFAULT_ADDRESS_SPACE_BYTES,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_RESULT_BYTES,
    SqlLimits,
    run_sandboxed,
)
from jobs.store.usersql import QueryResult

_EPILOG = "Examples:\n\n" + "\n\n".join(
    f"\b\n{title}:\n  batchgen sql \"{sql}\"" for title, sql in README_EXAMPLES
)


@click.command(name="sql", epilog=_EPILOG)
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, envvar=DATA_DIR_ENV,
              help=f"data dir (default: ${DATA_DIR_ENV} or ./data)")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=300.0, show_default=True,
              help="seconds before the query is interrupted")
@click.option("--max-rows", type=click.IntRange(min=1), default=10_000, show_default=True,
              help="rows printed at most (a note on stderr says when more were cut)")
@click.option("--max-mb", "max_mb", type=click.FloatRange(min=0.001), show_default=True,
              default=DEFAULT_MAX_RESULT_BYTES / (1 << 20), help="a result over this many MiB is refused")
@click.option("--memory-gb", "memory_gb", type=click.FloatRange(min=0.5), show_default=True,
              default=DEFAULT_ADDRESS_SPACE_BYTES / (1 << 30),
              help="address space of the query's process in GiB (a query needing more is stopped)")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=DEFAULT_MAX_CONCURRENT,
              show_default=True, help="queries running at once over the data dir; beyond it one is refused")
def sql(query: str, fmt: str, data_dir: str | None, timeout_s: float, max_rows: int, max_mb: float,
        memory_gb: float, max_concurrent: int) -> None:
    """Run a read-only SQL QUERY over the views jobs, shards, outputs, requests, requests_live,
    iterations and sweeps."""
    limits = SqlLimits(timeout_s=timeout_s, max_rows=max_rows, max_result_bytes=int(max_mb * (1 << 20)),
                       address_space_bytes=int(memory_gb * (1 << 30)), max_concurrent=max_concurrent)
    try:
        result = run_sandboxed(resolve_data_dir(data_dir), query, limits)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    {"table": _print_table, "csv": _print_csv, "json": _print_json}[fmt](result)
    if result.truncated:
        click.echo(f"(output cut at {max_rows} rows; use --max-rows or LIMIT)", err=True)


def _plain(value):
    """A value as JSON / CSV can hold it."""
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID | dt.timedelta):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _print_json(result: QueryResult) -> None:
    rows = [{c: _plain(v) for c, v in zip(result.columns, row, strict=True)} for row in result.rows]
    click.echo(json.dumps(rows, indent=2, ensure_ascii=False))


def _print_csv(result: QueryResult) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(result.columns)
    for row in result.rows:
        writer.writerow([_cell(v, csv_mode=True) for v in row])
    click.echo(buf.getvalue(), nl=False)


def _cell(value, *, csv_mode: bool = False) -> str:
    if value is None:
        return "" if csv_mode else "NULL"
    if isinstance(value, float):
        return repr(value) if csv_mode else f"{value:.6g}"
    plain = _plain(value)
    return json.dumps(plain, ensure_ascii=False) if isinstance(plain, list | dict) else str(plain)


def _print_table(result: QueryResult, max_width: int = 60) -> None:
    cells = [[_cell(v)[:max_width] for v in row] for row in result.rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(result.columns)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    click.echo(line)
    click.echo("| " + " | ".join(c.ljust(w) for c, w in zip(result.columns, widths, strict=True)) + " |")
    click.echo(line)
    for row in cells:
        click.echo("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |")
    click.echo(line)
    click.echo(f"({len(result.rows)} row{'s' if len(result.rows) != 1 else ''})")
