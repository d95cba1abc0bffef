"""Issue 14 item 5: a corrupt or missing part is named where it is read; everything else answers.

A synthetic job of 40 rows in 4 committed shards (10 output rows per shard, one outputs part each).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dashboard import create_app
from jobs.store import catalog
from jobs.store.catalog import connect
from jobs.store.check import check_store, quarantine
from jobs.store.compact import compact_job
from jobs.store.layout import Layout
from tests.dashboard import synthetic

JOB = synthetic.JOB_ID
ROWS, SHARDS = 40, 4


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)  # a compacted file counts at once
    synthetic.fill(tmp_path, iterations=200, requests=ROWS, shards=SHARDS)
    return tmp_path


def outputs_parts(data_dir, where: str = "raw") -> list[Path]:
    return sorted((Layout.of(data_dir).kind_dir("outputs") / where / JOB).glob("*.parquet"))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def count_outputs(data_dir) -> int:
    con = connect(data_dir)
    try:
        return con.execute("SELECT count(*) FROM outputs").fetchone()[0]
    finally:
        con.close()


def batchgen(*args: str, data_dir) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs.cli", *args, "--data-dir", str(data_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_corrupt_raw_part_is_named_and_the_rest_answers(data_dir):
    bad = outputs_parts(data_dir)[1]
    lost = pq.read_metadata(bad).num_rows
    assert count_outputs(data_dir) == ROWS and lost == ROWS // SHARDS
    truncate(bad)

    con = connect(data_dir)
    try:
        assert con.execute("SELECT 1").fetchall() == [(1,)]
        assert con.execute("SELECT count(*) FROM jobs").fetchall() == [(1,)]
        assert con.execute("SELECT count(*) FROM shards WHERE status = 'completed'").fetchall() == [(SHARDS,)]
        with pytest.raises(Exception, match=str(bad).replace(".", r"\.") + ".*store check --repair"):
            con.execute("SELECT count(*) FROM outputs").fetchall()
    finally:
        con.close()

    assert batchgen("sql", "SELECT 1", data_dir=data_dir).returncode == 0
    done = batchgen("sql", "SELECT count(*) FROM outputs", data_dir=data_dir)
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert str(bad) in line and "store check --repair" in line
    status = batchgen("status", data_dir=data_dir)
    assert status.returncode == 0, status.stderr
    assert JOB in status.stdout and "completed" in status.stdout
    assert str(bad) in status.stderr  # the request counts are unknown ('?'), and it says why

    report = check_store(data_dir)
    [item] = report.bad
    assert (item.path, item.kind, item.fate) == (bad, "outputs", "lost")
    assert report.missing == []  # (rows are counted only once the outputs read)

    moved = quarantine(data_dir, report.bad)
    assert not bad.exists() and (moved / bad.relative_to(data_dir)).exists()
    assert moved.parent == Path(data_dir) / "quarantine"
    assert count_outputs(data_dir) == ROWS - lost
    [short] = check_store(data_dir).missing  # the commit says 10 rows, none are left: re-run the shard
    assert (short.committed, short.found) == (ROWS // SHARDS, 0)


def test_dashboard_pages_not_touching_the_file_still_answer(data_dir):
    bad = outputs_parts(data_dir)[0]
    truncate(bad)
    client = create_app({"TESTING": True, "DATA_DIR": data_dir}).test_client()
    for url in ("/workers", "/sweeps", "/sql", "/api/workers"):
        assert client.get(url).status_code == 200, url
    response = client.get(f"/api/jobs/{JOB}/outputs")
    assert response.status_code == 503 and str(bad) in response.json["error"]
    page = client.get(f"/jobs/{JOB}")
    assert page.status_code == 503 and str(bad).encode() in page.data
    assert client.post("/api/sql", json={"sql": "SELECT count(*) FROM iterations"}).json["rows"] == [[200]]


def test_a_corrupt_compacted_file_is_rederived_from_its_inputs(data_dir):
    assert compact_job(data_dir, JOB).groups > 0
    [compacted] = outputs_parts(data_dir, "compacted")
    truncate(compacted)
    [item] = check_store(data_dir).bad
    assert (item.path, item.fate) == (compacted, "re-derivable")
    assert "4 files it merged" in item.detail

    quarantine(data_dir, [item])
    assert count_outputs(data_dir) == ROWS  # the raw parts count again
    report = check_store(data_dir)
    assert report.healthy
    assert compact_job(data_dir, JOB).groups > 0  # merged again (the tombstone went with the file)
    assert count_outputs(data_dir) == ROWS


def test_a_corrupt_raw_part_already_compacted_is_rederivable(data_dir):
    compact_job(data_dir, JOB)
    bad = outputs_parts(data_dir)[2]
    truncate(bad)
    with pytest.raises(Exception, match="No magic bytes"):
        count_outputs(data_dir)
    [item] = check_store(data_dir).bad
    assert item.fate == "re-derivable" and item.detail.startswith("its rows are in c")
    quarantine(data_dir, [item])
    assert count_outputs(data_dir) == ROWS  # the compacted file holds its rows


def test_a_corrupt_schema_file_is_written_anew(data_dir):
    schema = Layout.of(data_dir).kind_dir("outputs") / "_schema.parquet"
    schema.write_bytes(b"not parquet")
    assert count_outputs(data_dir) == ROWS  # connecting rewrote it


def test_store_check_command(data_dir):
    assert batchgen("store", "check", data_dir=data_dir).returncode == 0
    bad = outputs_parts(data_dir)[3]
    truncate(bad)
    done = batchgen("store", "check", data_dir=data_dir)
    assert done.returncode == 1
    assert f"outputs/raw/{JOB}/{bad.name}: lost" in done.stdout
    done = batchgen("store", "check", "--quarantine", data_dir=data_dir)  # the old name of --repair
    assert done.returncode == 0 and "moved 1 files to" in done.stdout
    assert f"job {JOB} shard 3: marked for re-run (10 of 10 committed output rows missing)" in done.stdout
    assert not bad.exists()
    done = batchgen("store", "check", data_dir=data_dir)  # nothing damaged: the shard waits to run again
    assert done.returncode == 0 and "0 unreadable" in done.stdout, done.stdout
