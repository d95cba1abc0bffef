"""The store's half of `batchgen store check` (jobs.repair): part files that cannot be read, and
committed rows that are gone.

`check_store(data_dir)` reads every Parquet file under `store/tables/` and `store/rollups/` (its footer,
and with `deep=True` every row group) and says, for each one that fails, what its rows were:

- `_schema.parquet` (a kind's zero-row schema file): **re-derivable**, the next connection writes it anew;
- a twin under `store/rollups/` (jobs.store.rollups: the iterations' rollups, the request digests'
  samples): **re-derivable**, the views compute it from its compacted file's rows once it is moved aside;
- a raw part whose `_bg_part` rows are in a readable compacted file of its group: **re-derivable**
  (the views take those rows from the compacted file);
- a compacted file whose merged inputs are all still on disk and readable (its compaction's tombstone
  under `store/gc/` lists them): **re-derivable**; quarantining it also moves that tombstone aside,
  so the inputs count again, are compacted anew and are not garbage-collected;
- anything else: **lost** (a raw part's rows that were never compacted; a compacted file whose inputs
  were already collected). A lost outputs part of a committed shard also shows below as missing rows.

It also compares each committed shard's `num_outputs` with the output rows the views find for it: a
shard with fewer has **missing rows** (a part file gone or unreadable).

`quarantine(data_dir, bad)` moves the bad files (and tombstones) to `DATA_DIR/quarantine/<time>/`
under their path relative to the data dir, so nothing is deleted and the views read the rest. Marking
the shards whose rows were lost for re-run is the jobs layer's (its shard ledger writes both the
store's revocation and the lease): jobs.repair.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from jobs.store.layout import ROLLUPS_DIR, Layout, init_data_dir
from jobs.store.schemas import PART_COLUMN, ROLLED_UP_KIND

QUARANTINE_DIR = "quarantine"
_COMPACTED_TIME = re.compile(r"^c(\d{16})~")


@dataclass
class BadFile:
    """A part file that cannot be read, and what that costs."""

    path: Path  # absolute
    kind: str  # outputs, requests, iterations, ...
    group: str  # the job / worker / sweep directory ('' for the schema file)
    error: str  # why it cannot be read (one line)
    fate: str  # 're-derivable' or 'lost'
    detail: str  # where its rows are, or what was lost
    also_move: list[Path] = field(default_factory=list)  # a compacted file's tombstone

    def describe(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}: {self.fate}: {self.detail} ({self.error})"


@dataclass
class MissingRows:
    """A committed shard whose output rows are fewer than its commit recorded."""

    job_id: str
    shard_id: int
    committed: int  # num_outputs of its commit
    found: int  # output rows the views find for its committed attempt

    @property
    def what(self) -> str:
        return f"{self.committed - self.found} of {self.committed} committed output rows missing"

    def describe(self) -> str:
        return f"job {self.job_id} shard {self.shard_id}: {self.what} (lost: the shard must run again)"


@dataclass
class CheckReport:
    bad: list[BadFile]  # unreadable files
    missing: list[MissingRows]  # committed shards short of rows (only when outputs are readable)
    files_checked: int

    @property
    def healthy(self) -> bool:
        return not self.bad and not self.missing


def check_store(data_dir: str | os.PathLike, *, deep: bool = True) -> CheckReport:
    layout = init_data_dir(data_dir, create=False)
    files = sorted(layout.store.joinpath("tables").rglob("*.parquet"))
    files += sorted(layout.store.joinpath(ROLLUPS_DIR).rglob("*.parquet"))
    errors = {path: err for path in files if (err := _unreadable(path, deep)) is not None}
    bad = [_classify(layout, path, err, errors) for path, err in errors.items()]
    outputs_bad = any(b.kind == "outputs" for b in bad)
    missing = [] if outputs_bad else missing_rows(layout.root)
    return CheckReport(bad, missing, len(files))


def _unreadable(path: Path, deep: bool) -> str | None:
    """None when the file reads (footer; with deep, every row group), else the error in one line."""
    try:
        with pq.ParquetFile(path) as pf:
            if deep:
                for i in range(pf.num_row_groups):
                    pf.read_row_group(i)
    except FileNotFoundError:
        return None  # removed while we listed (garbage collection): not a bad file
    except Exception as exc:  # noqa: BLE001 - any failure to read is what we report
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return None


def _where(layout: Layout, path: Path) -> tuple[str, str, str]:
    """(kind, 'raw' | 'compacted' | 'schema' | 'rollups', group) of a file under store/tables/ (or
    store/rollups/: a rollup twin, or their schema file)."""
    if path.is_relative_to(layout.store / ROLLUPS_DIR):
        parts = path.relative_to(layout.store / ROLLUPS_DIR).parts
        return parts[0], "schema" if len(parts) == 2 else "rollups", parts[1] if len(parts) > 2 else ""
    parts = path.relative_to(layout.store / "tables").parts
    if len(parts) == 2:
        return parts[0], "schema", ""
    return parts[0], parts[1], parts[2] if len(parts) > 3 else ""


def _classify(layout: Layout, path: Path, error: str, errors: dict[Path, str]) -> BadFile:
    kind, where, group = _where(layout, path)
    if where == "schema":
        return BadFile(path, kind, group, error, "re-derivable", "the kind's empty schema file, written anew")
    if where == "rollups":
        what = "per-second rollups" if kind == ROLLED_UP_KIND else "the sampled request rows"
        return BadFile(path, kind, group, error, "re-derivable",
                       f"{what} of {path.name} (its twin): computed from its rows once moved aside")
    if where == "raw":
        holder = _compacted_holder(layout, kind, group, path.name, errors)
        if holder is not None:
            return BadFile(path, kind, group, error, "re-derivable", f"its rows are in {holder.name}")
        return BadFile(path, kind, group, error, "lost", f"{kind} rows of {group} never compacted")
    tomb = _tombstone_of(layout, kind, group, path.name)
    inputs = [layout.file(p) for p in json.loads(tomb.read_text())["files"]] if tomb else []
    gone = [p for p in inputs if not p.exists() or p in errors]
    if tomb is not None and inputs and not gone:
        return BadFile(path, kind, group, error, "re-derivable",
                       f"its rows are in the {len(inputs)} files it merged, still on disk", [tomb])
    why = "its merged inputs were garbage-collected" if tomb is None else f"{len(gone)} merged inputs gone"
    return BadFile(path, kind, group, error, "lost", f"{kind} rows of {group}: {why}")


def _compacted_holder(layout: Layout, kind: str, group: str, part: str, errors: dict) -> Path | None:
    """A readable compacted file of the group that holds rows of raw part `part`, if any."""
    for compacted in sorted(layout.compacted_dir(kind, group).glob("*.parquet")):
        if compacted in errors:
            continue
        names = pq.read_table(compacted, columns=[PART_COLUMN]).column(PART_COLUMN)
        if part in set(names.unique().to_pylist()):
            return compacted
    return None


def _tombstone_of(layout: Layout, kind: str, group: str, name: str) -> Path | None:
    """The tombstone written by the compaction that made compacted file `name` (the first one
    written at or after the time in its name)."""
    match = _COMPACTED_TIME.match(name)
    if match is None:
        return None
    named_at = (10**16 - int(match.group(1))) / 1e6
    tombs = []
    for tomb in layout.gc.glob(f"{kind}~{group}~*.json"):
        at = json.loads(tomb.read_text()).get("superseded_at", 0.0)
        if at >= named_at:
            tombs.append((at, tomb))
    return min(tombs)[1] if tombs else None


_MISSING_SQL = """
SELECT w.job_id, w.shard_id, any_value(w.num_outputs) AS committed, count(o.job_id) AS found
FROM _bg.winners AS w
LEFT JOIN _bg.scan_outputs AS o ON o.job_id = w.job_id AND o._bg_attempt_id = w._bg_attempt_id
GROUP BY w.job_id, w.shard_id HAVING count(o.job_id) < any_value(w.num_outputs)
ORDER BY w.job_id, w.shard_id
"""


def missing_rows(data_dir: str | os.PathLike) -> list[MissingRows]:
    """Committed shards whose output rows the views do not all find ([] while outputs or commits
    cannot be read at all)."""
    from jobs.store.catalog import connect_reporting

    con, broken = connect_reporting(data_dir)
    try:
        if "commits" in broken or "outputs" in broken:
            return []
        return [MissingRows(*row) for row in con.execute(_MISSING_SQL).fetchall()]
    finally:
        con.close()


def quarantine(data_dir: str | os.PathLike, bad: list[BadFile]) -> Path:
    """Move the bad files (and a compacted file's tombstone) under DATA_DIR/quarantine/<time>/; the folder."""
    layout = Layout.of(data_dir)
    target = layout.root / QUARANTINE_DIR / time.strftime("%Y%m%dT%H%M%S")
    for item in bad:
        for path in (item.path, *item.also_move):
            dest = target / path.relative_to(layout.root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
    init_data_dir(layout.root)  # writes a quarantined schema file anew
    return target

