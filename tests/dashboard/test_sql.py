"""The SQL page: read-only, no files or extensions, locked settings, limits; refusals are 400s, never 500s."""

from __future__ import annotations

import csv
import html
import io

import duckdb
import pytest

from dashboard import create_app
from dashboard.sql import EXAMPLES, user_connection
from tests.dashboard.conftest import JOB_ID, as_json, sql

# (query, a fragment of the error the user sees)
REFUSED = [
    # writes
    ("INSERT INTO sweeps SELECT * FROM sweeps", "only SELECT"),
    ("CREATE TABLE stolen AS SELECT * FROM outputs", "only SELECT"),
    ("CREATE OR REPLACE VIEW jobs AS SELECT 1", "only SELECT"),
    ("DROP VIEW jobs", "only SELECT"),
    ("UPDATE jobs SET status = 'failed'", "only SELECT"),
    ("DELETE FROM outputs", "only SELECT"),
    ("BEGIN TRANSACTION", "only SELECT"),
    # COPY / EXPORT / ATTACH
    ("COPY (SELECT * FROM outputs) TO '/tmp/batchgen-stolen.csv'", "not COPY"),
    ("COPY outputs FROM '/etc/passwd'", "not COPY"),
    ("EXPORT DATABASE '/tmp/batchgen-export'", "not EXPORT"),
    ("ATTACH '/tmp/batchgen-other.duckdb' AS other", "not ATTACH"),
    ("DETACH other", "not DETACH"),
    # extensions
    ("INSTALL httpfs", "only SELECT"),
    ("LOAD httpfs", "only SELECT"),
    # reading files, also hidden in a subquery or a CTE
    ("SELECT * FROM read_csv('/etc/passwd')", "read_csv()"),
    ("SELECT * FROM read_csv_auto('/etc/passwd')", "read_csv_auto()"),
    ("SELECT * FROM read_text('/etc/hostname')", "read_text()"),
    ("SELECT content FROM read_blob('/etc/passwd')", "read_blob()"),
    ("SELECT * FROM glob('/etc/*')", "glob()"),
    ("SELECT * FROM read_parquet('/tmp/*.parquet')", "read_parquet()"),
    ("SELECT * FROM read_json('/etc/x.json')", "read_json()"),
    ("SELECT * FROM parquet_metadata('/tmp/x.parquet')", "parquet_metadata()"),
    ("SELECT * FROM sniff_csv('/etc/passwd')", "sniff_csv()"),
    ("SELECT * FROM '/etc/passwd'", "reading the file"),
    ("FROM 'outputs.csv'", "reading the file"),
    ("SELECT * FROM jobs WHERE job_id IN (SELECT content FROM read_text('/etc/hostname'))", "read_text()"),
    ("WITH t AS (SELECT * FROM read_csv('/etc/passwd')) SELECT * FROM t", "read_csv()"),
    ("SELECT * FROM query('SELECT 1')", "query()"),
    ("SELECT getenv('HOME')", "getenv()"),
    # settings (locked ones above all), pragmas, several statements
    ("SET enable_external_access = true", "not SET"),
    ("SET lock_configuration = false", "not SET"),
    ("SET memory_limit = '100GB'", "not SET"),
    ("SET autoinstall_known_extensions = true", "not SET"),
    ("RESET memory_limit", "not SET"),
    ("PRAGMA version", "not PRAGMA"),
    ("CALL pragma_version()", "not CALL"),
    ("SELECT 1; SELECT 2", "one statement"),
    ("SELECT 1; COPY (SELECT 1) TO '/tmp/batchgen-x.csv'", "one statement"),
    # plain failures
    ("SELEC 1", "syntax error"),
    ("SELECT * FROM no_such_view", "no_such_view"),
]


@pytest.mark.parametrize(("query", "why"), REFUSED)
def test_refused_query_is_a_400_with_a_reason(client, query, why):
    response = client.post("/api/sql", json={"sql": query})
    assert response.status_code == 400, response.data
    assert why.lower() in response.json["error"].lower()


def test_refused_query_as_csv_is_a_400(client):
    response = client.post("/api/sql.csv", data={"sql": "COPY outputs TO '/tmp/x.csv'"})
    assert response.status_code == 400 and b"not COPY" in response.data


@pytest.mark.parametrize("body", [{}, {"sql": ""}, {"sql": "   "}, {"sql": 42}, {"query": "SELECT 1"}])
def test_malformed_request_is_a_400(client, body):
    response = client.post("/api/sql", json=body)
    assert response.status_code == 400 and "sql" in response.json["error"]


def test_non_json_body_is_a_400(client):
    response = client.post("/api/sql", data=b"SELECT 1", content_type="text/plain")
    assert response.status_code == 400


