"""Re-queueing shards whose worker died, and giving up on a shard that keeps killing its workers."""

from __future__ import annotations

import subprocess
import sys
import time

from jobs.broker import resolve_broker
from jobs.manifest import JobPaths
from jobs.shards import broker_messages
from jobs.shards.leases import ShardLeases
from jobs.shards.state import ShardState
from jobs.shards.supervise import _republish_lost, every_shard_progress, job_progress, requeue_dead_shards
from jobs.store import Store, connect
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


def test_the_lost_message_pass_lists_the_lease_directory_once_not_once_a_shard(tmp_path, monkeypatch):
    """When each waiting shard's message was last re-published comes from one listing of the job's lease
    directory: a listing per waiting shard made the janitor's pass quadratic (41 s at 8,000 shards)."""
    data_dir, src = tmp_path / "data", tmp_path / "in.parquet"
    write_prompts(src, 6)
    settings = resolve_broker(data_dir, embedded=True)
    m = prepare_job(JobRequest(str(src), str(data_dir), {"model": MODEL}, {"max_tokens": 4}, 1), settings)
    leases = ShardLeases(JobPaths.of(m.data_dir, m.job_id).leases)
    leases.try_claim(0, "w1").end(ShardState.COMMITTED, rows_done=1)
    for shard_id, since in ((1, 5.0), (1, 7.0), (2, 3.0)):
        assert leases.mark_republished(shard_id, since)
    assert leases.republished() == {s: leases.last_republished(s) for s in (1, 2)}
    monkeypatch.setenv("BATCHGEN_REPUBLISH_AFTER_S", "0.001")
    time.sleep(0.01)
    held = []
    monkeypatch.setattr(broker_messages, "live_shard_messages",
                        lambda target, held_within_s: held.append(1) or {(m.job_id, s) for s in range(6)})
    per_shard = []
    monkeypatch.setattr(ShardLeases, "last_republished", lambda self, s: per_shard.append(s) or 0.0)
    assert _republish_lost(m, Store(data_dir), settings, leases, leases.claimed_attempts()) == []
    assert (held, per_shard) == ([1], [])  # the five waiting shards were stale; their messages are held
