"""Fixtures of the dashboard tests (as in Flask's flaskr tutorial: `app` and `client`).

`job_data_dir` is filled once per session by a real small job: `batchgen run` on 16 prompts with
the tiny random model. `app` and `client` serve it; `empty_app` serves a data dir with nothing in
it; `big_data_dir` holds a synthetic job of 100k iterations (downsampling, the charts' speed) and a
sweep. `sql()` answers a query the way `batchgen sql --format json` does, by running that command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dashboard import create_app
from jobs.store.cli import sql as sql_command
from tests.dashboard import synthetic

JOB_ID = "job-small"
NUM_ROWS = 16
# engine limits small enough that requests wait, KV blocks run out and requests are preempted
RUN_FLAGS = ["--model", "tiny-random", "--shard-size", "8", "--max-num-seqs", "6", "--max-num-batched-tokens",
             "64", "--block-size", "4", "--num-kv-blocks", "40", "--temperature", "0", "--ignore-eos",
             "--no-progress"]


def prompt_rows() -> list[dict]:
    """16 input rows with an id, a prompt, max_tokens and an extra column; row 3 is empty (an error row)."""
    def prompt(i: int) -> str:
        return "" if i == 3 else f"Question {i}: tell me about batching " * (1 + i % 3)

    return [{"id": str(i), "prompt": prompt(i), "max_tokens": 6 + (i * 5) % 14, "topic": f"t{i % 3}"}
            for i in range(NUM_ROWS)]


@pytest.fixture(scope="session")
def job_data_dir(tmp_path_factory) -> Path:
    """A data dir holding one finished job run by `batchgen run` (2 shards of 8 rows, one error row)."""
    root = tmp_path_factory.mktemp("dashboard-job")
    prompts = root / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(prompt_rows()), prompts)
    data_dir = root / "data"
    cmd = [sys.executable, "-m", "jobs.cli", "run", str(prompts), "--data-dir", str(data_dir),
           "--job-id", JOB_ID, *RUN_FLAGS]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"batchgen run failed:\n{done.stdout}\n{done.stderr}"
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
    """Rows of `query` as `batchgen sql --format json` prints them (timestamps as ISO strings)."""
    result = CliRunner().invoke(sql_command, [query, "--data-dir", str(data_dir), "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def sql_one(data_dir: Path, query: str) -> dict:
    rows = sql(data_dir, query)
    assert len(rows) == 1, rows
    return rows[0]


def as_json(response) -> dict:
    assert response.status_code == 200, response.data[:500]
    return json.loads(response.data)
