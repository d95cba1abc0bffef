"""Read-only user SQL: the hardened connection, the statement check, the time limit and the row cap."""

from __future__ import annotations

import json
import time

import duckdb
import pytest
from click.testing import CliRunner

from jobs.cli import cli
from jobs.store.catalog import connect
from jobs.store.parts import Store
from jobs.store.queries import JOB_QUERIES, QUERIES, README_EXAMPLES, run_named
from jobs.store.schemas import JobRecord
from jobs.store.usersql import QueryTimeout, UserSqlError, check_user_sql, run_query, run_user_query


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("usersql")
    store = Store(path)
    store.record_job(JobRecord("job-u", "tiny", 3, 1, time.time()))
    att = store.begin_attempt("job-u", 0, 1, "w1")
    att.add_outputs([{"request_id": i, "output_text": f"o{i}", "finish_reason": "stop", "prompt_tokens": 2,
                      "output_tokens": 3, "error": None, "topic": "t"} for i in range(3)])
    att.commit()
    with store.telemetry_buffer("w1") as buf:
        buf.append({"iteration": 0, "ts": time.time(), "scheduled_tokens": 8, "token_budget": 16,
                    "num_preempted": 1, "kv_blocks_used": 3, "kv_blocks_total": 10, "job_ids": ["job-u"]})
    return path


@pytest.fixture
def hardened(data_dir):
    con = connect(data_dir, read_only_user_sql=True, memory_limit="256MB")
    yield con
    con.close()


def test_views_work_on_the_hardened_connection(hardened):
    result = run_user_query(hardened, "SELECT count(*) AS n, min(topic) FROM outputs")
    assert result.columns[0] == "n" and result.rows == [(3, "t")] and not result.truncated
    assert run_user_query(hardened, "SELECT status FROM jobs").rows == [("completed",)]


@pytest.mark.parametrize(("sql", "message"), [
    ("COPY (SELECT * FROM outputs) TO '/tmp/leak.csv'", "only SELECT queries are allowed, not COPY"),
    ("ATTACH '/tmp/other.duckdb' AS other", "not ATTACH"),
    ("INSTALL httpfs", "not LOAD"),
    ("LOAD httpfs", "not LOAD"),
    ("SET memory_limit = '100GB'", "not SET"),
    ("SET enable_external_access = true", "not SET"),
    ("CREATE TABLE t AS SELECT 1", "not CREATE"),
    ("EXPORT DATABASE '/tmp/x'", "not EXPORT"),
    ("PRAGMA version", "not PRAGMA"),
    ("SELECT 1; DROP VIEW outputs", "one statement at a time, got 2"),
    ("SELECT * FROM read_csv('/etc/passwd')", r"read_csv\(\) reads files"),
    ("SELECT * FROM read_text('/etc/hostname')", r"read_text\(\) reads files"),
    ("SELECT count(*) FROM glob('/*')", r"glob\(\) reads files"),
    ("SELECT * FROM read_blob('/etc/hostname')", r"read_blob\(\) reads files"),
    ("SELECT * FROM parquet_metadata('/x.parquet')", r"parquet_metadata\(\) reads files"),
    ("SELECT * FROM query('SELECT 1')", r"query\(\) reads files or runs SQL text"),
    ("SELECT * FROM '/etc/passwd'", "reading the file '/etc/passwd' is not allowed"),
    ("SELECT * FROM outputs WHERE request_id IN (SELECT * FROM read_text('/etc/hostname'))", "read_text"),
    ("", "empty query"),
])
def test_refused_statements_say_why(hardened, sql, message):
    with pytest.raises(UserSqlError, match=message):
        run_user_query(hardened, sql)


def test_the_connection_itself_blocks_files_and_settings(hardened, data_dir):
    """The second layer: even SQL that skipped check_user_sql cannot read files or unlock settings."""
    for sql in ("SELECT * FROM read_text('/etc/hostname')", "SELECT * FROM glob('/etc/*')",
                "ATTACH '/tmp/x.duckdb'", "COPY (SELECT 1) TO '/tmp/y.csv'"):
        with pytest.raises(duckdb.PermissionException):
            hardened.execute(sql).fetchall()
    for sql in ("SET enable_external_access = true", "SET memory_limit = '64GB'",
                "SET autoload_known_extensions = true", "RESET lock_configuration"):
        with pytest.raises(duckdb.InvalidInputException, match="configuration has been locked"):
            hardened.execute(sql)
    with pytest.raises(duckdb.Error):
        hardened.execute("LOAD httpfs")
    settings = dict(hardened.execute(
        "SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
        "'autoload_known_extensions', 'autoinstall_known_extensions', 'lock_configuration')").fetchall())
    assert set(settings.values()) <= {"false", "true"}
    assert settings["enable_external_access"] == "false" and settings["lock_configuration"] == "true"
    assert settings["autoload_known_extensions"] == "false"