def test_select_over_each_view(client, job_data_dir):
    for view in ("jobs", "shards", "outputs", "requests", "requests_live", "iterations", "sweeps"):
        body = as_json(client.post("/api/sql", json={"sql": f"SELECT count(*) AS n FROM {view}"}))
        assert body["columns"] == ["n"]
        assert body["rows"] == [[sql(job_data_dir, f"SELECT count(*) AS n FROM {view}")[0]["n"]]]


def test_result_values_are_json(client):
    body = as_json(client.post("/api/sql", json={"sql": f"""
        SELECT job_id, submitted_at, config, 1.5::DECIMAL(4, 2) AS d, 'nan'::DOUBLE AS nan_value,
               [1, 2] AS list_value, {{'a': 1}} AS struct_value
        FROM jobs WHERE job_id = '{JOB_ID}'"""}))
    row = dict(zip(body["columns"], body["rows"][0], strict=True))
    assert row["job_id"] == JOB_ID and row["submitted_at"].startswith("20")
    assert row["d"] == 1.5 and row["nan_value"] is None
    assert row["list_value"] == [1, 2] and row["struct_value"] == {"a": 1}


def test_row_cap(job_data_dir):
    client = create_app({"TESTING": True, "DATA_DIR": job_data_dir, "SQL_ROW_CAP": 5}).test_client()
    body = as_json(client.post("/api/sql", json={"sql": "SELECT * FROM range(100) t(x)"}))
    assert body["rows"] == [[i] for i in range(5)]
    assert body["truncated"] is True and body["row_cap"] == 5
    body = as_json(client.post("/api/sql", json={"sql": "SELECT * FROM range(5) t(x)"}))
    assert body["truncated"] is False


def test_time_limit_interrupts_the_query(job_data_dir):
    client = create_app({"TESTING": True, "DATA_DIR": job_data_dir, "SQL_TIMEOUT_S": 0.5}).test_client()
    slow = "SELECT sum(a * b) FROM range(100000) t1(a), range(100000) t2(b)"
    response = client.post("/api/sql", json={"sql": slow})
    assert response.status_code == 400
    assert "0.5 s limit" in response.json["error"]


def test_memory_limit(job_data_dir):
    client = create_app({"TESTING": True, "DATA_DIR": job_data_dir, "SQL_MEMORY_LIMIT": "32MB"}).test_client()
    big = "SELECT string_agg(x::VARCHAR, ',') FROM range(30000000) t(x)"
    response = client.post("/api/sql", json={"sql": big})
    assert response.status_code == 400
    assert "out of memory" in response.json["error"].lower()


def test_connection_itself_refuses_files_and_settings(app):
    """The second layer: even SQL that got past the statement check cannot read files or unlock settings."""
    with app.app_context():
        con = user_connection()
    try:
        with pytest.raises(duckdb.PermissionException):
            con.execute("SELECT * FROM read_text('/etc/hostname')")
        with pytest.raises(duckdb.Error, match="lock"):
            con.execute("SET enable_external_access = true")
        with pytest.raises(duckdb.Error):
            con.execute("INSTALL httpfs")
        with pytest.raises(duckdb.PermissionException):
            con.execute("COPY (SELECT 1) TO '/tmp/batchgen-dashboard-test.csv'")
        assert con.execute("SELECT current_setting('enable_external_access')").fetchone()[0] is False
        assert con.execute("SELECT current_setting('autoload_known_extensions')").fetchone()[0] is False
        assert con.execute("SELECT current_setting('autoinstall_known_extensions')").fetchone()[0] is False
    finally:
        con.close()


def test_csv_download_equals_json(client):
    query = (f"SELECT request_id, finish_reason, output_tokens, error FROM outputs WHERE job_id = '{JOB_ID}' "
             "ORDER BY request_id::INT")
    body = as_json(client.post("/api/sql", json={"sql": query}))
    response = client.post("/api/sql.csv", data={"sql": query})
    assert response.status_code == 200 and response.mimetype == "text/csv"
    assert "attachment" in response.headers["Content-Disposition"]
    rows = list(csv.reader(io.StringIO(response.get_data(as_text=True))))
    assert rows[0] == body["columns"]
    assert rows[1:] == [["" if v is None else str(v) for v in row] for row in body["rows"]]


def test_sql_on_missing_data_dir_is_a_400(empty_app):
    response = empty_app.test_client().post("/api/sql", json={"sql": "SELECT 1"})
    assert response.status_code == 400 and "does not exist" in response.json["error"]


def test_examples_on_the_page_run(client):
    page = client.get("/sql").get_data(as_text=True)
    for title, query in EXAMPLES:
        assert html.escape(title) in page
        response = client.post("/api/sql", json={"sql": query.replace("my-job", JOB_ID)})
        assert response.status_code == 200, (title, response.json)
