"""Issue 35 item 4: two identical `batchgen run` commands started together share one job.

Job identity is an atomic claim (jobs.shards.resume.RunClaim), not a look-then-create: both processes start
at once, and writing the job's shards is slowed by 2 s in each so that, without the claim, both would
look, find no job, and create one each. With it, one creates the job and the other waits for it, then
resumes it (nothing left to run) and writes the same output. A run killed after it wrote its job's
manifest but before it published the job leaves a job the same command publishes whole.
"""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from jobs.manifest import list_job_ids
from tests.faults.datadirs import cli_env, run_args, write_input
from tests.jobs.helpers import query

pytestmark = pytest.mark.slow

ROWS = 6

# `batchgen ARGS` through the real entry point, with the job's shard writing slowed down
SLOW_RUN = """
import sys, time
import jobs.submit
real = jobs.submit._write_shards
def slow(*args, **kwargs):
    time.sleep(2.0)
    return real(*args, **kwargs)
jobs.submit._write_shards = slow
sys.argv = ["batchgen", *sys.argv[1:]]
from jobs.cli import main
main()
"""


def test_two_identical_runs_started_together_share_one_job(tmp_path):
    data, src = tmp_path / "data", write_input(tmp_path / "in.parquet", ROWS)
    outs = [tmp_path / "out0.parquet", tmp_path / "out1.parquet"]
    procs = [subprocess.Popen([sys.executable, "-c", SLOW_RUN, *run_args(src, data, "--output", str(out))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
             for out in outs]
    results = [(p, *p.communicate(timeout=600)) for p in procs]
    for proc, stdout, stderr in results:
        assert proc.returncode == 0, stdout + stderr
    [job_id] = list_job_ids(data)
    waited = [stderr for _, _, stderr in results if "the same `batchgen run` command is running" in stderr]
    assert len(waited) == 1, [stderr for _, _, stderr in results]
    assert f"resuming job {job_id}: 3 of 3 shard(s) already committed, 0 to run" in waited[0]
    for out in outs:
        assert pq.read_table(out).column("request_id").to_pylist() == [f"r{i}" for i in range(ROWS)]
    rows = query(data, "SELECT request_id, count(*) AS n FROM outputs GROUP BY request_id")
    assert sorted((r["request_id"], r["n"]) for r in rows) == [(f"r{i}", 1) for i in range(ROWS)]
    assert not any((data / "jobs" / ".claims").iterdir()), "both claims were released"


# `batchgen ARGS` that dies (as if killed) after writing the job's manifest, before publishing the job
DIES_BEFORE_PUBLISHING = """
import os, sys
import jobs.submit
jobs.submit.publish_job = lambda *args, **kwargs: os._exit(9)
sys.argv = ["batchgen", *sys.argv[1:]]
from jobs.cli import main
main()
"""


def test_a_run_killed_before_it_published_its_job_is_published_whole_by_the_same_command(tmp_path):
    data, src, out = tmp_path / "data", write_input(tmp_path / "in.parquet", ROWS), tmp_path / "out.parquet"
    killed = subprocess.run([sys.executable, "-c", DIES_BEFORE_PUBLISHING, *run_args(src, data)],
                            capture_output=True, text=True, env=cli_env(), timeout=600)
    assert killed.returncode == 9, killed.stdout + killed.stderr
    [job_id] = list_job_ids(data)
    assert query(data, "SELECT * FROM jobs WHERE job_id = ?", [job_id]) == [], "never recorded"
    again = subprocess.run([sys.executable, "-m", "jobs.cli", *run_args(src, data, "--output", str(out))],
                           capture_output=True, text=True, env=cli_env(), timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming job {job_id}: 0 of 3 shard(s) already committed, 3 to run" in again.stderr
    assert list_job_ids(data) == [job_id]
    assert pq.read_table(out).column("request_id").to_pylist() == [f"r{i}" for i in range(ROWS)]
