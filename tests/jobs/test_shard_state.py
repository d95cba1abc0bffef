"""ShardState is the one vocabulary of a shard's state: for every transition the ledger makes, the
lease file holds the state, the store's last shard event is the state's `event`, the `shards` view
shows its `view_status`, and progress read from the leases (what `batchgen run` shows) agrees."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jobs.manifest import JobManifest, JobPaths, RegularShards
from jobs.shards.leases import ENDED, LeaseState, ShardLeases
from jobs.shards.ledger import ShardLedger
from jobs.shards.state import VIEW_STATUSES, ShardState, from_view_status
from jobs.shards.supervise import (
    SUMMARY_NAME,
    JobProgress,
    ProgressSummary,
    _shard_progress,
    every_shard_progress,
    job_progress,
)
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


# ---------------------------------------------------------------- progress polls (issue 38)


def _manifest(data_dir: Path, num_shards: int) -> JobManifest:
    rows = num_shards * ROWS - 1  # the last shard is shorter
    paths = JobPaths.of(data_dir, JOB)
    return JobManifest(JOB, str(data_dir), [], rows, ROWS, RegularShards(paths, rows, ROWS), {"model": "m"},
                       {}, "q", "embedded", 2, 1.0, [], time.time())


def _agrees(m: JobManifest, store: Store | None = None) -> JobProgress:
    """A poll says what reading every shard's lease files says: each state's count, rows, tokens, the
    committed rows, finished, and each shard it lists."""
    progress, shards = job_progress(m, store), every_shard_progress(m, store)
    counted = {s: sum(x.state is s for x in shards) for s in ShardState}
    assert {s: progress.count(s) for s in ShardState} == counted
    assert progress.num_shards == len(shards)
    assert progress.rows_done == sum(x.rows_done for x in shards)
    assert progress.output_tokens == sum(x.output_tokens for x in shards)
    assert progress.committed_rows == sum(x.num_requests for x in shards if x.state is ShardState.COMMITTED)
    running = (ShardState.RUNNING, ShardState.RETRYING)
    finished = (all(x.state not in running for x in shards) if progress.cancelled
                else all(x.state.final for x in shards))
    assert progress.finished is finished
    listed = {x.shard_id for x in progress.active}
    assert progress.active == [x for x in shards if x.shard_id in listed]
    unlisted = {x.state for x in shards if x.shard_id not in listed}
    assert unlisted <= {ShardState.QUEUED, ShardState.CANCELLED, ShardState.COMMITTED, ShardState.FAILED}
    return progress


@pytest.mark.parametrize("path", list(PATHS))
def test_a_poll_agrees_with_every_lease_file_on_each_path(ledger, path):
    m = _manifest(ledger.store.layout.root, 1)
    _agrees(m, ledger.store)  # a summary of the job as submitted, which the path's changes must update
    PATHS[path][0](ledger)
    _agrees(m, ledger.store)
    _agrees(m, ledger.store)  # from the summary the last poll wrote
    (ledger.leases.changes / SUMMARY_NAME).unlink(missing_ok=True)
    _agrees(m, ledger.store)  # built again from the lease files


def test_a_poll_agrees_through_a_shard_committed_lost_retried_and_committed_again(ledger):
    m = _manifest(ledger.store.layout.root, 1)
    for step in (_commit, lambda lg: lg.lose(0, "part lost"), lambda lg: lg.queue(0, "retry requested")):
        step(ledger)
        _agrees(m, ledger.store)
    claim = ledger.claim(0, "w2", num_requests=ROWS)
    assert _agrees(m, ledger.store).count(ShardState.RUNNING) == 1
    claim.attempt.add_outputs([{"request_id": str(i), "output_text": "x", "finish_reason": "stop"}
                               for i in range(ROWS)])
    ledger.commit(claim)
    ledger.cancel_job("user")
    assert _agrees(m, ledger.store).count(ShardState.COMMITTED) == 1


def test_a_poll_reads_only_the_shards_not_yet_final(tmp_path, monkeypatch):
    """A 300-shard job with 200 committed, 2 failed and 3 running: once a poll has seen the finished
    ones, the next reads the files of the 3 running shards only (no directory scan, no file of a
    finished or never-claimed shard), and a commit is read once, then counted."""
    m = _manifest(tmp_path, 300)
    leases = ShardLeases(JobPaths.of(tmp_path, JOB).leases, ttl_s=30)
    for shard_id in range(200):
        leases.try_claim(shard_id, "w1").end(ShardState.COMMITTED, rows_done=ROWS, output_tokens=5)
    for shard_id in (200, 201):
        leases.try_claim(shard_id, "w1").end(ShardState.FAILED, "bad", rows_done=1, output_tokens=3)
    running = {s: leases.try_claim(s, "w1") for s in (202, 203, 204)}
    _agrees(m)  # the first poll reads every claimed shard once

    read, scans = [], []
    view, claimed = ShardLeases.view, ShardLeases.claimed_attempts
    monkeypatch.setattr(ShardLeases, "view", lambda self, s, a: (read.append(s), view(self, s, a))[1])
    monkeypatch.setattr(ShardLeases, "claimed_attempts", lambda self: (scans.append(1), claimed(self))[1])
    progress = job_progress(m)
    assert (sorted(read), scans) == ([202, 203, 204], [])
    assert (progress.count("committed"), progress.count("failed"), progress.count("running")) == (200, 2, 3)

    monkeypatch.setattr(ShardLeases, "claimed_attempts", claimed)
    running[202].end(ShardState.COMMITTED, rows_done=ROWS, output_tokens=5)
    new = leases.try_claim(205, "w1")
    monkeypatch.setattr(ShardLeases, "claimed_attempts", lambda self: (scans.append(1), claimed(self))[1])
    read.clear()
    progress = job_progress(m)
    assert (sorted(read), scans) == ([202, 203, 204, 205], [])
    assert (progress.count("committed"), progress.count("running"), progress.count("queued")) == (201, 3, 94)
    read.clear()
    job_progress(m)
    assert sorted(read) == [203, 204, 205]
    new.heartbeat(rows_done=1, output_tokens=2)
    monkeypatch.undo()
    _agrees(m)


def test_a_claim_noted_but_never_made_leaves_the_shard_queued(tmp_path):
    """A writer that died between noting a claim and creating its file made no attempt: the shard reads
    queued, its next real claim reads running, and its commit is read from its file on every poll (a
    writer died busy on it: never counted from memory)."""
    m = _manifest(tmp_path, 3)
    leases = ShardLeases(JobPaths.of(tmp_path, JOB).leases, ttl_s=30)
    leases.try_claim(0, "w1").end(ShardState.COMMITTED, rows_done=ROWS)
    leases.note(1, 1, ShardState.RUNNING)  # and died
    assert _agrees(m).count("queued") == 2
    lease = leases.try_claim(1, "w1")
    assert _agrees(m).count("running") == 1
    lease.end(ShardState.COMMITTED, rows_done=ROWS, output_tokens=4)
    for _ in range(2):
        progress = _agrees(m)
        assert progress.count("committed") == 2 and [s.shard_id for s in progress.active] == [1]


def test_a_final_shard_being_changed_is_read_until_its_writer_is_done(tmp_path):
    """A committed shard whose commit is being revoked (`ShardLedger.lose`: noted, then its file
    rewritten failed, then noted done) reads as its file says at each step, and is counted from memory
    again only once the writer is done; a writer that dies between leaves it read on every poll."""
    m = _manifest(tmp_path, 2)
    leases = ShardLeases(JobPaths.of(tmp_path, JOB).leases, ttl_s=30)
    lease = leases.try_claim(0, "w1")
    lease.end(ShardState.COMMITTED, rows_done=ROWS, output_tokens=9)
    assert _agrees(m).count("committed") == 1
    assert _agrees(m).active == []
    leases.note(0, 1, ShardState.FAILED)
    assert _agrees(m).count("committed") == 1  # the file still says committed
    lease.state.state = ShardState.FAILED
    lease.write()
    assert _agrees(m).count("failed") == 1
    assert [s.shard_id for s in _agrees(m).active] == [0]  # no done noted: read again
    leases.note(0, 1, None)
    assert _agrees(m).count("failed") == 1
    progress = _agrees(m)
    assert (progress.count("failed"), progress.active, progress.output_tokens) == (1, [], 9)


def test_an_end_read_before_its_note_is_counted_once(tmp_path, monkeypatch):
    """A poll can read a commit's file before it reads the commit's note (the note is written first, but
    the poll read the logs earlier): the note then changes nothing and builds nothing again."""
    m = _manifest(tmp_path, 2)
    leases = ShardLeases(JobPaths.of(tmp_path, JOB).leases, ttl_s=30)
    lease = leases.try_claim(0, "w1")
    _agrees(m)
    note = leases.note
    monkeypatch.setattr(ShardLeases, "note", lambda self, s, a, st: None)
    lease.end(ShardState.COMMITTED, rows_done=ROWS, output_tokens=7)
    assert _agrees(m).count("committed") == 1
    note(0, 1, ShardState.COMMITTED)  # the note the poll did not see yet
    built = []
    monkeypatch.setattr(ProgressSummary, "build", classmethod(lambda cls, *a: built.append(1)))
    progress = job_progress(m)
    assert (progress.count("committed"), progress.output_tokens, built) == (1, 7, [])


@pytest.mark.parametrize("damage", ["a cut line", "a foreign line", "a shrunk log", "a broken summary"])
def test_a_damaged_log_or_summary_is_read_again_from_the_lease_files(tmp_path, damage):
    m = _manifest(tmp_path, 4)
    leases = ShardLeases(JobPaths.of(tmp_path, JOB).leases, ttl_s=30)
    leases.try_claim(0, "w1").end(ShardState.COMMITTED, rows_done=ROWS)
    leases.try_claim(1, "w1")
    _agrees(m)
    [log] = leases.changes.glob("*.log")
    if damage == "a cut line":
        with open(log, "ab") as f:
            f.write(b"2 1 comm")  # a write cut short; the same process appends after it later
        leases.try_claim(2, "w1").end(ShardState.FAILED, "bad")
    elif damage == "a foreign line":
        with open(log, "ab") as f:
            f.write(b"hello\n")
    elif damage == "a shrunk log":
        log.write_bytes(b"")
    else:
        (leases.changes / SUMMARY_NAME).write_text('{"version": 1, "num_shards": 4, "offsets": {}}')
    leases.try_claim(3, "w1").end(ShardState.COMMITTED, rows_done=ROWS)
    _agrees(m)
    _agrees(m)
