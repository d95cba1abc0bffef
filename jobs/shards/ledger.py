"""The shard ledger: the one write path of a shard's lifecycle.

A shard's life is written in two places that must agree: the job's lease files (jobs.shards.leases: who
runs which attempt now, is it alive; read by workers, `batchgen run` and the janitor) and the
store's shard events (jobs.store: what the `shards` and `jobs` views show). Every transition goes
through one method here, which writes both, always in the same order:

    queue      submitted, retried, re-queued after a dead worker, resumed       -> event `queued`
    republish  a queued shard whose message the broker lost (once per wait)
    claim      a delivery takes the next attempt (O_EXCL claim, then `running`)
    heartbeat  the claimant's lease, with progress (`Claim.heartbeat`)
    commit     the attempt's rows count (first commit wins), the lease ends `committed`
    retry      the attempt failed, another is queued after a backoff             -> `failed`, `queued`
               (a shard failed for good and queued again: its attempt ends `requeued`)
    fail       the attempt failed and no retry is left                           -> `failed`
    hand_back  the worker was interrupted: no retry used, the shard is queued again
    step_aside a newer attempt exists (this one was presumed dead): no commit
    cancel     the job (marker for workers + request for the views), or a shard skipped for it
    lose       a committed shard's rows were lost (a part gone or damaged; `store check --repair`):
               its commit is revoked, the lease ends `failed`                    -> `failed`
    restore    a committed shard whose lease files are gone gets them back from its commit

Orchestration (when to retry, which shard is dead, who publishes a message) stays with the callers
(jobs.shard_runner, jobs.shards.supervise, jobs.shards.control, jobs.shards.resume, jobs.submit); none of them
writes a lease state or a shard event by itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa

from jobs.manifest import JobPaths
from jobs.shards.leases import AttemptView, Lease, LeaseState, ShardLeases
from jobs.shards.state import ShardState
from jobs.store import CommitRecord, ShardAttempt, ShardEvent, Store


@dataclass
class Claim:
    """One attempt of one shard held by this process: its lease and its open store attempt."""

    lease: Lease
    attempt: ShardAttempt

    @property
    def number(self) -> int:
        return self.lease.attempt

    def heartbeat(self, rows_done: int | None = None, output_tokens: int | None = None) -> None:
        self.lease.heartbeat(rows_done, output_tokens)

    def superseded(self) -> bool:
        return self.lease.superseded()


class ShardLedger:
    """The lifecycle of one job's shards (see the module docstring)."""

    def __init__(self, data_dir: str | Path, job_id: str, store: Store | None = None,
                 leases: ShardLeases | None = None) -> None:
        self.job_id = job_id
        self.paths = JobPaths.of(data_dir, job_id)
        self.store = store or Store(data_dir)
        self.leases = leases or ShardLeases(self.paths.leases)

    # -- reading
    @property
    def cancelled(self) -> bool:
        return self.paths.cancel_marker.exists()

    # -- queue
    def queue_new(self, shards: Iterable[tuple[int, int]], per_part: int = 65_536) -> None:
        """A new job's shards, as (shard id, rows): queued for their first attempt, `per_part` events a
        store part. The events are built as columns a part at a time, so what this holds is bounded by
        a part, whatever the job's shard count (`shards` may be a generator: jobs.manifest.shard_sizes)."""
        now, shards = time.time(), iter(shards)
        while True:
            ids, rows = np.empty(per_part, np.int64), np.empty(per_part, np.int64)
            taken = 0
            for shard_id, num_requests in islice(shards, per_part):
                ids[taken], rows[taken] = shard_id, num_requests
                taken += 1
            if taken:
                self.store.record_queued_shards(self.job_id, pa.array(ids[:taken]), pa.array(rows[:taken]),
                                                now)  # ShardState.QUEUED's event
            if taken < per_part:
                return

    def queue(self, shard_id: int, reason: str, *, mark_latest: bool = False) -> None:
        """Queue a shard's next attempt (a retry, a resume, a dead attempt re-queued). `mark_latest`
        marks its latest attempt re-queued first, so the janitor does not queue it a second time. A
        latest attempt that failed for good ends `requeued`: progress shows the shard waiting."""
        attempts = self.leases.claimed_attempts().get(shard_id, [])
        latest = self.leases.view(shard_id, attempts[-1]) if attempts else None
        if latest is not None and latest.state is not None and latest.state.state is ShardState.FAILED:
            Lease(self.leases, shard_id, latest.state).end(ShardState.REQUEUED, reason)
        elif mark_latest and latest is not None:
            self.leases.mark_requeued(shard_id, latest.attempt)
        self._queued_after(shard_id, attempts[-1] if attempts else 0, reason)

    def take_dead(self, view: AttemptView) -> bool:
        """True for exactly one caller per dead attempt: the one that re-queues it or gives up on it."""
        return self.leases.mark_requeued(view.shard_id, view.attempt)

    def take_republish(self, shard_id: int, since: float) -> bool:
        """True for exactly one caller per (shard, waiting since): that caller publishes the shard's
        message again (its first message was lost; the shard stays queued, no event)."""
        return self.leases.mark_republished(shard_id, since)

    # -- claim
    def claim(self, shard_id: int, worker_id: str, *, num_requests: int,
              flush_interval_s: float = 10.0) -> Claim | None:
        """The next attempt of a shard for this worker (`running`), or None while a live one runs."""
        lease = self.leases.try_claim(shard_id, worker_id)
        if lease is None:
            return None
        attempt = self.store.begin_attempt(self.job_id, shard_id, lease.attempt, worker_id,
                                           num_requests=num_requests, flush_interval_s=flush_interval_s)
        return Claim(lease, attempt)

    # -- ends of an attempt held here
    def commit(self, claim: Claim) -> CommitRecord:
        record = claim.attempt.commit()
        claim.lease.end(ShardState.COMMITTED, rows_done=record.num_outputs,
                        output_tokens=record.output_tokens)
        return record

    def step_aside(self, claim: Claim) -> None:
        claim.attempt.fail("superseded: a newer attempt was started while this one was presumed dead")
        claim.lease.end(ShardState.SUPERSEDED)

    def retry(self, claim: Claim, reason: str, delay_s: float) -> None:
        self._close(claim, reason)
        claim.lease.end(ShardState.RETRYING, reason, retry_at=time.time() + delay_s)
        self._queued_after(claim.lease.shard_id, claim.number, f"retry after: {reason}")

    def fail(self, claim: Claim, reason: str) -> None:
        self._close(claim, reason)
        claim.lease.end(ShardState.FAILED, reason)

    def hand_back(self, claim: Claim, reason: str) -> None:
        self._close(claim, reason, cancel=True)
        claim.lease.end(ShardState.HANDED_BACK, reason)
        self._queued_after(claim.lease.shard_id, claim.number, reason)

    # -- ends of an attempt whose worker is gone, written on its behalf
    def give_up_dead(self, view: AttemptView, note: str) -> None:
        """A dead attempt's (taken with `take_dead`) shard fails for good: its workers keep dying."""
        worker = self._end_for(view, ShardState.FAILED, note)
        self._events([self._event(view.shard_id, ShardState.FAILED, attempt=view.attempt, worker_id=worker,
                                  error=note)])

    def hand_back_dead(self, view: AttemptView, note: str) -> None:
        """A dead attempt (taken with `take_dead`) ends handed back; its shard is queued, no retry used."""
        self._end_for(view, ShardState.HANDED_BACK, note)
        self._queued_after(view.shard_id, view.attempt, note)

    # -- cancel
    def cancel_job(self, reason: str) -> bool:
        """Cancel the job: the marker is what workers act on, the store's request what the views show.
        False (and nothing written) when it was cancelled already."""
        if self.cancelled:
            return False
        self.paths.cancel_marker.write_text(reason + "\n")
        self.store.request_cancel(self.job_id, reason)
        return True

    def skip_cancelled(self, shard_id: int) -> None:
        """A delivery of a cancelled job's shard: the shard ends cancelled without an attempt."""
        self._events([self._event(shard_id, ShardState.CANCELLED,
                                  error="job cancelled before this shard ran")])

    # -- damage
    def lose(self, shard_id: int, reason: str) -> None:
        """A committed shard whose rows were lost: its commit no longer counts (the views and
        `Store.committed` say not committed), its latest attempt ends failed, and the shard shows failed
        with `reason` until `batchgen retry` or the same `batchgen run` queues it again."""
        record = self.store.committed(self.job_id, shard_id)
        if record is not None:
            self.store.revoke_commit(record, reason)
        latest = self.leases.latest(shard_id)
        attempt = record.attempt if record is not None else 0
        if latest is not None:
            self._end_for(latest, ShardState.FAILED, reason)
            attempt = max(attempt, latest.attempt)
        self._events([self._event(shard_id, ShardState.FAILED, attempt=attempt, worker_id="", error=reason)])

    def restore(self, shard_id: int, record: CommitRecord) -> bool:
        """Lease files of a committed shard that are gone (deleted, or lost with a copy) written again
        from its commit, so progress read from leases sees it committed; False when they were there."""
        latest = self.leases.latest(shard_id)
        if latest is not None and latest.state is not None:
            return False
        attempt = latest.attempt if latest is not None else record.attempt
        view = AttemptView(shard_id, attempt, record.committed_ts, None, False)
        self.leases.directory.mkdir(parents=True, exist_ok=True)
        with self.leases.noting(shard_id, attempt, ShardState.RUNNING):
            self.leases.claim_file(shard_id, attempt).touch()
            self._end_for(view, ShardState.COMMITTED, "lease files restored from the store's commit",
                          worker=record.worker_id)
        return True

    # -- internals
    def _events(self, events: list[ShardEvent]) -> None:
        if events:
            self.store.record_shard_events(events)

    def _queued_after(self, shard_id: int, attempt: int, reason: str) -> None:
        self._events([self._event(shard_id, ShardState.QUEUED, attempt=attempt + 1, error=reason)])

    def _event(self, shard_id: int, state: ShardState, ts: float | None = None, **fields) -> ShardEvent:
        """The store event that moves a shard into `state` (its `ShardState.event`)."""
        return ShardEvent(self.job_id, shard_id, state.event, time.time() if ts is None else ts, **fields)

    @staticmethod
    def _close(claim: Claim, reason: str, cancel: bool = False) -> None:
        if claim.attempt.closed:
            return
        if cancel:
            claim.attempt.cancel(reason)
        else:
            claim.attempt.fail(reason)

    def _end_for(self, view: AttemptView, state: ShardState, note: str, worker: str = "unknown") -> str:
        worker = view.state.worker_id if view.state is not None else worker
        lease = view.state or LeaseState(worker, "", 0, view.attempt, ShardState.RUNNING, view.claimed_ts,
                                         view.claimed_ts)
        Lease(self.leases, view.shard_id, lease).end(state, note)
        return worker
