"""`ShardState`: the one vocabulary of where a shard stands.

A shard's state is kept in two places that the ledger (jobs.shards.ledger) writes together: the
lease file of its latest attempt (jobs.shards.leases; read by workers, `batchgen run` and the
janitor without opening DuckDB) and the store's shard events, from which the `shards` view derives
its status word. Each member says all three: the value is what a lease file holds, `events` the
store event the ledger writes last on the way in, `view_status` the word the `shards` view shows.

    state        lease file   last store event   `shards.status`
    queued       (none)       queued             queued      never claimed, or waiting again
    running      running      running            running
    dead         running      running            running     read, never written: a stale heartbeat
    committed    committed    (a commit part)    completed
    retrying     retrying     queued             queued      `failed` first, then the retry's `queued`
    failed       failed       failed             failed
    handed_back  handed_back  queued             queued      no retry used
    superseded   superseded   failed             queued      the newer attempt's events decide the view
    requeued     requeued     queued             queued      failed for good, then queued again
    cancelled    (none)       cancelled          cancelled   the job's cancel marker decides

Members are strings (StrEnum), so a lease file stays plain JSON and `state == "running"` still holds.
"""

from __future__ import annotations

from enum import StrEnum


class ShardState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DEAD = "dead"
    COMMITTED = "committed"
    RETRYING = "retrying"
    FAILED = "failed"
    HANDED_BACK = "handed_back"
    SUPERSEDED = "superseded"
    REQUEUED = "requeued"
    CANCELLED = "cancelled"

    @property
    def in_lease(self) -> bool:
        """A state a lease file holds (queued, dead and cancelled are read from elsewhere)."""
        return self in _LEASE_STATES

    @property
    def ended(self) -> bool:
        """An attempt's end state: what `Lease.end` may write."""
        return self in _LEASE_STATES and self is not ShardState.RUNNING

    @property
    def owes_message(self) -> bool:
        """An attempt that ended so that its shard waits for a new message (handed back, presumed
        dead and superseded, or failed for good and queued again)."""
        return self in (ShardState.HANDED_BACK, ShardState.SUPERSEDED, ShardState.REQUEUED)

    @property
    def final(self) -> bool:
        """The shard is done with: committed, or failed with no retry left."""
        return self in (ShardState.COMMITTED, ShardState.FAILED)

    @property
    def event(self) -> str | None:
        """The last shard event the ledger writes as the shard enters this state (what the `shards`
        view reads it from); None for committed, which a commit part says."""
        return _EVENT[self]

    @property
    def view_status(self) -> str:
        """The `shards` view's status word for a shard in this state."""
        return _VIEW_STATUS[self]

    def of_shard(self) -> ShardState:
        """The shard's state when its latest attempt is in this one: an attempt that ended owing a
        message leaves the shard queued until the next attempt is claimed."""
        return ShardState.QUEUED if self.owes_message else self


_LEASE_STATES = frozenset({ShardState.RUNNING, ShardState.COMMITTED, ShardState.RETRYING, ShardState.FAILED,
                           ShardState.HANDED_BACK, ShardState.SUPERSEDED, ShardState.REQUEUED})
_EVENT = {
    ShardState.QUEUED: "queued", ShardState.RUNNING: "running", ShardState.DEAD: "running",
    ShardState.COMMITTED: None, ShardState.RETRYING: "queued", ShardState.FAILED: "failed",
    ShardState.HANDED_BACK: "queued", ShardState.SUPERSEDED: "failed", ShardState.REQUEUED: "queued",
    ShardState.CANCELLED: "cancelled",
}
_VIEW_STATUS = {
    ShardState.QUEUED: "queued", ShardState.RUNNING: "running", ShardState.DEAD: "running",
    ShardState.COMMITTED: "completed", ShardState.RETRYING: "queued", ShardState.FAILED: "failed",
    ShardState.HANDED_BACK: "queued", ShardState.SUPERSEDED: "queued", ShardState.REQUEUED: "queued",
    ShardState.CANCELLED: "cancelled",
}

# the `shards` view's status words, in the order `batchgen status` counts them
VIEW_STATUSES = ("completed", "running", "queued", "failed", "cancelled")
# the `jobs` view's status words of a job that has ended
JOB_ENDED_STATUSES = ("completed", "failed", "cancelled")


def from_view_status(status: str) -> ShardState:
    """The state a `shards` view status word stands for (the view cannot tell a retrying, handed
    back or dead shard from a queued or running one: it gives the plain state)."""
    try:
        return _FROM_VIEW[status]
    except KeyError:
        raise ValueError(f"{status!r} is not a `shards` view status ({', '.join(VIEW_STATUSES)})") from None


_FROM_VIEW = {"completed": ShardState.COMMITTED, "running": ShardState.RUNNING, "queued": ShardState.QUEUED,
              "failed": ShardState.FAILED, "cancelled": ShardState.CANCELLED}
