"""Re-queueing shards whose worker died, and giving up on a shard that keeps killing its workers."""

from __future__ import annotations

import subprocess
import sys

from jobs.broker import resolve_broker
from jobs.manifest import JobPaths
from jobs.shards import broker_messages
from jobs.shards.leases import ShardLeases
from jobs.shards.supervise import every_shard_progress, job_progress, requeue_dead_shards
from jobs.store import connect
from jobs.submit import JobRequest, prepare_job
from tests.jobs.helpers import MODEL, write_prompts


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_shard_whose_workers_keep_dying_fails_after_max_retries(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    src = tmp_path / "in.parquet"
    write_prompts(src, 2)
    settings = resolve_broker(data_dir, embedded=True)
    request = JobRequest(str(src), str(data_dir), {"model": MODEL}, {"max_tokens": 4}, 2, max_retries=2)
    m = prepare_job(request, settings)
    published = []
    monkeypatch.setattr(broker_messages, "publish_shard",
                        lambda *args, retries=0, **kw: published.append((args[1], args[2], retries)))
    leases = ShardLeases(JobPaths.of(m.data_dir, m.job_id).leases)

    def die_running_it():  # a worker claims the shard and is killed (OOM) before it ends the attempt
        lease = leases.try_claim(0, "w-oom@host")
        assert lease is not None
        lease.state.pid = _dead_pid()
        lease.write()

    for expected_retries in (1, 2):
        die_running_it()
        assert requeue_dead_shards(data_dir, settings) == [(m.job_id, 0)]
        assert published[-1] == (m.job_id, 0, expected_retries)  # deaths use the retry budget
        assert requeue_dead_shards(data_dir, settings) == []  # once per dead attempt
    die_running_it()
    assert requeue_dead_shards(data_dir, settings) == []  # the third death: given up, not re-queued
    assert len(published) == 2

    shards = every_shard_progress(m)
    assert job_progress(m).finished and [s.state for s in shards] == ["failed"]
    assert "gave up after 3 re-queues and retries (max_retries 2)" in shards[0].note
    [(status, error)] = connect(data_dir).execute(
        "SELECT status, error FROM shards WHERE job_id = ?", [m.job_id]).fetchall()
    assert status == "failed" and "worker died running attempt 3 (w-oom@host)" in error
    assert connect(data_dir).execute("SELECT status FROM jobs WHERE job_id = ?", [m.job_id]).fetchone() == (
        "failed",)
