"""Fixtures of the dashboard tests (as in Flask's flaskr tutorial: `app` and `client`).

`job_data_dir` is built once per session by a real small job on the tiny random model. `app` and
`client` serve it; `empty_app` serves a data dir with nothing in it; `big_data_dir` holds a
synthetic job of 100k iterations (downsampling, the charts' speed) and a sweep.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dashboard import create_app
from jobs.store.catalog import connect
from jobs.store.usersql import run_user_query
from tests.dashboard import engine_fill, synthetic

JOB_ID = "job-engine"


@pytest.fixture(scope="session")
def job_data_dir(tmp_path_factory) -> Path:
    """A data dir holding one finished job: 16 prompts (one empty: an error row) in 2 shards."""
    data_dir = tmp_path_factory.mktemp("dashboard-data")
    engine_fill.fill(data_dir, job_id=JOB_ID, num_rows=16, num_shards=2)
    return data_dir


@pytest.fixture(scope="session")
def big_data_dir(tmp_path_factory) -> Path:
    """A data dir with a 100k-iteration job from two workers and one sweep (no model run)."""
    data_dir = tmp_path_factory.mktemp("dashboard-big")
    synthetic.fill(data_dir)
    return data_dir


@pytest.fixture
def app(job_data_dir):
    return create_app({"TESTING": True, "DATA_DIR": job_data_dir})


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def empty_app(tmp_path):
    return create_app({"TESTING": True, "DATA_DIR": tmp_path / "data"})


def sql(data_dir: Path, query: str) -> list[dict]:
    """Rows of `query` as `batchgen sql` answers it (the store's hardened read path)."""
    con = connect(data_dir, read_only_user_sql=True)
    try:
        result = run_user_query(con, query)
    finally:
        con.close()
    return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


def sql_one(data_dir: Path, query: str) -> dict:
    rows = sql(data_dir, query)
    assert len(rows) == 1, rows
    return rows[0]


def as_json(response) -> dict:
    assert response.status_code == 200, response.data[:500]
    return json.loads(response.data)
