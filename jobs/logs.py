"""Log output of the long-running commands: plain text for a terminal, or one JSON object a line.

`--log-format json` (or $BATCHGEN_LOG_FORMAT=json) is for log shippers (Loki, Elasticsearch,
CloudWatch): every record, Celery's, waitress's and Python warnings included, becomes one line

    {"ts": "2026-12-01T01:17:41.047Z", "level": "INFO", "logger": "jobs.worker_main", "message": "...",
     "pid": 1234, "thread": "MainThread"}

with `exc` holding the traceback when there is one and any `extra=` fields as more keys. The CLI
(`jobs.cli`) adds the option to every long-running command; the chosen format is put into the
environment so the worker processes that `batchgen run` starts log the same way.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time

import click

LOG_FORMAT_ENV = "BATCHGEN_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HANDLER_NAME = "batchgen"

# attributes every LogRecord has: anything else on a record came from `extra=`
_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring for the keys)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": _iso_utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            "thread": record.threadName,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in entry:
                entry[key] = value
        return json.dumps(entry, default=str, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (click's test runner and pytest swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _iso_utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


def configure_logging(fmt: str | None = None, level: str | int = "INFO") -> None:
    """Send every log record (and Python warnings) to stderr in `fmt` (default: $BATCHGEN_LOG_FORMAT,
    else text), replacing the handler an earlier call installed (others, such as pytest's, stay)."""
    fmt = fmt or os.environ.get(LOG_FORMAT_ENV) or "text"
    if fmt not in LOG_FORMATS:
        raise click.BadParameter(f"{fmt!r} is not one of {', '.join(LOG_FORMATS)}", param_hint="--log-format")
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)


def add_log_format_option(command: click.Command) -> click.Command:
    """Give a command `--log-format text|json`: logging is configured before the command runs, and
    the choice is exported to the processes it starts. Idempotent."""
    if any(p.name == "log_format" for p in command.params):
        return command
    command.params.append(click.Option(
        ["--log-format"], type=click.Choice(LOG_FORMATS), envvar=LOG_FORMAT_ENV, default="text",
        show_default=True, help=f"Log lines as text or one JSON object each (or ${LOG_FORMAT_ENV})."))
    callback = command.callback

    @functools.wraps(callback)
    def run(*args, log_format: str, **kwargs):
        configure_logging(log_format)
        before = os.environ.get(LOG_FORMAT_ENV)
        os.environ[LOG_FORMAT_ENV] = log_format  # for the processes the command starts
        try:
            return callback(*args, **kwargs)
        finally:
            if before is None:
                os.environ.pop(LOG_FORMAT_ENV, None)
            else:
                os.environ[LOG_FORMAT_ENV] = before

    command.callback = run
    return command
