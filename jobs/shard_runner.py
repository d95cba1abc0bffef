"""One delivery of a shard task, as a plain function: skip it, run it, or say when to retry it.

`process_shard(task, runtime)` is what the Celery task calls (and what tests call directly):

0. hand the message back (requeue) when the worker is shutting down: it only finishes what it holds;
1. skip when the shard is committed (tasks are idempotent), its job was cancelled, or a live attempt
   of it runs elsewhere (a duplicate delivery);
2. claim the next attempt (jobs.leases) and open it in the store (`running` event);
3. read the shard file, turn rows into engine requests (bad rows become error rows at once), hand
   them to the worker's engine and wait for every row;
4. write output and request rows, commit; or, on an error, fail the attempt and ask for a retry
   (exponential backoff) until the job's `max_retries` are used, then fail the shard for good.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from engine.stats import RequestStats
from jobs.leases import Lease, ShardLeases
from jobs.manifest import REQUEST_ID_COLUMN, JobManifest, JobPaths, load_manifest, read_shard
from jobs.spec import row_request
from jobs.store.parts import ShardAttempt, Store
from jobs.store.schemas import ShardEvent

if TYPE_CHECKING:
    from jobs.runtime import EngineRequest, ShardRun, WorkerRuntime

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 600.0


@dataclass
class ShardTask:
    """What a shard message says (ids and absolute paths), plus the delivery's retry count."""

    job_id: str
    shard_id: int
    shard_path: str  # absolute path of the shard's Parquet file
    data_dir: str  # absolute DATA_DIR of the job
    retries: int = 0  # retries already made of this shard (Celery's request.retries)


@dataclass
class ShardOutcome:
    """What one delivery did."""

    result: str  # committed | skipped | failed | retry | cancelled | handed_back
    attempt: int = 0  # the attempt it ran (0 when skipped)
    rows: int = 0  # output rows committed
    output_tokens: int = 0
    reason: str = ""  # why skipped / failed / retried
    retry_in_s: float | None = None  # set when the task must be retried after this delay

    def describe(self) -> str:
        text = f"{self.result} (attempt {self.attempt}, {self.rows} rows, {self.output_tokens} tokens)"
        return f"{text}: {self.reason}" if self.reason else text

    def as_dict(self) -> dict:
        return asdict(self)


def backoff_s(first_s: float, retries: int) -> float:
    """Delay before retry number `retries + 1`: first_s, 2 first_s, 4 first_s, ... (capped)."""
    return min(first_s * (2 ** retries), MAX_BACKOFF_S)


def process_shard(task: ShardTask, runtime: WorkerRuntime) -> ShardOutcome:
    """Run one delivery of a shard task to its end (see the module docstring)."""
    if runtime.draining:
        return ShardOutcome("handed_back", reason="the worker is shutting down")
    manifest = load_manifest(task.data_dir, task.job_id)
    paths = JobPaths.of(task.data_dir, task.job_id)
    store = Store(task.data_dir)
    skip = _skip_reason(store, paths, task)
    if skip:
        return ShardOutcome("skipped", reason=skip)
    lease = ShardLeases(paths.leases).try_claim(task.shard_id, runtime.worker_id)
    if lease is None:
        return ShardOutcome("skipped", reason="a live attempt of this shard runs elsewhere")
    info = manifest.shard(task.shard_id)
    attempt = store.begin_attempt(task.job_id, task.shard_id, lease.attempt, runtime.worker_id,
                                  num_requests=info.num_requests, flush_interval_s=10.0)
    try:
        with runtime.holding(task.job_id, lease, paths.cancel_marker):
            return _run_attempt(task, manifest, runtime, lease, attempt)
    except Exception as exc:  # noqa: BLE001 - any failure of an attempt is retried, then reported
        log.warning("shard %s/%d attempt %d failed:\n%s", task.job_id, task.shard_id, lease.attempt,
                    traceback.format_exc())
        return _failed(task, manifest, store, lease, attempt, _reason(exc))


def _skip_reason(store: Store, paths: JobPaths, task: ShardTask) -> str | None:
    if store.committed(task.job_id, task.shard_id) is not None:
        return "already committed"
    if paths.cancel_marker.exists():
        _record_cancelled(store, task)
        return "job cancelled"
    return None


