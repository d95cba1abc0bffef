"""Issue 35 item 2: a lost or damaged output part has one way back to a complete job.

`batchgen store check` names the damage; `store check --repair` moves unreadable files aside and
marks the shards whose rows are gone for re-run; meanwhile `status` shows the job incomplete (the
shard failed, saying what was lost); `batchgen retry` takes the marked shard (as a worker on the
broker would), or the same `batchgen run` command runs it; the job then has every row once.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jobs.manifest import load_manifest
from jobs.shard_runner import ShardTask, process_shard
from jobs.shards.supervise import every_shard_progress, job_progress
from jobs.store import Layout, catalog
from tests.faults.datadirs import batchgen, run_args, run_job, write_input
from tests.jobs.helpers import job_status, query, shards_of, worker_runtime

pytestmark = pytest.mark.slow

ROWS, LOST_SHARD = 8, 1  # 4 shards of 2 rows


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    with worker_runtime(tmp_path_factory.mktemp("lost") / "worker-data", "w-lost", max_num_seqs=8) as rt:
        yield rt


@pytest.fixture(autouse=True)
def compacted_files_count_at_once(monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)


def outputs_part(data_dir: Path, job_id: str, shard_id: int) -> Path:
    [part] = (Layout.of(data_dir).raw_dir("outputs", job_id)).glob(f"{job_id}~s{shard_id:06d}~*.parquet")
    return part


def damage(part: Path, how: str) -> None:
    if how == "truncated":
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    elif how == "zero-length":
        part.write_bytes(b"")
    else:
        part.unlink()


def every_row_once(data_dir: Path, job_id: str) -> list[str]:
    rows = query(data_dir, "SELECT request_id FROM outputs WHERE job_id = ?", [job_id])
    return sorted(r["request_id"] for r in rows)


@pytest.mark.parametrize("how", ["truncated", "zero-length", "deleted"])
def test_store_check_marks_the_shard_and_retry_takes_it(runtime, tmp_path, how):
    data = tmp_path / "data"
    m = run_job(runtime, write_input(tmp_path / "in.parquet", ROWS), data)
    part = outputs_part(data, m.job_id, LOST_SHARD)
    damage(part, how)

    found = batchgen("store", "check", "--data-dir", str(data))
    assert found.returncode == 1, found.stdout + found.stderr
    if how == "deleted":
        assert f"job {m.job_id} shard {LOST_SHARD}: 2 of 2 committed output rows missing" in found.stdout
    else:
        assert f"{part.relative_to(data)}: lost" in found.stdout
    assert "store check --repair" in found.stdout

    repaired = batchgen("store", "check", "--repair", "--data-dir", str(data))
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert f"job {m.job_id} shard {LOST_SHARD}: marked for re-run" in repaired.stdout
    assert f"batchgen retry {m.job_id}" in repaired.stdout

    # meanwhile: the job is incomplete, and says why
    assert job_status(data, m.job_id) == "failed"
    shard = shards_of(data, m.job_id)[LOST_SHARD]
    assert shard["status"] == "failed" and "committed output rows missing" in shard["error"]
    status = batchgen("status", m.job_id, "--data-dir", str(data), "--no-requeue")
    assert status.returncode == 0 and f"job {m.job_id}: failed" in status.stdout, status.stdout
    assert "a part file was lost or damaged" in status.stdout
    assert [s.state for s in every_shard_progress(m)].count("failed") == 1 == job_progress(m).count("failed")

    retried = batchgen("retry", m.job_id, "--data-dir", str(data))
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert f"re-queued failed shard(s) {LOST_SHARD}" in retried.stdout
    assert every_shard_progress(m)[LOST_SHARD].state == "queued"
    # a worker takes the message retry published
    outcome = process_shard(ShardTask(m.job_id, LOST_SHARD, m.data_dir), runtime)
    assert outcome.result == "committed", outcome
    assert job_status(data, m.job_id) == "completed"
    assert every_row_once(data, m.job_id) == sorted(f"r{i}" for i in range(ROWS))
    assert batchgen("store", "check", "--data-dir", str(data)).returncode == 0


def test_the_same_run_command_finishes_a_job_that_lost_a_part(runtime, tmp_path):
    data, src, out = tmp_path / "data", write_input(tmp_path / "in.parquet", ROWS), tmp_path / "out.parquet"
    m = run_job(runtime, src, data)
    damage(outputs_part(data, m.job_id, LOST_SHARD), "truncated")
    assert batchgen("store", "check", "--repair", "--data-dir", str(data)).returncode == 0

    again = batchgen(*run_args(src, data, "--output", str(out)))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming job {m.job_id}: 3 of 4 shard(s) already committed, 1 to run" in again.stderr
    assert pq.read_table(out).column("request_id").to_pylist() == [f"r{i}" for i in range(ROWS)]
    assert job_status(data, m.job_id) == "completed"


def test_a_lost_commit_record_is_found_and_its_shard_re_run(runtime, tmp_path):
    """The commit part itself gone: the lease says committed, the store does not. Check finds it."""
    data = tmp_path / "data"
    m = run_job(runtime, write_input(tmp_path / "in.parquet", ROWS), data)
    [commit] = Layout.of(data).raw_dir("commits", m.job_id).glob(f"{m.job_id}~s{LOST_SHARD:06d}~*.parquet")
    commit.unlink()
    found = batchgen("store", "check", "--data-dir", str(data))
    assert found.returncode == 1 and f"shard {LOST_SHARD}: its commit record is gone" in found.stdout
    assert batchgen("store", "check", "--repair", "--data-dir", str(data)).returncode == 0
    assert batchgen("retry", m.job_id, "--data-dir", str(data)).returncode == 0
    assert process_shard(ShardTask(m.job_id, LOST_SHARD, m.data_dir), runtime).result == "committed"
    assert every_row_once(data, m.job_id) == sorted(f"r{i}" for i in range(ROWS))


def test_a_damaged_manifest_and_a_lost_job_record_are_rebuilt_from_each_other(runtime, tmp_path):
    data = tmp_path / "data"
    m = run_job(runtime, write_input(tmp_path / "in.parquet", ROWS), data)
    manifest = data / "jobs" / m.job_id / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    found = batchgen("store", "check", "--data-dir", str(data))
    assert found.returncode == 1 and f"job {m.job_id}: {manifest} is unreadable" in found.stdout
    repaired = batchgen("store", "check", "--repair", "--data-dir", str(data))
    assert f"job {m.job_id}: {manifest} rebuilt from the store's record of the job" in repaired.stdout
    assert load_manifest(data, m.job_id) == m
    assert list((data / "quarantine").rglob("manifest.json")), "the damaged one is kept aside"

    [record] = Layout.of(data).raw_dir("job_records", m.job_id).glob("*.parquet")
    record.unlink()
    found = batchgen("store", "check", "--data-dir", str(data))
    assert found.returncode == 1 and "the store has no record of the job" in found.stdout
    repaired = batchgen("store", "check", "--repair", "--data-dir", str(data))
    assert f"job {m.job_id}: its record written again from its manifest" in repaired.stdout
    assert job_status(data, m.job_id) == "completed"
    assert batchgen("store", "check", "--data-dir", str(data)).returncode == 0
