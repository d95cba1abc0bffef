"""ShardState is the one vocabulary of a shard's state: for every transition the ledger makes, the
lease file holds the state, the store's last shard event is the state's `event`, the `shards` view
shows its `view_status`, and progress read from the leases (what `batchgen run` shows) agrees."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jobs.shards.leases import ENDED, LeaseState, ShardLeases
from jobs.shards.ledger import ShardLedger
from jobs.shards.state import VIEW_STATUSES, ShardState, from_view_status
from jobs.shards.supervise import _shard_progress
from jobs.store import JobRecord, Store
from tests.jobs.helpers import query, shards_of

JOB = "job-states"
ROWS = 2


@pytest.fixture
def ledger(tmp_path) -> ShardLedger:
    store = Store(tmp_path)
    store.record_job(JobRecord(JOB, "m", ROWS, 1, time.time()))
    ledger = ShardLedger(tmp_path, JOB, store, ShardLeases(tmp_path / "jobs" / JOB / "leases", ttl_s=30))
    ledger.paths.root.mkdir(parents=True, exist_ok=True)
    ledger.queue_new([(0, ROWS)])
    return ledger


def _vanish(claim) -> None:
    """Make an attempt look like its worker died long ago on another host."""
    claim.lease.state.heartbeat_ts, claim.lease.state.host = 0.0, "elsewhere"
    claim.lease.write()


def _commit(ledger: ShardLedger):
    claim = ledger.claim(0, "w1", num_requests=ROWS)
    claim.attempt.add_outputs([{"request_id": str(i), "output_text": "x", "finish_reason": "stop"}
                               for i in range(ROWS)])
    return ledger.commit(claim)


def _dead(ledger: ShardLedger):
    claim = ledger.claim(0, "w1", num_requests=ROWS)
    _vanish(claim)
    view = ledger.leases.latest(0)
    assert ledger.take_dead(view)
    return view


def _requeued(ledger: ShardLedger) -> None:
    ledger.fail(ledger.claim(0, "w1", num_requests=ROWS), "bad (gave up after 1 tries)")
    ledger.queue(0, "retry requested")


def _lost(ledger: ShardLedger) -> None:
    _commit(ledger)
    ledger.lose(0, "its outputs part was lost")


# each path ends with the shard in a state (the lease state of its latest attempt, where it has one)
PATHS = {
    "submitted": (lambda ledger: None, ShardState.QUEUED),
    "claimed": (lambda ledger: ledger.claim(0, "w1", num_requests=ROWS), ShardState.RUNNING),
    "committed": (_commit, ShardState.COMMITTED),
    "retried": (lambda ledger: ledger.retry(ledger.claim(0, "w1", num_requests=ROWS), "boom", 60.0),
                ShardState.RETRYING),
    "failed": (lambda ledger: ledger.fail(ledger.claim(0, "w1", num_requests=ROWS), "bad"),
               ShardState.FAILED),
    "handed back": (lambda ledger: ledger.hand_back(ledger.claim(0, "w1", num_requests=ROWS), "Ctrl-C"),
                    ShardState.HANDED_BACK),
    "dead, handed back": (lambda ledger: ledger.hand_back_dead(_dead(ledger), "stopped"),
                          ShardState.HANDED_BACK),
    "dead, given up": (lambda ledger: ledger.give_up_dead(_dead(ledger), "keeps dying"), ShardState.FAILED),
    "failed, queued again": (_requeued, ShardState.REQUEUED),
    "lost (store check --repair)": (_lost, ShardState.FAILED),
    "lost, queued again": (lambda ledger: (_lost(ledger), ledger.queue(0, "retry requested")),
                           ShardState.REQUEUED),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_the_lease_the_store_event_and_the_view_agree(ledger, path):
    drive, state = PATHS[path]
    drive(ledger)
    view = ledger.leases.latest(0)
    assert (view.state.state if view is not None else ShardState.QUEUED) is state
    assert _last_event(ledger) == (state.event or "running")  # a commit is a part, not an event
    assert shards_of(ledger.store.layout.root, JOB)[0]["status"] == state.view_status
    progress = _shard_progress(0, ROWS, view, time.time(), ledger.leases.ttl_s)
    assert progress.state is state.of_shard()
    assert progress.state.view_status == state.view_status


def test_a_superseded_attempt_leaves_the_view_to_the_newer_one(ledger):
    presumed_dead = ledger.claim(0, "w1", num_requests=ROWS)
    _vanish(presumed_dead)
    newer = ledger.claim(0, "w2", num_requests=ROWS)
    ledger.step_aside(presumed_dead)
    old = ledger.leases.view(0, presumed_dead.number)
    assert old.state.state is ShardState.SUPERSEDED and old.state.state.of_shard() is ShardState.QUEUED
    assert _last_event(ledger, attempt=presumed_dead.number) == ShardState.SUPERSEDED.event
    assert ledger.leases.latest(0).attempt == newer.number
    assert shards_of(ledger.store.layout.root, JOB)[0]["status"] == ShardState.RUNNING.view_status


def test_a_dead_attempt_reads_dead_and_the_view_still_says_running(ledger):
    _vanish(ledger.claim(0, "w1", num_requests=ROWS))
    view = ledger.leases.latest(0)
    assert view.state.state is ShardState.RUNNING and view.dead(time.time(), ledger.leases.ttl_s)
    progress = _shard_progress(0, ROWS, view, time.time(), ledger.leases.ttl_s)
    assert progress.state is ShardState.DEAD
    assert shards_of(ledger.store.layout.root, JOB)[0]["status"] == ShardState.DEAD.view_status == "running"


def test_a_cancelled_jobs_shard_is_cancelled_without_a_lease(ledger):
    assert ledger.cancel_job("user")
    ledger.skip_cancelled(0)
    assert ledger.leases.latest(0) is None
    assert _last_event(ledger) == ShardState.CANCELLED.event
    assert shards_of(ledger.store.layout.root, JOB)[0]["status"] == ShardState.CANCELLED.view_status


def test_lease_files_hold_only_lease_states(tmp_path):
    assert {s for s in ShardState if s.in_lease} == {ShardState.RUNNING, *ENDED}
    for state in ShardState:
        fields = ("w", "h", 1, 1, str(state), 0.0, 0.0)
        if state.in_lease:
            assert LeaseState(*fields).state is state
        else:
            with pytest.raises(ValueError, match="not a lease state"):
                LeaseState(*fields)
    with pytest.raises(ValueError):
        LeaseState("w", "h", 1, 1, "skipped", 0.0, 0.0)


def test_an_unknown_lease_state_in_a_file_reads_as_no_state(tmp_path):
    leases = ShardLeases(Path(tmp_path), ttl_s=30)
    lease = leases.try_claim(0, "w1")
    leases._state(0, lease.attempt).write_text('{"worker_id": "w", "host": "h", "pid": 1, "attempt": 1, '
                                               '"state": "exploded", "started_ts": 0, "heartbeat_ts": 0}')
    assert leases.view(0, lease.attempt).state is None


def test_view_statuses_map_back():
    assert [from_view_status(s).view_status for s in VIEW_STATUSES] == list(VIEW_STATUSES)
    assert {s.view_status for s in ShardState} == set(VIEW_STATUSES)
    with pytest.raises(ValueError, match="not a `shards` view status"):
        from_view_status("dead")


def _last_event(ledger: ShardLedger, attempt: int | None = None) -> str:
    """The shard's event that the `shards` view decides by (the latest by attempt, time, kind), or the
    latest of one attempt."""
    where, params = ("AND attempt = ?", [attempt]) if attempt is not None else ("", [])
    rows = query(ledger.store.layout.root, f"""
        SELECT event FROM _bg.scan_shard_events WHERE job_id = ? AND shard_id = 0 {where}
        ORDER BY attempt DESC, ts DESC, CASE event WHEN 'queued' THEN 0 WHEN 'running' THEN 1 ELSE 2 END DESC
        LIMIT 1""", [JOB, *params])
    return rows[0]["event"]
