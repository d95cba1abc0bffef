"""Where the store keeps things under DATA_DIR, the schema version, and data dir set-up.

See the package docstring (`jobs.store`) for the layout as a picture. This module only computes
paths, validates the ids that become path components, and writes the small fixed files (the
version file and each kind's zero-row `_schema.parquet`) atomically, so any number of processes may
call `init_data_dir` at once.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.store.schemas import KIND_SCHEMAS, ROLLED_UP_KIND, ROLLUPS, SAMPLE_TWINS, SAMPLED_KIND

# Bump when the part schemas or their meaning change; add a migration to MIGRATIONS below.
# v2: commits gain `lost` (a row that revokes a commit whose rows were lost; null in a commit).
# v3: commits gain the attempt's request outcome counts (`requests_completed`, `requests_failed`,
#     `requests_cancelled`, `error_rows`; null in older commits, whose jobs are counted from the outputs).
SCHEMA_VERSION = 3
CATALOG_NAME = "batchgen.duckdb"
STORE_DIR = "store"
ROLLUPS_DIR = "rollups"  # under store/: rollup twins of compacted files (jobs.store.rollups)
DEFAULT_DATA_DIR = "./data"
DATA_DIR_ENV = "BATCHGEN_DATA_DIR"

# The Parquet codec of each kind's files (raw parts, compacted files, twins). The kinds every dashboard
# query and `status` reads (the commits, shard events, job records and events, request digests and
# the twins of the compacted files, jobs.store.rollups) are written uncompressed: their files are a
# small share of a data dir, and decompressing them was a share of each query's CPU (docs/benchmarks.md,
# "Uncompressed metadata"); the rows users read in bulk (outputs, requests, iterations, sweeps) stay zstd.
UNCOMPRESSED_KINDS = frozenset({"job_records", "job_events", "shard_events", "commits", "request_digests"})


TWIN_CODEC = "uncompressed"
SCHEMA_FILE = "_schema.parquet"  # a kind's (or its twins') zero-row file: the glob is never empty


def codec(kind: str) -> str:
    """The Parquet codec of `kind`'s files, as DuckDB's COPY and pyarrow name it (its twins': TWIN_CODEC)."""
    return "uncompressed" if kind in UNCOMPRESSED_KINDS else "zstd"


_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class StoreError(Exception):
    """A data dir that cannot be used as it is (missing, newer schema, bad id, ...)."""


def check_id(what: str, value: str) -> str:
    """An id that becomes a path component: letters, digits, '.', '_', '-', at most 128 chars."""
    if not isinstance(value, str) or not _ID_RE.match(value) or ".." in value:
        raise StoreError(
            f"{what} {value!r} is not a valid id: use 1-128 of [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return value


def path_safe(value: str) -> str:
    """A free-form name (a worker id such as celery@host) made safe for one path component."""
    safe = _UNSAFE.sub("_", value)[:100].strip(".") or "_"
    return safe


def new_uid() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Layout:
    """Absolute paths of one data dir. Every path a view or a writer uses comes from here."""

    root: Path  # DATA_DIR, absolute and resolved

    @classmethod
    def of(cls, data_dir: str | os.PathLike) -> Layout:
        return cls(Path(data_dir).expanduser().resolve())

    @property
    def catalog(self) -> Path:
        return self.root / CATALOG_NAME

    @property
    def store(self) -> Path:
        return self.root / STORE_DIR

    @property
    def version_file(self) -> Path:
        return self.store / "version.json"

    @property
    def tmp(self) -> Path:
        return self.store / "tmp"

    @property
    def gc(self) -> Path:
        return self.store / "gc"

    @property
    def locks(self) -> Path:
        return self.store / "locks"

    def kind_dir(self, kind: str) -> Path:
        return self.store / "tables" / kind

    def raw_dir(self, kind: str, group: str) -> Path:
        return self.kind_dir(kind) / "raw" / group

    def compacted_dir(self, kind: str, group: str) -> Path:
        return self.kind_dir(kind) / "compacted" / group

    def rollup_dir(self, kind: str) -> Path:
        """Where the twins of a kind's compacted files go (jobs.store.rollups)."""
        return self.store / ROLLUPS_DIR / kind

    def schema_file(self, kind: str) -> Path:
        return self.kind_dir(kind) / SCHEMA_FILE

    def twin_schema_file(self, kind: str) -> Path:
        return self.rollup_dir(kind) / SCHEMA_FILE

    def relative(self, path: Path) -> str:
        """How a file of the data dir is named in files the store writes (tombstones): relative to
        DATA_DIR, so a copied or moved data dir names its own files, never the original's."""
        return path.relative_to(self.root).as_posix()

    def file(self, name: str) -> Path:
        """The file a `relative` name stands for. An absolute name (written by batchgen before data
        dirs were portable) is taken from its `store/` on, under this data dir."""
        if not os.path.isabs(name):
            return self.root / name
        parts = Path(name).parts
        tail = max((i for i, p in enumerate(parts) if p == STORE_DIR), default=None)
        return self.root.joinpath(*parts[tail:]) if tail is not None else Path(name)

    def glob(self, kind: str) -> str:
        """One glob over a kind's schema file, raw parts and compacted files ('compacted' < 'raw')."""
        return str(self.kind_dir(kind) / "**" / "*.parquet")


def write_atomic(path: Path, data: bytes, tmp_dir: Path) -> None:
    """Write bytes under a temporary name in tmp_dir, fsync, and rename into place."""
    tmp = tmp_dir / f"{new_uid()}.{path.name}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_table_atomic(table: pa.Table, path: Path, tmp_dir: Path, compression: str = "zstd") -> None:
    """Write a Parquet file under a temporary name outside every glob and rename it into place."""
    tmp = tmp_dir / f"{new_uid()}.{path.name}.tmp"
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression="none" if compression == "uncompressed" else compression)
            fh.flush()
            os.fsync(fh.fileno())
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_version(layout: Layout) -> int | None:
    """The schema version recorded in the data dir, or None when the store was never set up."""
    try:
        return int(json.loads(layout.version_file.read_text())["schema_version"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{layout.version_file} is unreadable ({exc}); it should hold "
                         f'{{"schema_version": {SCHEMA_VERSION}}}') from exc


def init_data_dir(data_dir: str | os.PathLike, *, create: bool = True) -> Layout:
    """Set up (idempotently) the store under data_dir and check its schema version.

    With create=False a missing data dir is an error instead of being created (readers use this so
    a typo in --data-dir is reported, not silently turned into an empty store).
    """
    layout = Layout.of(data_dir)
    if not layout.root.is_dir():
        if not create:
            raise StoreError(f"data dir {layout.root} does not exist (set --data-dir or {DATA_DIR_ENV})")
        layout.root.mkdir(parents=True, exist_ok=True)
    version = read_version(layout)
    if version is not None and version != SCHEMA_VERSION:
        migrate(layout, version)
    _make_dirs(layout)
    if version is None:
        _write_version(layout)
    _write_schema_files(layout)
    return layout


def _make_dirs(layout: Layout) -> None:
    for path in (layout.tmp, layout.gc, layout.locks):
        path.mkdir(parents=True, exist_ok=True)
    for kind in KIND_SCHEMAS:
        (layout.kind_dir(kind) / "raw").mkdir(parents=True, exist_ok=True)
        (layout.kind_dir(kind) / "compacted").mkdir(parents=True, exist_ok=True)


def _write_version(layout: Layout) -> None:
    body = json.dumps({"schema_version": SCHEMA_VERSION}).encode()
    write_atomic(layout.version_file, body, layout.tmp)


def _write_schema_files(layout: Layout) -> None:
    """A zero-row file per kind keeps its glob non-empty and fixes the base column types; one for the
    twins of each kind that has them keeps their list in a listing non-empty (jobs.store.rollups)."""
    files = [(layout.schema_file(kind), schema) for kind, schema in KIND_SCHEMAS.items()]
    files.append((layout.twin_schema_file(ROLLED_UP_KIND), ROLLUPS))
    files.append((layout.twin_schema_file(SAMPLED_KIND), SAMPLE_TWINS))
    for path, schema in files:
        found = _schema_of(path) if path.exists() else None
        if found is not None and found.equals(schema, check_metadata=False):
            continue
        write_table_atomic(schema.empty_table(), path, layout.tmp)


def _schema_of(path: Path) -> pa.Schema | None:
    """The schema of a Parquet file, or None when it cannot be read (then it is written anew)."""
    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError):
        return None


# ---------------------------------------------------------------- migrations


def _nothing_to_rewrite(layout: Layout) -> None:
    """A migration whose new columns are nullable: parts written before read them as null."""


# version -> function(layout) upgrading a data dir written at that version to version + 1.
MIGRATIONS: dict[int, object] = {1: _nothing_to_rewrite, 2: _nothing_to_rewrite}


def migrate(layout: Layout, version: int) -> None:
    """Bring a data dir written at schema `version` up to SCHEMA_VERSION, or say what to do."""
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"data dir {layout.root} was written by a newer batchgen (store schema v{version}; this one "
            f"reads v{SCHEMA_VERSION}): upgrade batchgen, or point --data-dir elsewhere"
        )
    while version < SCHEMA_VERSION:
        step = MIGRATIONS.get(version)
        if step is None:
            raise StoreError(
                f"data dir {layout.root} has store schema v{version} and this batchgen (v{SCHEMA_VERSION}) "
                f"has no migration from it: read it with the batchgen release that wrote it and export what "
                f"you need, or start a new data dir"
            )
        step(layout)  # type: ignore[operator]
        version += 1
        body = json.dumps({"schema_version": version}).encode()
        write_atomic(layout.version_file, body, layout.tmp)
