"""A job on disk: its directory under DATA_DIR/jobs/<job_id>/, its manifest, its shard files.

    DATA_DIR/jobs/<job_id>/manifest.json        what was submitted (written once, atomically)
    DATA_DIR/jobs/<job_id>/shards/shard-000003.parquet
    DATA_DIR/jobs/<job_id>/leases/...           attempt claims and heartbeats (jobs.shards.leases)
    DATA_DIR/jobs/<job_id>/cancel_requested     present once `batchgen cancel` ran (workers stat it)

A shard file holds its input rows unchanged (every column, so extra columns keep their types) plus
`_bg_row` (the row's position in the job's input) and `_bg_request_id` (and, for OpenAI Batch input,
`_bg_url`: the endpoint each request line named).

A data dir is self-contained: the manifest names no absolute path of it. It does not record the data
dir at all (`JobManifest.data_dir` is where it was loaded from), its shard files are found by their
place in the job's directory, and a file the user named inside the data dir (an input, `--output`)
is written relative to it; files outside it are the user's own and keep their absolute path. So a
copied or moved data dir reads and writes its own files, never the original's. In memory every path
is absolute, so any cwd works.

Shards are cut `shard_size` rows at a time in input order, so shard i holds rows i*shard_size.. and
only the last may be shorter. Version 2 of the manifest therefore lists no shard: `JobManifest.shards`
is computed from `num_requests` and `shard_size` (a 100M-row job has 390,625 shards; listing them made
the manifest, and everything that read it, grow with the job). A version 1 manifest lists its shards
and still reads as written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jobs.store import check_id, new_uid, write_atomic

JOBS_DIR = "jobs"
SHARDS_DIR = "shards"  # a job's shard files, in its directory
ROW_COLUMN = "_bg_row"  # 0-based position of the row in the job's input (input order)
REQUEST_ID_COLUMN = "_bg_request_id"  # the row's id (the `id` column as text, else the row number)
URL_COLUMN = "_bg_url"  # OpenAI Batch input only: the request line's url (which endpoint answers it)
MANIFEST_VERSION = 2  # 2: no shard list (`RegularShards`); 1: every shard listed


@dataclass
class ShardInfo:
    """One shard of a job: a contiguous run of input rows."""

    shard_id: int  # 0 .. num_shards-1
    path: str  # absolute path of the shard's Parquet file (in the file: relative to the job's directory)
    num_requests: int  # rows in the shard
    first_row: int  # input position of its first row


@dataclass
class JobManifest:
    """What a job was submitted as; workers, status and export read it."""

    job_id: str
    data_dir: str  # absolute DATA_DIR it was loaded from (never written to the manifest file)
    inputs: list[str]  # absolute paths of the input files (Parquet or JSONL), in order
    num_requests: int  # input rows
    shard_size: int  # rows per shard (the last may be shorter)
    shards: Sequence[ShardInfo]  # RegularShards (computed), or a list (a version 1 manifest's)
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
    fingerprint: str = ""  # set by `batchgen run`: the same command again resumes it (jobs.shards.resume)

    @property
    def model(self) -> str:
        return self.engine.get("model", "")

    def shard(self, shard_id: int) -> ShardInfo:
        if not 0 <= shard_id < len(self.shards):
            raise KeyError(f"job {self.job_id} has no shard {shard_id} (it has {len(self.shards)})")
        return self.shards[shard_id]

    def to_dict(self) -> dict:
        """The manifest as written: no data dir, paths inside the data dir relative to it, and no shard
        list when the shards are the regular cut (always, for a job batchgen submitted)."""
        root = Path(self.data_dir)
        data = json.loads(json.dumps({f.name: getattr(self, f.name) for f in fields(self)  # a deep copy
                                      if f.name not in ("data_dir", "shards")}))
        data["inputs"] = [portable_path(p, root) for p in self.inputs]
        data["output_path"] = portable_path(self.output_path, root) if self.output_path else ""
        if _regular(self.shards, self.num_requests, self.shard_size):
            data["version"] = MANIFEST_VERSION
        else:  # shards no batchgen cut writes (a hand-made manifest): listed, as version 1 did
            data["version"] = 1
            data["shards"] = [{**asdict(s), "path": f"{SHARDS_DIR}/{Path(s.path).name}"} for s in self.shards]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, data_dir: str | os.PathLike) -> JobManifest:
        """The manifest of a job under `data_dir` (whatever data dir an older manifest names)."""
        data = json.loads(text)
        root = Path(data_dir).expanduser().resolve()
        data["data_dir"] = str(root)
        paths = JobPaths.of(root, data["job_id"])
        version = data.get("version", 1)
        if not isinstance(version, int) or not 1 <= version <= MANIFEST_VERSION:
            raise ValueError(f"manifest version {version!r}: this batchgen reads versions 1 to "
                             f"{MANIFEST_VERSION} (a newer batchgen wrote it?)")
        if "shards" in data:  # version 1 (or shards no regular cut describes)
            data["shards"] = [ShardInfo(**{**s, "path": str(paths.shard_file(s["shard_id"]))})
                              for s in data["shards"]]
        else:
            data["shards"] = RegularShards(paths, _count(data, "num_requests", 0),
                                           _count(data, "shard_size", 1))
        data["inputs"] = [str(resolve_portable(p, root)) for p in data["inputs"]]
        if data.get("output_path"):
            data["output_path"] = str(resolve_portable(data["output_path"], root))
        return cls(**data)


class RegularShards(Sequence[ShardInfo]):
    """A job's shards as submit cuts them: `shard_size` rows each in input order, the last shorter;
    each ShardInfo made when asked for (nothing held per shard)."""

    def __init__(self, paths: JobPaths, num_requests: int, shard_size: int) -> None:
        self.paths, self.num_requests, self.shard_size = paths, num_requests, shard_size

    def __len__(self) -> int:
        return -(-self.num_requests // self.shard_size)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"shard {index} out of range (the job has {n})")
        first = index * self.shard_size
        return ShardInfo(index, str(self.paths.shard_file(index)),
                         min(self.shard_size, self.num_requests - first), first)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, RegularShards):
            return (self.paths, self.num_requests, self.shard_size) == (
                other.paths, other.num_requests, other.shard_size)
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"RegularShards({len(self)} of {self.shard_size} rows, {self.num_requests} rows)"


def shard_sizes(shards: Sequence[ShardInfo]) -> Iterator[tuple[int, int]]:
    """(shard_id, num_requests) of each shard; for a regular cut without making a ShardInfo (and its
    path) per shard: `status` of a 40,000-shard job asks for nothing else."""
    if isinstance(shards, RegularShards):
        n, size = shards.num_requests, shards.shard_size
        return ((i, min(size, n - i * size)) for i in range(len(shards)))
    return ((s.shard_id, s.num_requests) for s in shards)


def _regular(shards: Sequence[ShardInfo], num_requests: int, shard_size: int) -> bool:
    """Whether `shards` are the regular cut of `num_requests` rows (paths in the job's shard dir)."""
    if isinstance(shards, RegularShards):
        return (shards.num_requests, shards.shard_size) == (num_requests, shard_size)
    if shard_size < 1 or len(shards) != -(-num_requests // shard_size):
        return False
    for i, s in enumerate(shards):
        want = min(shard_size, num_requests - i * shard_size)
        if (s.shard_id, s.first_row, s.num_requests) != (i, i * shard_size, want) or \
                Path(s.path).name != f"shard-{i:06d}.parquet":
            return False
    return True


def _count(data: dict, key: str, least: int) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{key!r} must be an integer >= {least}, got {value!r}")
    return value


def portable_path(path: str | os.PathLike, root: Path) -> str:
    """`path` relative to the data dir `root` when it lies inside it, else as it is (absolute)."""
    path = Path(path)
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def resolve_portable(text: str, root: Path) -> Path:
    """The absolute path of a `portable_path` written under the data dir `root`."""
    return root / text if not os.path.isabs(text) else Path(text)


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
        return self.root / SHARDS_DIR

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
    """The manifest of `job_id`; FileNotFoundError names the job when there is none, ManifestError
    names the file when it cannot be read."""
    paths = JobPaths.of(data_dir, job_id)
    try:
        text = paths.manifest.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"no job {job_id!r} under {paths.root.parent} (no manifest.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(paths.manifest, exc) from None
    try:
        return JobManifest.from_json(text, data_dir)
    except (ValueError, TypeError, KeyError) as exc:
        raise ManifestError(paths.manifest, exc) from None


class ManifestError(ValueError):
    """A job's manifest.json that cannot be read (truncated, edited, written by something else)."""

    def __init__(self, path: Path, cause: BaseException) -> None:
        why = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        super().__init__(f"{path} is unreadable ({why}): restore it from a copy of the data dir, or run "
                         "`batchgen store check --repair` to rebuild it from the store's record of the job")
        self.path = path


def rebuild_manifest(data_dir: str | os.PathLike, job_id: str, config: str) -> JobManifest:
    """A job's manifest written again from the store's record of it (the `jobs` view's `config`: the
    manifest as written, but its shard list) and its shard files; ManifestError when they disagree."""
    paths = JobPaths.of(data_dir, job_id)
    data = json.loads(config)
    data.pop("data_dir", None)  # recorded by batchgen versions before data dirs were portable
    data["shards"], rows = [], 0
    for shard_id, path in enumerate(sorted(paths.shards.glob("shard-*.parquet"))):
        try:
            num_rows = pq.read_metadata(path).num_rows
        except (OSError, pa.ArrowException) as exc:
            cause = ShardFileError(f"shard file {path} is unreadable ({exc})")
            raise ManifestError(paths.manifest, cause) from None
        if path != paths.shard_file(shard_id):
            raise ManifestError(paths.manifest, ShardFileError(f"{paths.shard_file(shard_id)} is missing"))
        data["shards"].append({"shard_id": shard_id, "path": path.name, "num_requests": num_rows,
                               "first_row": rows})
        rows += num_rows
    if rows != data.get("num_requests"):
        raise ManifestError(paths.manifest, ShardFileError(
            f"the shard files hold {rows} rows, the job's record {data.get('num_requests')}"))
    manifest = JobManifest.from_json(json.dumps(data), data_dir)
    write_manifest(manifest, paths)
    return manifest


def list_job_ids(data_dir: str | os.PathLike) -> list[str]:
    root = jobs_root(data_dir)
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob("*/manifest.json"))


def new_job_id(now: float) -> str:
    return "job-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + new_uid()[:6]


# ---------------------------------------------------------------- shard files


class ShardWriter:
    """Cuts a stream of input batches into shard files of `shard_size` rows, in input order (the
    regular cut `RegularShards` describes); holds at most one shard's rows."""

    def __init__(self, directory: Path, shard_size: int) -> None:
        self.directory = directory
        self.shard_size = shard_size
        self.num_shards = 0  # written so far
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._next_row = 0

    def add(self, batch: pa.RecordBatch, request_ids: pa.Array | list[str]) -> None:
        rows = pa.array(np.arange(self._next_row, self._next_row + batch.num_rows, dtype=np.int64))
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

    def close(self) -> int:
        """Write the last (shorter) shard; the number of shards."""
        if self._pending_rows:
            self._write()
        return self.num_shards

    def _write(self) -> None:
        table = pa.Table.from_batches(self._pending)
        path = self.directory / f"shard-{self.num_shards:06d}.parquet"
        pq.write_table(table, path, compression="zstd")
        self.num_shards += 1
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
