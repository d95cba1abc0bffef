"""Submitting a job: validate the input, cut it into shards, write the manifest, publish the shards.

`prepare_job` does everything that can fail on bad input, before any work is queued: it checks the
model name, reads the input (Parquet, or JSONL through jobs.jsonl_input) file by file and batch by
batch, checks columns and ids (`jobs.input_contract`), and writes shard files into a staging directory that
becomes DATA_DIR/jobs/<job_id>/ only when the whole input passed. `publish_job` then records the job
in the store and sends one task per shard.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from jobs.broker import BrokerSettings, shard_timeout_s
from jobs.input_contract import (
    CHAT_TEMPLATE_MODES,
    PROMPT_COLUMNS,
    InputError,
    InputSchema,
    RequestIds,
    check_cell_sizes,
    check_model,
    check_sampling_values,
    input_kind,
    open_parquet,
    resolve_input_files,
    sampling_defaults,
)
from jobs.manifest import (
    JobManifest,
    JobPaths,
    RegularShards,
    ShardWriter,
    jobs_root,
    new_job_id,
    shard_sizes,
    write_manifest,
)
from jobs.shards.ledger import ShardLedger
from jobs.store import JobRecord, Store, StoreError, check_id, new_uid

READ_BATCH_ROWS = 4096
QUEUED_EVENTS_PER_PART = 65_536  # a new job's `queued` shard events are written this many a part


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
    output_path: str = ""  # the job's output file (.parquet or .jsonl), when asked for
    extra: dict = field(default_factory=dict)
    apply_chat_template: str = "auto"  # auto | always | never: a `prompt` through the chat template
    keep_prompt: bool = False  # carry the prompt / messages columns through to `outputs`
    model_given: bool = True  # engine["model"] was asked for (else an OpenAI file's body.model may set it)
    local: bool = False  # the job runs on this machine (`run`): its model must be loadable here
    fingerprint: str = ""  # what makes a `run` command the same again (jobs.shards.resume)


def prepare_job(req: JobRequest, broker: BrokerSettings) -> JobManifest:
    """Validate the input and write the job's shards and manifest; raise InputError on bad input."""
    if req.shard_size < 1:
        raise InputError(f"--shard-size must be >= 1, got {req.shard_size}")
    if req.max_retries < 0:
        raise InputError(f"--max-retries must be >= 0, got {req.max_retries}")
    if req.apply_chat_template not in CHAT_TEMPLATE_MODES:
        raise InputError(f"--apply-chat-template must be one of {CHAT_TEMPLATE_MODES}, "
                         f"got {req.apply_chat_template!r}")
    defaults = sampling_defaults(**req.sampling)
    files = resolve_input_files(req.source)
    if req.model_given or input_kind(files[0]) != "jsonl":
        check_model(req.engine.get("model", ""), local=req.local)
    data_dir = str(Path(req.data_dir).expanduser().resolve())
    now = time.time()
    job_id = _job_id(req.job_id, data_dir, now)
    staging = jobs_root(data_dir) / f".staging-{job_id}-{new_uid()}"
    staging.mkdir(parents=True)
    pool = pa.default_memory_pool()
    # Arrow's default mimalloc keeps the pages it freed in its arenas, on transparent huge pages: the
    # system allocator gives them back. This is pyarrow's pool; Arrow C++'s (the Parquet writer's) is
    # chosen before pyarrow is imported (jobs.cli.set_arrow_allocator).
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        manifest = _write_shards(req, files, staging, data_dir, job_id, defaults, broker, now)
        _move_into_place(staging, JobPaths.of(data_dir, job_id), manifest)
    finally:
        pa.set_memory_pool(pool)
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


@dataclass
class _InputFile:
    """One input file, opened: its format, its input columns and a way to read its rows."""

    path: Path
    format: str  # parquet | jsonl (plain rows) | openai (OpenAI Batch request lines)
    schema: pa.Schema  # the input columns (internal ones, such as an OpenAI line's url, excluded)
    batches: Callable[[], Iterator[tuple[pa.RecordBatch, list[int] | None]]]  # (rows, JSONL line numbers)
    # once read: the model the file's requests name (OpenAI body.model) or None, and where first
    model: Callable[[], tuple[str | None, str]] = lambda: (None, "")


def _open_input(path: Path) -> _InputFile:
    if input_kind(path) == "jsonl":
        from jobs.jsonl_input import JsonlInput

        source = JsonlInput.scan(path)
        return _InputFile(path, source.format, source.schema, source.batches,
                          lambda: (source.model, f"{path} line {source.model_line}"))
    pf = open_parquet(path)
    batches = lambda: ((b, None) for b in pf.iter_batches(batch_size=READ_BATCH_ROWS))
    return _InputFile(path, "parquet", pf.schema_arrow, batches)


@dataclass
class _Read:
    """What reading a job's input found, beyond the shards themselves."""

    format: str = ""  # of the first file; every file has the same
    schema: InputSchema | None = None
    model: str | None = None  # the model the input names, if any
    model_where: str = ""
    max_n: int = 1  # the largest `n` of any row


