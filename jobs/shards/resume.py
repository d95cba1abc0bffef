"""`batchgen run` again: the same command finds the job it started and queues what is left of it.

A job started by `run` records a fingerprint of what determines its outputs: the input files (path,
relative to the data dir for a file inside it; size; modification time), the model, the settings
that change what is generated (sampling defaults, max_model_len, dtype, chat template, shard size,
--keep-prompt). The same command again, or one with `--job-id` of that job, resumes it: committed
shards are kept, every other shard (queued, handed back at an interrupt, died with its worker,
failed for good, or lost and marked for re-run by `batchgen store check --repair`) is queued again
with a fresh retry budget, and `--output` is written at the end. Engine limits (max_num_seqs, the
token budget, ...) may differ between runs: they change speed, not the outputs a seed gives.

Job identity is an atomic claim (`RunClaim`): before creating a job, a run creates
DATA_DIR/jobs/.claims/<fingerprint>.<n>.claim with O_EXCL, looks once more for the job, and only
then creates it; the claim goes when the job is recorded. Two identical commands started at once
thus share one job: the second waits for the first's claim and resumes the job it created.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from jobs.broker import BrokerSettings
from jobs.input_contract import InputError, resolve_input_files
from jobs.manifest import (
    JobManifest,
    JobPaths,
    ManifestError,
    jobs_root,
    list_job_ids,
    load_manifest,
    portable_path,
)
from jobs.shards.leases import ShardLeases, pid_running
from jobs.shards.ledger import ShardLedger
from jobs.store import Store

# engine settings that change what a job generates (the rest only change how fast)
OUTPUT_ENGINE_FIELDS = ("model", "max_model_len", "dtype")
CLAIMS_DIR = ".claims"  # under DATA_DIR/jobs/: one claim per running `run` command's fingerprint
CLAIM_POLL_S = 0.5
CLAIM_STALE_S = 600.0  # a claim of another host older than this belongs to a run that is gone


class JobBusyError(Exception):
    """The job has a live attempt: another run (or worker) is working on it now."""


def run_fingerprint(req) -> str:
    """What makes a `batchgen run` command the same again (req: jobs.submit.JobRequest)."""
    files = resolve_input_files(req.source)
    root = Path(req.data_dir).expanduser().resolve()
    data = {  # an input inside the data dir by its place there: a moved data dir runs the same job
        "inputs": [[portable_path(p, root), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
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
    found = [m for m in _manifests(data_dir, fingerprint)
             if m.fingerprint == fingerprint and not _cancelled(m)]
    return max(found, key=lambda m: m.submitted_ts, default=None)


def _manifests(data_dir: str, fingerprint: str):
    """Every job's manifest. An unreadable one is skipped when the store's record of its job names
    another command; else (it may be this command's job) ManifestError says what to do."""
    for job_id in list_job_ids(data_dir):
        try:
            yield load_manifest(data_dir, job_id)
        except ManifestError:
            if _recorded_fingerprint(data_dir, job_id) in (fingerprint, None):
                raise
        except OSError:
            continue  # removed while we listed


def _recorded_fingerprint(data_dir: str, job_id: str) -> str | None:
    from jobs.store import connect

    con = connect(data_dir)
    try:
        row = con.execute("SELECT config FROM _bg.job_records WHERE job_id = ?", [job_id]).fetchone()
    except Exception:  # noqa: BLE001 - the job records cannot be read either: unknown
        return None
    finally:
        con.close()
    try:
        return json.loads(row[0]).get("fingerprint") if row else None
    except (ValueError, TypeError, AttributeError):
        return None


def _cancelled(manifest: JobManifest) -> bool:
    return JobPaths.of(manifest.data_dir, manifest.job_id).cancel_marker.exists()


def resume_job(manifest: JobManifest, broker: BrokerSettings) -> list[int] | None:
    """Queue again every shard of the job that is not committed; their ids (empty: nothing left).
    None when the job was never published (its run was interrupted between writing the manifest and
    publishing it): the caller publishes the whole job (jobs.submit.publish_job).

    Refuses (JobBusyError) while an attempt of the job is alive. The job's own queue is emptied
    first, so each shard is queued once. A committed shard whose lease files are gone (deleted, or
    not copied) gets them back from its commit, so progress read from leases sees it done."""
    from jobs.shards.broker_messages import publish_shard

    store = Store(manifest.data_dir)
    if not _recorded(manifest):
        return None
    leases = ShardLeases(JobPaths.of(manifest.data_dir, manifest.job_id).leases)
    claims = leases.claimed_attempts()
    _check_idle(manifest, leases, claims)
    _purge(broker)
    ledger = ShardLedger(manifest.data_dir, manifest.job_id, store, leases)
    pending = []
    for shard in manifest.shards:
        record = store.committed(manifest.job_id, shard.shard_id)
        if record is None:
            pending.append(shard.shard_id)
        else:  # progress is read from leases: a committed shard whose lease files are gone gets them back
            ledger.restore(shard.shard_id, record)
    for shard_id in pending:  # marked re-queued: the janitor must not queue one a second time
        ledger.queue(shard_id, "resumed by batchgen run", mark_latest=True)
        publish_shard(broker, manifest.job_id, shard_id)
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


# ---------------------------------------------------------------- one run per command at a time


class RunClaim:
    """A `batchgen run` command's hold on its fingerprint, from before it looks for its job until it
    ends: DATA_DIR/jobs/.claims/<fingerprint>.<n>.claim, created with O_EXCL (so one process gets
    it), holding the claimant's host and pid. The highest n is the claim in force; one whose
    process is gone (on this host: no such pid; elsewhere: older than CLAIM_STALE_S) is superseded
    by n + 1, as a dead lease is. An identical command meanwhile waits, then resumes the job."""

    def __init__(self, data_dir: str | Path, fingerprint: str) -> None:
        self.directory = jobs_root(data_dir) / CLAIMS_DIR
        self.fingerprint = fingerprint
        self.path: Path | None = None  # the claim file, while held

    def take(self, on_wait: Callable[[dict], None] = lambda holder: None,
             poll_s: float = CLAIM_POLL_S) -> None:
        """Hold the claim, waiting while another live process holds it (`on_wait` once, with its
        holder's host and pid)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        told = False
        while True:
            number, holder = self._current()
            if holder is None or not _claimant_alive(holder):
                if self._create(number + 1):
                    return
                continue
            if not told:
                on_wait(holder)
                told = True
            time.sleep(poll_s)

    def release(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def _current(self) -> tuple[int, dict | None]:
        """The number of the claim in force and what it holds (None: no claim)."""
        numbers = [int(p.name.split(".")[1]) for p in self.directory.glob(f"{self.fingerprint}.*.claim")]
        if not numbers:
            return 0, None
        path = self.directory / f"{self.fingerprint}.{max(numbers)}.claim"
        try:
            holder = json.loads(path.read_text() or "{}")
            holder["age_s"] = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return max(numbers) - 1, None  # released a moment ago
        except ValueError:
            holder = {"age_s": 0.0}  # being written
        return max(numbers), holder

    def _create(self, number: int) -> bool:
        path = self.directory / f"{self.fingerprint}.{number}.claim"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "ts": time.time()}, fh)
        self.path = path
        return True


def _claimant_alive(holder: dict) -> bool:
    if "pid" not in holder:
        return holder.get("age_s", 0.0) < CLAIM_STALE_S
    if holder.get("host") == socket.gethostname():
        return pid_running(int(holder["pid"]))
    return holder.get("age_s", 0.0) < CLAIM_STALE_S
