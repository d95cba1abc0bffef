"""`batchgen run` killed outright (SIGKILL) leaves no worker behind (issue 14, item 6): its workers,
in sessions of their own, notice the run is gone, hand their shards back and exit; the same command
then resumes the job and writes --output with every row once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.manifest import JobPaths, list_job_ids, load_manifest
from jobs.shards.leases import ShardLeases, pid_running
from jobs.shards.supervise import job_progress
from tests.jobs.helpers import LEASE_TTL_S, MODEL, wait_for

pytestmark = pytest.mark.slow

NUM_ROWS, SHARD_SIZE = 8, 2


def _env() -> dict:
    env = dict(os.environ, BATCHGEN_LEASE_TTL_S=LEASE_TTL_S, OMP_NUM_THREADS="1")
    env.pop("BATCHGEN_BROKER_URL", None)
    return env


def _latest_attempts(m) -> dict[int, object]:
    leases = ShardLeases(JobPaths.of(m.data_dir, m.job_id).leases)
    return {s: leases.view(s, a[-1]).state for s, a in leases.claimed_attempts().items()}


def test_sigkill_of_run_stops_its_workers_and_the_same_command_finishes_the_job(tmp_path):
    data, src, out = tmp_path / "data", tmp_path / "in.parquet", tmp_path / "out.parquet"
    rows = range(NUM_ROWS)  # 1500 tokens a row past EOS: a shard runs for seconds
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in rows], "id": [f"r{i}" for i in rows],
                             "max_tokens": [1500] * NUM_ROWS, "ignore_eos": [True] * NUM_ROWS}), src)
    args = [sys.executable, "-m", "jobs.cli", "run", str(src), "--model", MODEL, "--data-dir", str(data),
            "--shard-size", str(SHARD_SIZE), "--temperature", "0", "--apply-chat-template", "never",
            "--max-num-seqs", "2", "--concurrency", "1", "--no-progress", "--output", str(out)]
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    try:
        m = load_manifest(data, wait_for(lambda: list_job_ids(data), 120, "the job")[0])
        wait_for(lambda: job_progress(m).count("running") >= 1, 240, "a shard running")
        pid = wait_for(lambda: {st.pid for st in _latest_attempts(m).values() if st is not None}, 60,
                       "the worker's lease").pop()
        run.send_signal(signal.SIGKILL)
        run.wait(30)
    finally:
        run.kill()
        run.communicate()
    # the worker hands its shard back and exits within seconds (not after its lease went stale)
    wait_for(lambda: not pid_running(pid), 30, f"worker {pid} to exit after its run was killed")
    ended = {s: st.state for s, st in _latest_attempts(m).items()}
    assert "running" not in ended.values() and "handed_back" in ended.values(), ended
    assert not out.exists()
    log = (JobPaths.of(m.data_dir, m.job_id).root / "logs" / "worker-0.log").read_text()
    assert "that started this worker" in log and "is gone; handing the shards in flight back" in log

    again = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming job {m.job_id}" in again.stderr
    table = pq.read_table(out).to_pylist()
    assert [r["request_id"] for r in table] == [f"r{i}" for i in rows]  # every row once
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 1500 for r in table)
    assert list_job_ids(data) == [m.job_id]