def _write_shards(req: JobRequest, files: list[Path], staging: Path, data_dir: str, job_id: str,
                  defaults: dict, broker: BrokerSettings, now: float) -> JobManifest:
    shards_dir = staging / "shards"
    shards_dir.mkdir()
    writer = ShardWriter(shards_dir, req.shard_size)
    ids = RequestIds(staging)
    read = _Read(max_n=defaults.get("n", 1))
    for path in files:
        _take_file(_open_input(path), read, writer, ids)
    writer.close()
    if ids.num_rows == 0:
        raise InputError(f"input {req.source!r} has no rows")
    ids.check_unique()
    shards = RegularShards(JobPaths.of(data_dir, job_id), ids.num_rows, req.shard_size)
    engine = {**req.engine, "model": _job_model(req, read)}
    max_tokens = defaults.get("max_tokens", 16)
    carried = [c for c in PROMPT_COLUMNS if c in read.schema.schema.names] if req.keep_prompt else []
    return JobManifest(
        job_id=job_id, data_dir=data_dir, inputs=[str(p) for p in files], num_requests=ids.num_rows,
        shard_size=req.shard_size, shards=shards, engine=engine, sampling_defaults=defaults,
        queue=broker.queue, broker=broker.display_url, max_retries=req.max_retries,
        retry_backoff_s=req.retry_backoff_s, extra_columns=carried + read.schema.extra_columns,
        submitted_ts=now, output_path=req.output_path,
        shard_timeout_s=shard_timeout_s(req.shard_size * read.max_n, max_tokens), extra=req.extra,
        input_format=read.format, apply_chat_template=req.apply_chat_template, fingerprint=req.fingerprint,
    )


def _take_file(source: _InputFile, read: _Read, writer: ShardWriter, ids: RequestIds) -> None:
    """Check one file against the job's first and cut its rows into shards."""
    if read.schema is None:
        read.format, read.schema = source.format, InputSchema.check(source.schema, source.path)
    else:
        if source.format != read.format:
            raise InputError(f"{source.path}: {source.format} input, but the first file is {read.format}; "
                             "one job reads one format")
        read.schema.check_same(source.schema, source.path)
    read.max_n = max(read.max_n, _read_file(source, writer, ids))
    model, where = source.model()
    if model is not None:
        if read.model is not None and model != read.model:
            raise InputError(f"{where}: body.model {model!r} differs from {read.model!r} "
                             f"({read.model_where}); one job runs one model")
        read.model, read.model_where = model, where


def _job_model(req: JobRequest, read: _Read) -> str:
    """The model the job runs: --model, or the model an OpenAI file names when --model was not given
    (checked here: before reading, only a given --model or a Parquet job's was)."""
    asked = req.engine.get("model", "")
    if read.model is not None and read.model != asked and req.model_given:
        raise InputError(f"{read.model_where}: body.model {read.model!r} differs from --model {asked!r}; "
                         "drop body.model from the file or run it with --model " + read.model)
    if req.model_given or read.format == "parquet":
        return asked
    model = read.model or asked
    check_model(model, local=req.local, what=f"{read.model_where}: body.model" if read.model else "--model")
    return model


def _read_file(source: _InputFile, writer: ShardWriter, ids: RequestIds) -> int:
    """Shard one file's rows; the largest `n` among them."""
    file_row, max_n = 0, 1
    batches = source.batches()
    while True:
        try:  # only reading can be the input's fault; writing shards (a full disk) is not
            batch, lines = next(batches)
        except StopIteration:
            return max_n
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - pyarrow raises many kinds for a damaged file
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(f"{source.path}: unreadable after row {file_row} ({first_line})") from exc
        if lines is None:  # a JSONL line is checked as it is read
            check_cell_sizes(batch, source.path, file_row)
        max_n = max(max_n, check_sampling_values(batch, source.path, file_row, lines))
        writer.add(batch, ids.take(batch, source.path, file_row, lines))
        file_row += batch.num_rows


def _move_into_place(staging: Path, final: JobPaths, manifest: JobManifest) -> None:
    try:
        final.root.mkdir(parents=True)
    except FileExistsError:  # another submit or run with this --job-id won the race
        raise InputError(f"--job-id: job {manifest.job_id!r} already exists under {final.root.parent} "
                         "(another command created it a moment ago)") from None
    os.replace(staging / "shards", final.shards)
    write_manifest(manifest, final)


def publish_job(manifest: JobManifest, broker: BrokerSettings) -> None:
    """Record the job and its queued shards in the store, then send one task per shard."""
    from jobs.shards.broker_messages import publish_shard

    store = Store(manifest.data_dir)
    store.record_job(job_record(manifest))
    ledger = ShardLedger(manifest.data_dir, manifest.job_id, store)
    ledger.queue_new(shard_sizes(manifest.shards), per_part=QUEUED_EVENTS_PER_PART)  # bounded by a part
    for shard_id in range(len(manifest.shards)):  # nothing kept per shard (a 100M-row job has 390,625)
        publish_shard(broker, manifest.job_id, shard_id)


def job_record(manifest: JobManifest) -> JobRecord:
    """The store's record of a job (the `jobs` view's row), from its manifest."""
    config = job_config_json(manifest)
    return JobRecord(manifest.job_id, manifest.model, manifest.num_requests, len(manifest.shards),
                     manifest.submitted_ts, config=config, output_path=json.loads(config)["output_path"])


def job_config_json(manifest: JobManifest) -> str:
    """The `config` column of the `jobs` view: the manifest as written, but the shard list."""
    data = manifest.to_dict()
    data.pop("shards", None)  # listed only for shards no regular cut describes
    return json.dumps(data, sort_keys=True)
