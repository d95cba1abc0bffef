"""Shard attempt leases: one live attempt per shard, death detection, one re-queuer per dead attempt."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from jobs.shards.leases import ShardLeases, pid_running


def test_one_claim_at_a_time_and_attempts_count_up(tmp_path):
    leases = ShardLeases(tmp_path, ttl_s=30)
    first = leases.try_claim(0, "w1")
    assert first is not None and first.attempt == 1
    assert leases.try_claim(0, "w2") is None, "a live attempt holds the shard"
    assert leases.try_claim(1, "w2").attempt == 1, "other shards are independent"
    first.end("retrying", "boom", retry_at=time.time() + 5)
    second = leases.try_claim(0, "w2")
    assert second is not None and second.attempt == 2
    assert first.superseded() and not second.superseded()


def test_concurrent_claims_give_exactly_one_winner(tmp_path):
    leases = ShardLeases(tmp_path, ttl_s=30)
    with ThreadPoolExecutor(8) as pool:
        won = [r for r in pool.map(lambda i: leases.try_claim(3, f"w{i}"), range(16)) if r is not None]
    assert len(won) == 1 and won[0].attempt == 1


def test_dead_by_missing_process_or_stale_heartbeat(tmp_path):
    leases = ShardLeases(tmp_path, ttl_s=30)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    lease = leases.try_claim(0, "w1")
    lease.state.pid = child.pid  # pretend the child holds it
    lease.write()
    now = time.time()
    assert leases.latest(0).alive(now, 30) and not leases.latest(0).dead(now, 30)
    child.kill()
    child.wait()
    assert leases.latest(0).dead(time.time(), 30), "same host: a gone process is dead at once"
    other = ShardLeases(tmp_path / "b", ttl_s=0.2)
    lease = other.try_claim(0, "w1")
    lease.state.host = "another-host"  # pid cannot be checked: only the heartbeat counts
    lease.heartbeat()
    assert not other.latest(0).dead(time.time(), 0.2)
    time.sleep(0.3)
    assert other.latest(0).dead(time.time(), 0.2)
    assert other.try_claim(0, "w2").attempt == 2


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="zombies are told apart through /proc")
def test_a_holder_that_exited_but_was_not_reaped_is_dead(tmp_path):
    """A worker orphaned by `batchgen run` (SIGKILL) is reaped by init, seconds later or never: until
    then kill(pid, 0) succeeds on its zombie, which must not keep the shard's attempt alive."""
    leases = ShardLeases(tmp_path, ttl_s=30)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        lease = leases.try_claim(0, "w1")
        lease.state.pid = child.pid
        lease.write()
        deadline = time.monotonic() + 30
        while pid_running(child.pid) and time.monotonic() < deadline:  # exited, not reaped (no wait())
            time.sleep(0.01)
        os.kill(child.pid, 0)  # still there as a zombie ...
        assert not pid_running(child.pid)  # ... which is not running
        assert leases.latest(0).dead(time.time(), 30)
    finally:
        child.wait()
    assert not pid_running(child.pid) and pid_running(os.getpid())


def test_ended_attempts_are_not_dead_but_overdue_retries_are(tmp_path):
    leases = ShardLeases(tmp_path, ttl_s=1)
    lease = leases.try_claim(0, "w")
    lease.end("committed")
    assert not leases.latest(0).dead(time.time() + 100, 1)
    lease = leases.try_claim(1, "w")
    lease.end("retrying", "x", retry_at=time.time() + 2)
    assert not leases.latest(1).dead(time.time(), 1)
    assert leases.latest(1).dead(time.time() + 4, 1)


def test_mark_requeued_once(tmp_path):
    leases = ShardLeases(tmp_path, ttl_s=1)
    leases.try_claim(0, "w")
    assert leases.mark_requeued(0, 1) is True
    assert leases.mark_requeued(0, 1) is False
    assert leases.latest(0).requeued


def test_heartbeat_records_progress(tmp_path):
    leases = ShardLeases(tmp_path, ttl_s=30)
    lease = leases.try_claim(0, "w")
    lease.heartbeat(rows_done=3, output_tokens=40)
    state = leases.latest(0).state
    assert (state.rows_done, state.output_tokens, state.pid) == (3, 40, os.getpid())
