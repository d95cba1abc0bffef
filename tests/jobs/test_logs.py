"""`--log-format json` (jobs.logs): one JSON object per line, on every long-running command."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
from click.testing import CliRunner

from jobs.cli import COMMANDS, LONG_RUNNING, cli
from jobs.logs import LOG_FORMAT_ENV, JsonFormatter, configure_logging


def _record(msg: str, *args, exc_info=None, **extra) -> logging.LogRecord:
    record = logging.makeLogRecord({"name": "jobs.test", "levelno": logging.WARNING, "levelname": "WARNING",
                                    "msg": msg, "args": args, "exc_info": exc_info, **extra})
    record.created = 1796000000.25
    return record


def test_json_line_has_time_level_logger_message_and_extras():
    line = JsonFormatter().format(_record("shard %s/%d: %s", "job-1", 3, "committed", shard_id=3))
    entry = json.loads(line)
    assert entry["ts"] == "2026-11-30T00:53:20.250Z"
    assert (entry["level"], entry["logger"]) == ("WARNING", "jobs.test")
    assert entry["message"] == "shard job-1/3: committed"
    assert entry["shard_id"] == 3 and isinstance(entry["pid"], int) and "\n" not in line


def test_json_line_carries_the_traceback():
    try:
        raise ValueError("bad shard")
    except ValueError:
        import sys

        entry = json.loads(JsonFormatter().format(_record("failed", exc_info=sys.exc_info())))
    assert entry["exc"].startswith("Traceback") and "ValueError: bad shard" in entry["exc"]


def test_configure_logging_replaces_only_its_own_handler(capsys):
    root = logging.getLogger()
    # an earlier CLI test in this process may have installed ours already, and captured warnings
    before = [h for h in root.handlers if h.get_name() != "batchgen"]
    logging.captureWarnings(False)
    try:
        configure_logging("text", "INFO")
        configure_logging("json", "INFO")
        ours = [h for h in root.handlers if h not in before]
        assert len(ours) == 1, "a second call replaces the first handler"
        logging.getLogger("jobs.x").info("hello %s", "there")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("careful", UserWarning, stacklevel=1)
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert lines[0]["message"] == "hello there" and lines[1]["logger"] == "py.warnings"
        assert all(h in root.handlers for h in before), "others' handlers (pytest's) stay"
    finally:
        for h in [h for h in root.handlers if h not in before]:
            root.removeHandler(h)
        logging.captureWarnings(False)


def test_unknown_format_is_a_usage_error():
    with pytest.raises(Exception, match="'xml' is not one of text, json"):
        configure_logging("xml")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_long_running_commands_take_log_format(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert ("--log-format" in result.output) == (name in LONG_RUNNING)


def test_bad_log_format_value_exits_2_naming_the_flag(tmp_path):
    result = CliRunner().invoke(cli, ["dashboard", "--log-format", "xml", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--log-format" in result.output


def test_environment_sets_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv(LOG_FORMAT_ENV, "yaml")
    result = CliRunner().invoke(cli, ["dashboard", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--log-format" in result.output and "'yaml'" in result.output
