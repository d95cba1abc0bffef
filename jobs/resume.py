"""`batchgen run` again: the same command finds the job it started and queues what is left of it.

A job started by `run` records a fingerprint of what determines its outputs: the input files (path,
size, modification time), the model, the settings that change what is generated (sampling
defaults, max_model_len, dtype, chat template, shard size, --keep-prompt). The same command again,
or one with `--job-id` of that job, resumes it: committed shards are kept, every other shard (queued,
handed back at an interrupt, died with its worker, failed for good) is queued again with a fresh
retry budget, and `--output` is written at the end. Engine limits (max_num_seqs, the token
budget, ...) may differ between runs: they change speed, not the outputs a seed gives.
"""

from __future__ import annotations

import hashlib
import json
import time

from jobs.broker import BrokerSettings
from jobs.leases import ShardLeases
from jobs.ledger import ShardLedger
from jobs.manifest import JobManifest, JobPaths, list_job_ids, load_manifest
from jobs.spec import InputError, resolve_input_files
from jobs.store import Store

# engine settings that change what a job generates (the rest only change how fast)
OUTPUT_ENGINE_FIELDS = ("model", "max_model_len", "dtype")


class JobBusyError(Exception):
    """The job has a live attempt: another run (or worker) is working on it now."""


def run_fingerprint(req) -> str:
    """What makes a `batchgen run` command the same again (req: jobs.submit.JobRequest)."""
    files = resolve_input_files(req.source)
    data = {
        "inputs": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "engine": {k: req.engine.get(k) for k in OUTPUT_ENGINE_FIELDS},
        "model_given": req.model_given,
        "sampling": {k: v for k, v in req.sampling.items() if v is not None},
        "shard_size": req.shard_size, "apply_chat_template": req.apply_chat_template,
        "keep_prompt": req.keep_prompt,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:24]


def find_run_job(data_dir: str, fingerprint: str, job_id: str | None) -> JobManifest | None:
    """The job this `run` command started before, or None. With `job_id`: that job, which must have
    been started by the same command (InputError otherwise); without: the newest job with the same
    fingerprint that was not cancelled."""
    if job_id:
        try:
            manifest = load_manifest(data_dir, job_id)
        except FileNotFoundError:
            return None
        if manifest.fingerprint != fingerprint:
            how = "with other input files or settings" if manifest.fingerprint else "by `batchgen submit`"
            raise InputError(f"--job-id: job {job_id!r} exists, started {how}; give a new --job-id "
                             "(or the original command to resume it)")
        if _cancelled(manifest):
            raise InputError(f"--job-id: job {job_id!r} was cancelled; give a new --job-id to run it again")
        return manifest
    found = [m for m in _manifests(data_dir) if m.fingerprint == fingerprint and not _cancelled(m)]
    return max(found, key=lambda m: m.submitted_ts, default=None)


def _manifests(data_dir: str):
    for job_id in list_job_ids(data_dir):
        try:
            yield load_manifest(data_dir, job_id)
        except (OSError, ValueError, TypeError):
            continue  # being written, or not a job of this version


def _cancelled(manifest: JobManifest) -> bool:
    return JobPaths.of(manifest.data_dir, manifest.job_id).cancel_marker.exists()


def resume_job(manifest: JobManifest, broker: BrokerSettings) -> list[int]:
    """Queue again every shard of the job that is not committed; their ids (empty: nothing left).

    Refuses (JobBusyError) while an attempt of the job is alive. The job's own queue is emptied
    first, so each shard is queued once."""
    from jobs.celery_app import publish_shard
    from jobs.submit import publish_job

    store = Store(manifest.data_dir)
    if not _recorded(manifest):  # interrupted between writing the manifest and publishing it
        publish_job(manifest, broker)
        return [s.shard_id for s in manifest.shards]
    leases = ShardLeases(JobPaths.of(manifest.data_dir, manifest.job_id).leases)
    claims = leases.claimed_attempts()
    _check_idle(manifest, leases, claims)
    _purge(broker)
    pending = [s.shard_id for s in manifest.shards if store.committed(manifest.job_id, s.shard_id) is None]
    ledger = ShardLedger(manifest.data_dir, manifest.job_id, store, leases)
    for shard_id in pending:  # marked re-queued: the janitor must not queue one a second time
        ledger.queue(shard_id, "resumed by batchgen run", mark_latest=True)
        publish_shard(broker, manifest.job_id, shard_id, manifest.shard(shard_id).path, manifest.data_dir)
    return pending


def _recorded(manifest: JobManifest) -> bool:
    from jobs.store import connect

    con = connect(manifest.data_dir)
    try:
        row = con.execute("SELECT num_requests FROM jobs WHERE job_id = ?", [manifest.job_id]).fetchone()
    finally:
        con.close()
    return row is not None and row[0] is not None


def _check_idle(manifest: JobManifest, leases: ShardLeases, claims: dict[int, list[int]]) -> None:
    now = time.time()
    for shard_id, attempts in sorted(claims.items()):
        view = leases.view(shard_id, attempts[-1])
        if view.alive(now, leases.ttl_s):
            worker = view.state.worker_id if view.state else "?"
            raise JobBusyError(f"job {manifest.job_id} is running elsewhere (shard {shard_id} attempt "
                               f"{attempts[-1]} is alive on {worker}); wait for it or `batchgen cancel` it")


def _purge(broker: BrokerSettings) -> None:
    """Empty the run's own queue (messages of the interrupted run, some handed back)."""
    from kombu import Connection

    with Connection(broker.url) as conn:
        conn.default_channel.queue_purge(broker.queue)


def describe_resume(manifest: JobManifest, pending: list[int]) -> str:
    done = len(manifest.shards) - len(pending)
    return (f"resuming job {manifest.job_id}: {done} of {len(manifest.shards)} shard(s) already committed, "
            f"{len(pending)} to run")