def test_time_limit_interrupts_a_long_query(hardened):
    start = time.perf_counter()
    with pytest.raises(QueryTimeout, match="0.3 s limit"):
        run_user_query(hardened, "SELECT count(*) FROM range(100000000000) a", timeout_s=0.3)
    assert time.perf_counter() - start < 5
    assert run_user_query(hardened, "SELECT 42").rows == [(42,)]  # the connection is usable again


def test_row_cap(hardened):
    result = run_user_query(hardened, "SELECT * FROM range(25)", max_rows=10)
    assert len(result.rows) == 10 and result.truncated
    assert not run_user_query(hardened, "SELECT * FROM range(10)", max_rows=10).truncated
    assert run_user_query(hardened, "SELECT 1").rows == [(1,)]


def test_errors_in_user_sql_are_user_sql_errors(hardened):
    with pytest.raises(UserSqlError, match="no_such_view"):
        run_user_query(hardened, "SELECT * FROM no_such_view")
    assert check_user_sql(hardened, "  SELECT 1  ").strip() == "SELECT 1"


def test_every_named_query_and_readme_example_runs(data_dir, hardened):
    con = connect(data_dir)
    for name in QUERIES:
        params = {"job_id": "job-u"} if name in JOB_QUERIES else {}
        run_named(con, name, **params)
    assert run_named(con, "job_budget_utilisation", job_id="job-u").rows[0][1] == 0.5
    assert run_named(con, "preemptions_per_worker").rows[0][:2] == ("w1", 1)
    for title, sql in README_EXAMPLES:
        assert run_user_query(hardened, sql).columns, title
    with pytest.raises(KeyError, match="no query named"):
        run_named(con, "nope")
    con.close()


def test_run_query_leaves_no_open_result(data_dir):
    con = connect(data_dir)
    run_query(con, "SELECT * FROM range(100)", max_rows=5)
    assert con.execute("SELECT 1").fetchall() == [(1,)]
    con.close()


def test_batchgen_sql_formats_and_refusals(data_dir, monkeypatch):
    runner = CliRunner()
    sql = "SELECT request_id, output_tokens FROM outputs ORDER BY request_id"
    table = runner.invoke(cli, ["sql", sql, "--data-dir", str(data_dir)])
    assert table.exit_code == 0, table.output
    assert "| request_id | output_tokens |" in table.output and "(3 rows)" in table.output
    csv_out = runner.invoke(cli, ["sql", sql, "--data-dir", str(data_dir), "--format", "csv"])
    assert csv_out.output.splitlines() == ["request_id,output_tokens", "0,3", "1,3", "2,3"]
    monkeypatch.setenv("BATCHGEN_DATA_DIR", str(data_dir))
    js = runner.invoke(cli, ["sql", "SELECT job_id, submitted_at, status FROM jobs", "--format", "json"])
    [row] = json.loads(js.output)
    assert row["job_id"] == "job-u" and row["status"] == "completed" and "T" in row["submitted_at"]
    refused = runner.invoke(cli, ["sql", "COPY (SELECT 1) TO '/tmp/z.csv'"])
    assert refused.exit_code != 0 and "only SELECT queries are allowed" in refused.output
    capped = runner.invoke(cli, ["sql", "SELECT * FROM range(5)", "--max-rows", "2", "--format", "csv"])
    assert capped.stdout.splitlines() == ["range", "0", "1"] and "output cut at 2 rows" in capped.stderr
    missing = runner.invoke(cli, ["sql", "SELECT 1", "--data-dir", str(data_dir / "nope")])
    assert missing.exit_code != 0 and "does not exist" in missing.output


def test_a_part_file_that_vanishes_under_a_query_makes_it_run_again(tmp_path, monkeypatch):
    """What the compactor's garbage collection does to a query in flight: the file it listed is
    gone. run_query (the dashboard's and `batchgen sql`'s one path) runs it again."""
    from jobs.store import usersql

    path = tmp_path / "part.parquet"
    pauses = []

    def pause(seconds):  # the part reappears (as the compacted file would) while run_query waits
        pauses.append(seconds)
        duckdb.connect().execute(f"COPY (SELECT 42 AS x) TO '{path}' (FORMAT parquet)")

    monkeypatch.setattr(usersql.time, "sleep", pause)
    con = duckdb.connect()
    assert run_query(con, f"SELECT x FROM read_parquet('{path}')").rows == [(42,)]
    assert len(pauses) == 1
    with pytest.raises(UserSqlError, match="does not exist|No files found"):
        run_query(con, f"SELECT * FROM read_parquet('{tmp_path / 'never.parquet'}')", tries=2)
    with pytest.raises(UserSqlError):
        run_query(con, "SELEC 1")  # not a file error: no second try
    assert len(pauses) == 2
