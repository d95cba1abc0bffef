"""The shard ledger: every transition writes the lease file and the store's shard event together, and
nothing else in jobs writes either (checked by parsing the source)."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from jobs.shards.leases import ShardLeases
from jobs.shards.ledger import ShardLedger
from jobs.store import JobRecord, Store
from tests.jobs.helpers import query, shards_of

JOB = "job-ledger"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ledger(tmp_path) -> ShardLedger:
    store = Store(tmp_path)
    store.record_job(JobRecord(JOB, "m", 6, 3, time.time()))
    ledger = ShardLedger(tmp_path, JOB, store, ShardLeases(tmp_path / "jobs" / JOB / "leases", ttl_s=30))
    ledger.paths.root.mkdir(parents=True, exist_ok=True)
    ledger.queue_new([(0, 2), (1, 2), (2, 2)])
    return ledger


def _lease_state(ledger: ShardLedger, shard_id: int) -> tuple[int, str]:
    view = ledger.leases.latest(shard_id)
    return view.attempt, view.state.state


def _shard(ledger: ShardLedger, shard_id: int) -> tuple[str, int]:
    s = shards_of(ledger.store.layout.root, JOB)[shard_id]
    return s["status"], s["attempts"]


def test_a_shard_lives_through_claim_retry_commit(ledger):
    assert _shard(ledger, 0) == ("queued", 0)
    claim = ledger.claim(0, "w1", num_requests=2)
    assert claim.number == 1 and _lease_state(ledger, 0) == (1, "running")
    assert ledger.claim(0, "w2", num_requests=2) is None, "a live attempt holds the shard"
    assert _shard(ledger, 0) == ("running", 1)
    ledger.retry(claim, "boom", delay_s=0.0)
    assert _lease_state(ledger, 0) == (1, "retrying") and _shard(ledger, 0) == ("queued", 1)
    again = ledger.claim(0, "w2", num_requests=2)
    assert again.number == 2
    again.attempt.add_outputs([{"request_id": "a", "output_text": "x", "finish_reason": "stop"}])
    record = ledger.commit(again)
    assert record.num_outputs == 1 and _lease_state(ledger, 0) == (2, "committed")
    assert _shard(ledger, 0) == ("completed", 2)


def test_fail_hand_back_and_step_aside(ledger):
    failed = ledger.claim(1, "w1", num_requests=2)
    ledger.fail(failed, "bad (gave up after 1 tries)")
    assert _lease_state(ledger, 1) == (1, "failed") and _shard(ledger, 1)[0] == "failed"
    ledger.queue(1, "retry requested")  # a user's retry: queued again for attempt 2
    assert _shard(ledger, 1)[0] == "queued"
    held = ledger.claim(2, "w1", num_requests=2)
    ledger.hand_back(held, "handed back: the worker was interrupted")
    assert _lease_state(ledger, 2) == (1, "handed_back") and _shard(ledger, 2)[0] == "queued"
    presumed_dead = ledger.claim(2, "w2", num_requests=2)
    _vanish(presumed_dead)
    newer = ledger.claim(2, "w3", num_requests=2)
    assert (presumed_dead.number, newer.number) == (2, 3) and presumed_dead.superseded()
    ledger.step_aside(presumed_dead)  # it came back: it must not commit
    assert ledger.leases.view(2, 2).state.state == "superseded" and _lease_state(ledger, 2) == (3, "running")


def _vanish(claim) -> None:
    """Make an attempt look like its worker died long ago on another host."""
    claim.lease.state.heartbeat_ts, claim.lease.state.host = 0.0, "elsewhere"
    claim.lease.write()


def test_dead_attempts_are_taken_once(ledger):
    _vanish(ledger.claim(0, "w-dead", num_requests=2))
    view = ledger.leases.latest(0)
    assert view.dead(time.time(), ledger.leases.ttl_s)
    assert ledger.take_dead(view) and not ledger.take_dead(view), "one checker wins"
    ledger.give_up_dead(view, "worker died; gave up")
    assert _lease_state(ledger, 0) == (1, "failed") and _shard(ledger, 0)[0] == "failed"
    _vanish(ledger.claim(1, "w-dead", num_requests=2))
    view = ledger.leases.latest(1)
    assert ledger.take_dead(view)
    ledger.hand_back_dead(view, "handed back: its worker was stopped at an interrupt")
    assert _lease_state(ledger, 1) == (1, "handed_back") and _shard(ledger, 1)[0] == "queued"


def test_cancel_is_written_once_for_workers_and_views(ledger):
    assert ledger.cancel_job("user") and not ledger.cancel_job("again")
    assert ledger.cancelled and ledger.paths.cancel_marker.read_text() == "user\n"
    ledger.skip_cancelled(2)
    rows = query(ledger.store.layout.root, "SELECT status FROM jobs WHERE job_id = ?", [JOB])
    assert rows == [{"status": "cancelled"}] and _shard(ledger, 2)[0] == "cancelled"


# the write primitives of the lease files and the store's shard lifecycle
WRITES = {"record_shard_events", "record_queued_shards", "request_cancel", "begin_attempt", "try_claim",
          "mark_requeued", "mark_republished"}
OWNERS = {"jobs/shards/ledger.py", "jobs/shards/leases.py"}


def test_only_the_ledger_writes_the_shard_lifecycle():
    offenders = []
    for path in sorted((ROOT / "jobs").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in WRITES:
                offenders.append(f"{rel}:{node.lineno} {node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "end" \
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "lease":
                offenders.append(f"{rel}:{node.lineno} lease.end")
    assert offenders == []
