"""A job on disk: its directory under DATA_DIR/jobs/<job_id>/, its manifest, its shard files.

    DATA_DIR/jobs/<job_id>/manifest.json        what was submitted (written once, atomically)
    DATA_DIR/jobs/<job_id>/shards/shard-000003.parquet
    DATA_DIR/jobs/<job_id>/leases/...           attempt claims and heartbeats (jobs.leases)
    DATA_DIR/jobs/<job_id>/cancel_requested     present once `batchgen cancel` ran (workers stat it)

A shard file holds its input rows unchanged (every column, so extra columns keep their types) plus
`_bg_row` (the row's position in the job's input) and `_bg_request_id` (and, for OpenAI Batch input,
`_bg_url`: the endpoint each request line named). Task messages carry only the
job id, the shard id and absolute paths; every path in the manifest is absolute so any cwd works.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.store import check_id, new_uid, write_atomic

JOBS_DIR = "jobs"
ROW_COLUMN = "_bg_row"  # 0-based position of the row in the job's input (input order)
REQUEST_ID_COLUMN = "_bg_request_id"  # the row's id (the `id` column as text, else the row number)
URL_COLUMN = "_bg_url"  # OpenAI Batch input only: the request line's url (which endpoint answers it)
MANIFEST_VERSION = 1


@dataclass
class ShardInfo:
    """One shard of a job: a contiguous run of input rows."""

    shard_id: int  # 0 .. num_shards-1
    path: str  # absolute path of the shard's Parquet file
    num_requests: int  # rows in the shard
    first_row: int  # input position of its first row


@dataclass
class JobManifest:
    """What a job was submitted as; workers, status and export read it."""

    job_id: str
    data_dir: str  # absolute DATA_DIR
    inputs: list[str]  # absolute paths of the input files (Parquet or JSONL), in order
    num_requests: int  # input rows
    shard_size: int  # rows per shard (the last may be shorter)
    shards: list[ShardInfo]
    engine: dict  # EngineConfig fields the job asked for (workers must serve `engine["model"]`)
    sampling_defaults: dict  # job-level sampling values named as the input columns; rows override them
    queue: str  # broker queue the shard tasks go to
    broker: str  # broker URL without password, or "embedded"
    max_retries: int  # retries of a failing shard before it is marked failed
    retry_backoff_s: float  # first retry delay; doubles each retry
    extra_columns: list[str]  # input columns passed through to outputs
    submitted_ts: float  # epoch seconds
    output_path: str = ""  # the job's own output file, when asked for at submission
    version: int = MANIFEST_VERSION
    shard_timeout_s: float = 0.0  # expected worst-case time of one shard (broker timeouts)
    extra: dict = field(default_factory=dict)  # free-form (e.g. who submitted)
    input_format: str = "parquet"  # parquet | jsonl (plain rows) | openai (OpenAI Batch request lines)
    apply_chat_template: str = "auto"  # auto | always | never: a text `prompt` through the chat template
    fingerprint: str = ""  # set by `batchgen run`: the same command again resumes this job (jobs.resume)

    @property
    def model(self) -> str:
        return self.engine.get("model", "")

    def shard(self, shard_id: int) -> ShardInfo:
        if not 0 <= shard_id < len(self.shards):
            raise KeyError(f"job {self.job_id} has no shard {shard_id} (it has {len(self.shards)})")
        return self.shards[shard_id]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobManifest:
        data = json.loads(text)
        data["shards"] = [ShardInfo(**s) for s in data["shards"]]
        return cls(**data)


@dataclass(frozen=True)
class JobPaths:
    """Where one job's files live."""

    root: Path  # DATA_DIR/jobs/<job_id>

    @classmethod
    def of(cls, data_dir: str | os.PathLike, job_id: str) -> JobPaths:
        return cls(Path(data_dir).expanduser().resolve() / JOBS_DIR / check_id("job_id", job_id))

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def leases(self) -> Path:
        return self.root / "leases"

    @property
    def cancel_marker(self) -> Path:
        return self.root / "cancel_requested"

    def shard_file(self, shard_id: int) -> Path:
        return self.shards / f"shard-{shard_id:06d}.parquet"


def jobs_root(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir).expanduser().resolve() / JOBS_DIR


def write_manifest(manifest: JobManifest, paths: JobPaths) -> None:
    tmp_dir = paths.root
    tmp_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(paths.manifest, manifest.to_json().encode(), tmp_dir)


def load_manifest(data_dir: str | os.PathLike, job_id: str) -> JobManifest:
    """The manifest of `job_id`; FileNotFoundError names the job when there is none."""
    paths = JobPaths.of(data_dir, job_id)
    try:
        return JobManifest.from_json(paths.manifest.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no job {job_id!r} under {paths.root.parent} (no manifest.json)") from None


def list_job_ids(data_dir: str | os.PathLike) -> list[str]:
    root = jobs_root(data_dir)
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob("*/manifest.json"))


def new_job_id(now: float) -> str:
    return "job-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + new_uid()[:6]


# ---------------------------------------------------------------- shard files


class ShardWriter:
    """Cuts a stream of input batches into shard files of `shard_size` rows, in input order."""

    def __init__(self, directory: Path, shard_size: int) -> None:
        self.directory = directory
        self.shard_size = shard_size
        self.shards: list[ShardInfo] = []  # written so far (paths under `directory`)
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._next_row = 0

    def add(self, batch: pa.RecordBatch, request_ids: list[str]) -> None:
        rows = pa.array(range(self._next_row, self._next_row + batch.num_rows), pa.int64())
        batch = batch.append_column(ROW_COLUMN, rows)
        batch = batch.append_column(REQUEST_ID_COLUMN, pa.array(request_ids, pa.string()))
        self._next_row += batch.num_rows
        while batch.num_rows:
            take = min(self.shard_size - self._pending_rows, batch.num_rows)
            self._pending.append(batch.slice(0, take))
            self._pending_rows += take
            batch = batch.slice(take)
            if self._pending_rows == self.shard_size:
                self._write()

    def close(self) -> list[ShardInfo]:
        if self._pending_rows:
            self._write()
        return self.shards

    def _write(self) -> None:
        shard_id = len(self.shards)
        table = pa.Table.from_batches(self._pending)
        path = self.directory / f"shard-{shard_id:06d}.parquet"
        pq.write_table(table, path, compression="zstd")
        first_row = table.column(ROW_COLUMN)[0].as_py()
        self.shards.append(ShardInfo(shard_id, str(path), table.num_rows, first_row))
        self._pending, self._pending_rows = [], 0


def read_shard(path: str | os.PathLike, expected_rows: int) -> pa.Table:
    """A shard file, checked: readable, with its internal columns and the expected row count."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise ShardFileError(f"shard file {path} is unreadable: {str(exc).strip().splitlines()[0]}") from exc
    for name in (ROW_COLUMN, REQUEST_ID_COLUMN):
        if name not in table.column_names:
            raise ShardFileError(f"shard file {path} has no {name!r} column; it was not written by batchgen")
    if table.num_rows != expected_rows:
        raise ShardFileError(f"shard file {path} has {table.num_rows} rows; the manifest: {expected_rows}")
    return table


class ShardFileError(Exception):
    """A shard file that cannot be read as written at submission (corrupt, truncated, replaced)."""
