"""Issue 35: no user-facing command prints a traceback for a bad file in the data dir.

Each kind of damage (a truncated part, a zero-length part, an unreadable manifest, a missing lease
file) is done to a copy of one data dir holding a finished job made by `batchgen run`; then every
command a user runs (status, status JOB, sql, export, retry, run, store check) and every dashboard
page and JSON API answer. None prints a traceback; a command that fails because of the damage says
so in one line that names the file and what to do.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dashboard import create_app
from jobs.store import Layout
from tests.faults.datadirs import batchgen, run_args, run_job, write_input
from tests.jobs.helpers import worker_runtime

pytestmark = pytest.mark.slow

ROWS, SHARD = 6, 1  # 3 shards of 2 rows; the damage is done to shard 1's files
WHAT_TO_DO = ("store check --repair", "restore it from a copy")
DAMAGE = ("truncated part", "zero-length part", "unreadable manifest", "missing lease file")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """(a data dir with one finished job, its input file, the job)."""
    base = tmp_path_factory.mktemp("matrix")
    src = write_input(base / "in.parquet", ROWS)
    with worker_runtime(base / "worker-data", "w-matrix", max_num_seqs=8) as runtime:
        job = run_job(runtime, src, base / "data")
    return base / "data", src, job


def damage(data_dir: Path, job_id: str, kind: str) -> Path:
    """Do the damage; the file it was done to."""
    if kind == "unreadable manifest":
        path = data_dir / "jobs" / job_id / "manifest.json"
        path.write_text('{"job_id": "' + job_id + '", "shards": [')
        return path
    if kind == "missing lease file":
        leases = sorted((data_dir / "jobs" / job_id / "leases").glob(f"shard-{SHARD:06d}.*"))
        for path in leases:
            path.unlink()
        return leases[-1]
    [path] = Layout.of(data_dir).raw_dir("outputs", job_id).glob(f"{job_id}~s{SHARD:06d}~*.parquet")
    path.write_bytes(path.read_bytes()[:100] if kind == "truncated part" else b"")
    return path


def commands(job_id: str, src: Path, data_dir: Path, out: Path) -> dict[str, list[str]]:
    at = ["--data-dir", str(data_dir)]
    return {
        "status": ["status", *at],
        "status JOB": ["status", job_id, *at],
        "sql": ["sql", "SELECT count(*) FROM outputs", *at],
        "export": ["export", job_id, "--output", str(out / "export.parquet"), *at],
        "retry": ["retry", job_id, *at],
        "run": run_args(src, data_dir, "--output", str(out / "run.parquet")),
        "store check": ["store", "check", *at],
    }


# what each command answers to each kind of damage: 0 (it still works) or 1 (one line: file, what to do)
EXPECTED = {
    "truncated part": {"status": 0, "status JOB": 0, "sql": 1, "export": 1, "retry": 0, "run": 1,
                       "store check": 1},
    "unreadable manifest": {"status": 0, "status JOB": 1, "sql": 0, "export": 1, "retry": 1, "run": 1,
                            "store check": 1},
    "missing lease file": {"status": 0, "status JOB": 0, "sql": 0, "export": 0, "retry": 0, "run": 0,
                           "store check": 0},
}
EXPECTED["zero-length part"] = EXPECTED["truncated part"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_every_command_answers_damage_in_one_clear_line(template, tmp_path, kind):
    original, src, job = template
    data_dir = tmp_path / "data"
    shutil.copytree(original, data_dir, symlinks=True)  # a data dir is self-contained: a copy is one
    bad = damage(data_dir, job.job_id, kind)
    answers = {}
    for name, args in commands(job.job_id, src, data_dir, tmp_path).items():
        done = batchgen(*args, timeout=300)
        said = done.stdout + done.stderr
        assert "Traceback" not in said, f"{name}: {said}"
        answers[name] = done.returncode
        if done.returncode == 0:
            continue
        clear = [line for line in said.splitlines()
                 if bad.name in line and any(hint in line for hint in WHAT_TO_DO)]
        assert clear, f"{name} exit {done.returncode} names neither {bad.name} nor what to do:\n{said}"
    assert answers == EXPECTED[kind]


@pytest.mark.parametrize("kind", DAMAGE)
def test_the_dashboard_answers_damage_without_a_traceback(template, tmp_path, kind):
    original, _, job = template
    data_dir = tmp_path / "data"
    shutil.copytree(original, data_dir, symlinks=True)
    bad = damage(data_dir, job.job_id, kind)
    client = create_app({"TESTING": True, "DATA_DIR": data_dir}).test_client()
    job_pages = [f"/jobs/{job.job_id}", f"/api/jobs/{job.job_id}", f"/api/jobs/{job.job_id}/iterations",
                 f"/api/jobs/{job.job_id}/throughput", f"/api/jobs/{job.job_id}/latency",
                 f"/api/jobs/{job.job_id}/outputs", f"/jobs/{job.job_id}/outputs.parquet"]
    touched = kind.endswith("part")
    for url in ["/", "/workers", "/sweeps", "/sql", "/api/jobs", "/api/workers", "/api/sweeps", *job_pages]:
        response = client.get(url)
        body = response.get_data()
        response.close()
        assert b"Traceback" not in body, url
        assert response.status_code in (200, 503), (url, response.status_code)
        if response.status_code == 503:
            assert touched and bad.name.encode() in body, (url, body[:500])
            assert b"store check --repair" in body, (url, body[:500])
    response = client.post("/api/sql", json={"sql": "SELECT count(*) FROM outputs"})
    if touched:
        assert response.status_code == 400 and bad.name in response.json["error"]
    else:
        assert response.json["rows"] == [[ROWS]]
