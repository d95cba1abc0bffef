"""Issue 35 item 4: two identical `batchgen run` commands started together share one job.

Job identity is an atomic claim (jobs.shards.resume.RunClaim), not a look-then-create: both processes start
at once, and writing the job's shards is slowed by 2 s in each so that, without the claim, both would
look, find no job, and create one each. With it, one creates the job and the other waits for it, then
resumes it (nothing left to run) and writes the same output.
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
