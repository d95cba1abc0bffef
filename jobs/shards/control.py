"""`batchgen cancel` and `retry`: a user's hand on a job's shards (and `celery control revoke`'s).

Both only orchestrate: every transition they cause is written by the ledger (jobs.shards.ledger).
"""

from __future__ import annotations

import time

from jobs.broker import BrokerSettings
from jobs.manifest import JobManifest
from jobs.shards.ledger import ShardLedger
from jobs.shards.state import ShardState
from jobs.store import connect


def cancel_job(manifest: JobManifest, reason: str) -> bool:
    """Cancel a job: queued shards are skipped, running ones stop within a heartbeat, finished rows stay.

    The cancel marker is what workers act on; the store's cancel request is what the views show.
    False (and nothing written) when the job was cancelled already.
    """
    return ShardLedger(manifest.data_dir, manifest.job_id).cancel_job(reason)


def retry_failed_shards(manifest: JobManifest, broker: BrokerSettings) -> list[int]:
    """Publish again the shards that failed for good, with a fresh retry budget; their ids."""
    from jobs.shards.broker_messages import publish_shard

    ledger = ShardLedger(manifest.data_dir, manifest.job_id)
    if ledger.cancelled:
        raise ValueError(f"job {manifest.job_id} was cancelled; its shards are not retried")
    con = connect(manifest.data_dir)
    try:
        failed = [r[0] for r in con.execute(
            "SELECT shard_id FROM shards WHERE job_id = ? AND status = ? ORDER BY shard_id",
            [manifest.job_id, ShardState.FAILED.view_status]).fetchall()]
    finally:
        con.close()
    for shard_id in failed:
        ledger.queue(shard_id, "retry requested")
        publish_shard(broker, manifest.job_id, shard_id)
    return failed


def retry_stuck_shards(manifest: JobManifest, broker: BrokerSettings,
                       skip: set[int] = frozenset()) -> list[int]:
    """Publish again every shard waiting for a worker with no live attempt whose message the broker
    does not hold (on RabbitMQ, which cannot tell: every such shard); their ids. Nothing waits for
    $BATCHGEN_REPUBLISH_AFTER_S here: the user asked (`skip`: shards just re-queued). A duplicate
    message is harmless (one claim runs at a time, the first commit wins)."""
    from jobs.shards.broker_messages import live_shard_messages, publish_shard
    from jobs.shards.supervise import retries_used, waiting_since

    ledger = ShardLedger(manifest.data_dir, manifest.job_id)
    leases, store = ledger.leases, ledger.store
    claims = leases.claimed_attempts()
    live = live_shard_messages(broker, held_within_s=leases.ttl_s) or set()  # held longer: no one runs it
    stuck, republished = [], leases.republished()
    for info in manifest.shards:
        attempts = claims.get(info.shard_id, [])
        since = waiting_since(manifest, leases, info.shard_id, attempts, republished)
        if since is None or info.shard_id in skip or (manifest.job_id, info.shard_id) in live:
            continue
        if store.committed(manifest.job_id, info.shard_id) is not None:
            continue
        ledger.take_republish(info.shard_id, time.time())
        publish_shard(broker, manifest.job_id, info.shard_id,
                      retries=retries_used(leases, info.shard_id, attempts))
        stuck.append(info.shard_id)
    return stuck
