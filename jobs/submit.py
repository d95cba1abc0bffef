"""Submitting a job: validate the input, cut it into shards, write the manifest, publish the shards.

`prepare_job` does everything that can fail on bad input, before any work is queued: it reads the
input file by file and batch by batch, checks columns and ids (`jobs.spec`), and writes shard files
into a staging directory that becomes DATA_DIR/jobs/<job_id>/ only when the whole input passed.
`publish_job` then records the job in the store and sends one task per shard.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from jobs.broker import BrokerSettings, shard_timeout_s
from jobs.manifest import JobManifest, JobPaths, ShardWriter, jobs_root, new_job_id, write_manifest
from jobs.spec import (
    InputError,
    InputSchema,
    RequestIds,
    check_sampling_values,
    open_parquet,
    resolve_input_files,
    sampling_defaults,
)
from jobs.store.layout import StoreError, check_id, new_uid
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent

READ_BATCH_ROWS = 4096


@dataclass
class JobRequest:
    """What the user asked to run (CLI flags, already parsed)."""

    source: str  # a Parquet file, a directory of them, or a glob
    data_dir: str  # DATA_DIR (made absolute here)
    engine: dict  # EngineConfig fields (the model the job needs, limits it asked for)
    sampling: dict  # job-level sampling defaults (SamplingParams fields; None = default)
    shard_size: int  # rows per shard
    max_retries: int = 3  # retries of a failing shard before it fails for good
    retry_backoff_s: float = 5.0  # first retry delay (doubles each retry)
    job_id: str | None = None  # default: job-<utc time>-<random>
    output_path: str = ""  # the job's output Parquet, when asked for
    extra: dict = field(default_factory=dict)


def prepare_job(req: JobRequest, broker: BrokerSettings) -> JobManifest:
    """Validate the input and write the job's shards and manifest; raise InputError on bad input."""
    if req.shard_size < 1:
        raise InputError(f"--shard-size must be >= 1, got {req.shard_size}")
    if req.max_retries < 0:
        raise InputError(f"--max-retries must be >= 0, got {req.max_retries}")
    defaults = sampling_defaults(**req.sampling)
    files = resolve_input_files(req.source)
    data_dir = str(Path(req.data_dir).expanduser().resolve())
    now = time.time()
    job_id = _job_id(req.job_id, data_dir, now)
    staging = jobs_root(data_dir) / f".staging-{job_id}-{new_uid()}"
    staging.mkdir(parents=True)
    try:
        manifest = _write_shards(req, files, staging, data_dir, job_id, defaults, broker, now)
        _move_into_place(staging, JobPaths.of(data_dir, job_id), manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _job_id(given: str | None, data_dir: str, now: float) -> str:
    job_id = given or new_job_id(now)
    try:
        check_id("job id", job_id)
    except StoreError as exc:
        raise InputError(f"--job-id: {exc}") from None
    if JobPaths.of(data_dir, job_id).root.exists():
        raise InputError(f"--job-id: job {job_id!r} already exists under {jobs_root(data_dir)}")
    return job_id


def _write_shards(req: JobRequest, files: list[Path], staging: Path, data_dir: str, job_id: str,
                  defaults: dict, broker: BrokerSettings, now: float) -> JobManifest:
    shards_dir = staging / "shards"
    shards_dir.mkdir()
    writer = ShardWriter(shards_dir, req.shard_size)
    ids = RequestIds()
    schema: InputSchema | None = None
    for path in files:
        pf = open_parquet(path)
        if schema is None:
            schema = InputSchema.check(pf.schema_arrow, path)
        else:
            schema.check_same(pf.schema_arrow, path)
        _read_file(pf, path, writer, ids)
    shards = writer.close()
    if ids.num_rows == 0:
        raise InputError(f"input {req.source!r} has no rows")
    final = JobPaths.of(data_dir, job_id)
    for shard in shards:
        shard.path = str(final.shard_file(shard.shard_id))
    max_tokens = defaults.get("max_tokens", 16)
    return JobManifest(
        job_id=job_id, data_dir=data_dir, inputs=[str(p) for p in files], num_requests=ids.num_rows,
        shard_size=req.shard_size, shards=shards, engine=req.engine, sampling_defaults=defaults,
        queue=broker.queue, broker=broker.display_url, max_retries=req.max_retries,
        retry_backoff_s=req.retry_backoff_s, extra_columns=schema.extra_columns, submitted_ts=now,
        output_path=req.output_path, shard_timeout_s=shard_timeout_s(req.shard_size, max_tokens),
        extra=req.extra,
    )


def _read_file(pf: pq.ParquetFile, path: Path, writer: ShardWriter, ids: RequestIds) -> None:
    file_row = 0
    try:
        batches = pf.iter_batches(batch_size=READ_BATCH_ROWS)
        for batch in batches:
            check_sampling_values(batch, path, file_row)
            writer.add(batch, ids.take(batch, path, file_row))
            file_row += batch.num_rows
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many kinds for a damaged file
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{path}: unreadable after row {file_row} ({first_line})") from exc


def _move_into_place(staging: Path, final: JobPaths, manifest: JobManifest) -> None:
    final.root.mkdir(parents=True)
    os.replace(staging / "shards", final.shards)
    write_manifest(manifest, final)


def publish_job(manifest: JobManifest, broker: BrokerSettings) -> None:
    """Record the job and its queued shards in the store, then send one task per shard."""
    from jobs.celery_app import publish_shard

    store = Store(manifest.data_dir)
    store.record_job(JobRecord(manifest.job_id, manifest.model, manifest.num_requests, len(manifest.shards),
                               manifest.submitted_ts, config=job_config_json(manifest),
                               output_path=manifest.output_path))
    now = time.time()
    store.record_shard_events([ShardEvent(manifest.job_id, s.shard_id, "queued", now,
                                          num_requests=s.num_requests) for s in manifest.shards])
    for shard in manifest.shards:
        publish_shard(broker, manifest.job_id, shard.shard_id, shard.path, manifest.data_dir)


def job_config_json(manifest: JobManifest) -> str:
    """The `config` column of the `jobs` view: everything but the shard list."""
    data = asdict(manifest)
    data.pop("shards")
    return json.dumps(data, sort_keys=True)