def _record_cancelled(store: Store, task: ShardTask) -> None:
    store.record_shard_events([ShardEvent(task.job_id, task.shard_id, "cancelled", time.time(),
                                          error="job cancelled before this shard ran")])


def _run_attempt(task: ShardTask, manifest: JobManifest, runtime: WorkerRuntime, lease: Lease,
                 attempt: ShardAttempt) -> ShardOutcome:
    runtime.check_model(manifest)
    info = manifest.shard(task.shard_id)
    table = read_shard(task.shard_path or info.path, info.num_requests)
    rows = table.to_pylist()
    key = f"{task.job_id}:{task.shard_id}:{lease.attempt}"
    requests, errors = _requests(rows, manifest.sampling_defaults, key)
    run = runtime.run_shard(task.job_id, key, requests)
    if lease.superseded():
        attempt.fail("superseded: a newer attempt was started while this one was presumed dead")
        lease.end("superseded")
        return ShardOutcome("skipped", lease.attempt, reason="superseded by a newer attempt")
    if run.error:
        raise RuntimeError(run.error)
    _write_rows(attempt, rows, run, errors, manifest.extra_columns, table.schema, key)
    record = attempt.commit()
    lease.end("committed", rows_done=record.num_outputs, output_tokens=record.output_tokens)
    result = "cancelled" if run.cancelled else "committed"
    return ShardOutcome(result, lease.attempt, record.num_outputs, record.output_tokens)


def _requests(rows: list[dict], defaults: dict, key: str) -> tuple[list[EngineRequest], dict[int, str]]:
    """Engine requests for the rows that can run; row index -> error for those that cannot."""
    from jobs.runtime import EngineRequest

    requests, errors = [], {}
    for i, row in enumerate(rows):
        req = row_request(row, defaults)
        if req.error:
            errors[i] = req.error
        else:
            requests.append(EngineRequest(f"{key}:{i}", req.prompt, req.messages, req.params))
    return requests, errors


def _write_rows(attempt: ShardAttempt, rows: list[dict], run: ShardRun, errors: dict[int, str],
                extra_columns: list[str], schema: pa.Schema, key: str) -> None:
    """Output and request rows in shard order, which is input order."""
    attempt.extra_schema = pa.schema([schema.field(c) for c in extra_columns])
    now = time.time()
    outputs, timings = [], []
    for i, row in enumerate(rows):
        rid = row[REQUEST_ID_COLUMN]
        extras = {c: row[c] for c in extra_columns}
        if i in errors:
            stats = RequestStats(arrival_ts=now, finished_ts=now)
            outputs.append(_output_row(rid, "", "error", 0, 0, errors[i], extras))
            timings.append({"request_id": rid, "finish_reason": "error", **stats.as_row()})
            continue
        out = run.outputs[f"{key}:{i}"]
        out.metrics.prompt_tokens = len(out.prompt_token_ids)
        outputs.append(_output_row(rid, out.text, out.finish_reason, len(out.prompt_token_ids),
                                   len(out.token_ids), out.error, extras))
        timings.append({"request_id": rid, "finish_reason": out.finish_reason, **out.metrics.as_row()})
    attempt.add_outputs(outputs)
    attempt.add_requests(timings)


def _output_row(rid: str, text: str, reason: str, prompt_tokens: int, output_tokens: int,
                error: str | None, extras: dict) -> dict:
    return {"request_id": rid, "output_text": text, "finish_reason": reason, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "error": error, **extras}


def _failed(task: ShardTask, manifest: JobManifest, store: Store, lease: Lease, attempt: ShardAttempt,
            reason: str) -> ShardOutcome:
    if task.retries < manifest.max_retries:
        delay = backoff_s(manifest.retry_backoff_s, task.retries)
        _close(attempt, reason)
        lease.end("retrying", reason, retry_at=time.time() + delay)
        store.record_shard_events([ShardEvent(task.job_id, task.shard_id, "queued", time.time(),
                                              attempt=lease.attempt + 1, error=f"retry after: {reason}")])
        return ShardOutcome("retry", lease.attempt, reason=reason, retry_in_s=delay)
    final = f"{reason} (gave up after {task.retries + 1} tries)"
    _close(attempt, final)
    lease.end("failed", final)
    return ShardOutcome("failed", lease.attempt, reason=final)


def _close(attempt: ShardAttempt, reason: str) -> None:
    if not attempt.closed:
        attempt.fail(reason)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
