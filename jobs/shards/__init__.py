"""A shard's life, in one place: from its queued message to its commit (or its loss and re-run).

- `state`: `ShardState`, the one vocabulary of a shard's state: what the lease files hold, which
  store events the ledger writes on the way in, and the word the `shards` view shows.
- `leases`: attempts as files (claim with O_EXCL, heartbeat, end state), read without DuckDB.
- `ledger`: `ShardLedger`, the one write path of every transition (lease file and store event together).
- `supervise`: progress read from the leases, and the janitor that re-queues dead attempts and
  re-publishes shards whose message the broker lost.
- `broker_messages`: a shard's message: publishing it, its task id, and which ones a broker holds.
- `resume`: the same `batchgen run` command again finds its job and queues what is left of it.
- `control`: `batchgen cancel` and `retry`.

The table of states, who moves a shard between them and what the views call each is in
docs/ARCHITECTURE.md ("The shard state machine").
"""
