"""Issue 35 item 1: a data dir is self-contained. Nothing in it names its absolute path (manifests, job
records, the catalog, tombstones, lease files, broker messages), so a copy (`cp -a D D2`) reads and
writes only itself: garbage collection in the copy deletes nothing of the original, export from the
copy reads the copy while the original is damaged, and with the original gone the same `batchgen run`
command resumes the half-finished job in the copy, which export and SQL then read whole."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jobs.manifest import load_manifest
from jobs.store import catalog, collect_garbage, compact_job
from tests.faults.datadirs import batchgen, run_args, run_job, write_input
from tests.jobs.helpers import query, shards_of, worker_runtime

pytestmark = pytest.mark.slow

ROWS = 8  # 4 shards of 2 rows


@pytest.fixture
def runtime(tmp_path):
    with worker_runtime(tmp_path / "worker-data", "w-copy", max_num_seqs=8) as rt:
        yield rt


def files_naming(root: Path, text: str) -> list[str]:
    """Files under root (worker logs aside: a log is history, not data) whose bytes hold `text`."""
    needle = text.encode()
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.suffix != ".log" and needle in p.read_bytes())


def test_a_copied_data_dir_reads_and_writes_only_itself(runtime, tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)
    original, copy = tmp_path / "D", tmp_path / "D2"
    done_src = write_input(tmp_path / "done.parquet", ROWS)
    half_src = write_input(tmp_path / "half.parquet", ROWS)
    done = run_job(runtime, done_src, original)
    half = run_job(runtime, half_src, original, shards=[0, 1])
    assert compact_job(original, done.job_id).groups > 0  # tombstones name the merged raw parts
    subprocess.run(["cp", "-a", str(original), str(copy)], check=True)

    assert files_naming(copy, str(original.resolve())) == []
    assert load_manifest(copy, done.job_id).data_dir == str(copy.resolve())

    # garbage collection in the copy deletes the copy's merged parts, never the original's
    originals = sorted((original / "store" / "tables" / "outputs" / "raw" / done.job_id).glob("*.parquet"))
    assert collect_garbage(copy, grace_s=0.0) > 0
    assert all(p.exists() for p in originals)
    assert not any((copy / p.relative_to(original)).exists() for p in originals)

    # export from the copy reads the copy: the original's outputs are damaged meanwhile
    for part in (original / "store" / "tables" / "outputs").rglob("*.parquet"):
        part.write_bytes(b"")
    out = tmp_path / "done.parquet.out.parquet"
    exported = batchgen("export", done.job_id, "--data-dir", str(copy), "--output", str(out))
    assert exported.returncode == 0, exported.stderr
    assert pq.read_table(out).column("request_id").to_pylist() == [f"r{i}" for i in range(ROWS)]

    # the original gone, the same run command resumes the half-finished job in the copy
    shutil.rmtree(original)
    half_out = tmp_path / "half.out.parquet"
    again = batchgen(*run_args(half_src, copy, "--output", str(half_out)))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming job {half.job_id}: 2 of 4 shard(s) already committed, 2 to run" in again.stderr
    assert pq.read_table(half_out).column("request_id").to_pylist() == [f"r{i}" for i in range(ROWS)]
    assert not original.exists(), "nothing was written at the original's path"
    assert [s["status"] for s in shards_of(copy, half.job_id).values()] == ["completed"] * 4
    every_row = sorted(f"r{i}" for i in range(ROWS))
    for job in (done, half):
        found = query(copy, "SELECT request_id FROM outputs WHERE job_id = ?", [job.job_id])
        assert sorted(r["request_id"] for r in found) == every_row
    count = batchgen("sql", "SELECT count(*) AS n FROM outputs", "--format", "csv", "--data-dir", str(copy))
    assert count.returncode == 0 and count.stdout.split() == ["n", str(2 * ROWS)], count.stdout + count.stderr
    assert files_naming(copy, str(original.resolve())) == []
