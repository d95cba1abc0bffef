"""`celery control revoke <task id>` of a shard task cancels its job, as `batchgen cancel JOB` does.

Why the whole job: a job is what a user submitted and reads back (one output file, one status);
a job missing one shard could never complete, and the OpenAI Batch API and `batchgen cancel` both
cancel whole batches. So a revoke is taken as "stop this job": queued shards are skipped, running
ones stop within a heartbeat, finished rows stay, and the job ends `cancelled` with the reason
naming the revoked task.

How: Celery keeps the revoked ids in each worker's memory (`celery.worker.state.revoked`, shared
with workers that start later through mingle) and only checks them when a message arrives. Every
housekeeping tick the worker looks for ids it has not seen yet; a shard task's id names its job
(`jobs.shards.broker_messages.shard_task_id`), so the job is cancelled at once, wherever its messages are.
Ids of other tasks, of jobs this worker's data dir does not hold, and of shards already committed
(revoking a finished task changes nothing in Celery either) are ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from jobs.manifest import load_manifest
from jobs.shards.broker_messages import parse_shard_task_id
from jobs.shards.control import cancel_job
from jobs.store import Store, StoreError

log = logging.getLogger(__name__)


class RevokeWatcher:
    """Cancels the job of every newly revoked shard task id (call `check` periodically)."""

    def __init__(self, data_dir: str, revoked: Callable[[], Iterable[str]]) -> None:
        self.data_dir = data_dir
        self._revoked = revoked  # a snapshot of the revoked task ids
        self._seen: set[str] = set()

    def check(self) -> list[str]:
        """Cancel the jobs of task ids revoked since the last call; the job ids cancelled now."""
        try:
            now = set(self._revoked())
        except RuntimeError:  # the set changed while it was copied (a revoke arriving): next tick
            return []
        new, self._seen = now - self._seen, now
        cancelled = []
        for task_id in sorted(new):
            job_id = self._cancel(task_id)
            if job_id is not None:
                cancelled.append(job_id)
        return cancelled

    def _cancel(self, task_id: str) -> str | None:
        parsed = parse_shard_task_id(task_id)
        if parsed is None:
            return None
        job_id, shard_id = parsed
        try:
            manifest = load_manifest(self.data_dir, job_id)
        except (FileNotFoundError, StoreError, ValueError):
            return None  # not a job of this data dir
        if Store(self.data_dir).committed(job_id, shard_id) is not None:
            return None  # revoking a finished task changes nothing, in Celery as here
        reason = f"task {task_id} (shard {shard_id}) revoked through Celery remote control"
        if not cancel_job(manifest, reason):
            return None
        log.warning("job %s cancelled: %s", job_id, reason)
        return job_id


def celery_revoked_ids() -> list[str]:
    """The task ids this worker process was told to revoke (Celery's worker state)."""
    from celery.worker import state

    return list(state.revoked)
