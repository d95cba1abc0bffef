"""A job's output as one file: every input row exactly once (n rows for n samples), in input order.

Rows come from the `outputs` view (committed attempts only). A row with no output yet is written
only when it will never get one: its shard failed for good (finish_reason "error", the shard's
error as the message) or its job was cancelled first ("cancelled"). A job still running cannot be
exported.

The file's suffix says its format: `.parquet`, or `.jsonl` (one JSON object per output row; for a
job whose input was OpenAI Batch request lines, the OpenAI batch output instead: one line per
request, failed requests in `<name>.errors.jsonl` beside it, as OpenAI's error file). Any other
suffix is refused before any work (`check_output_path`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from jobs import openai_batch
from jobs.manifest import REQUEST_ID_COLUMN, ROW_COLUMN, URL_COLUMN, JobManifest
from jobs.shards.state import ShardState, from_view_status
from jobs.store import INTERNAL_PREFIX, OUTPUTS, connect, new_uid, unreadable_part_message

OUTPUT_SUFFIXES = (".parquet", ".jsonl")
_ORDER = "_bg_order"


class ExportError(Exception):
    """The job's output cannot be written (yet)."""


@dataclass
class Exported:
    """What `export_job` wrote."""

    path: Path  # the output file
    rows: int  # output rows in the job (one per sample)
    lines: int = 0  # JSONL lines written to `path`
    errors_path: Path | None = None  # OpenAI batch output: the errors file
    error_lines: int = 0  # lines written to `errors_path`

    def describe(self) -> str:
        if self.errors_path is None:
            return f"wrote {self.rows} rows to {self.path}"
        return (f"wrote {self.lines} responses to {self.path} and {self.error_lines} failed requests to "
                f"{self.errors_path}")


def check_output_path(path: str | os.PathLike) -> Path:
    """The absolute output path; ExportError unless it ends in .parquet or .jsonl."""
    resolved = Path(path).expanduser().resolve()
    if resolved.suffix.lower() not in OUTPUT_SUFFIXES:
        raise ExportError(f"--output {path}: give a .parquet or .jsonl file (the suffix says the format), "
                          f"got {resolved.suffix or 'no suffix'!r}")
    return resolved


def errors_path(path: Path) -> Path:
    """Where failed requests go beside an OpenAI batch output file: out.jsonl -> out.errors.jsonl."""
    return path.with_name(f"{path.stem}.errors.jsonl")


def export_job(manifest: JobManifest, path: str | os.PathLike) -> Exported:
    """Write the job's output at `path` (atomically) in the format its suffix names."""
    path = check_output_path(path)
    outputs, shards = _committed(manifest)
    shard_states = {s: (status, error, finished) for s, status, error, finished in shards}
    inputs = _input_rows(manifest)
    table = _in_input_order(manifest, _own_columns(manifest, outputs), inputs, shard_states)
    if path.suffix.lower() == ".parquet":
        _write_atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
        return Exported(path, table.num_rows)
    if manifest.input_format == "openai":
        return _write_openai(manifest, table, inputs, shard_states, path)
    lines = _write_lines(path, (_json_row(r) for r in _rows(table)))
    return Exported(path, table.num_rows, lines)


def _committed(manifest: JobManifest) -> tuple[pa.Table, list[tuple]]:
    """The job's committed output rows and its shards' states; ExportError naming the part file when
    the store cannot read them."""
    con = connect(manifest.data_dir)
    try:
        outputs = con.sql("SELECT * FROM outputs WHERE job_id = $job",
                          params={"job": manifest.job_id}).to_arrow_table()
        shards = con.execute("SELECT shard_id, status, error, epoch(finished_at) FROM shards "
                             "WHERE job_id = ?", [manifest.job_id]).fetchall()
    except duckdb.Error as exc:
        raise ExportError(f"job {manifest.job_id}'s output not written: "
                          f"{unreadable_part_message(str(exc))}") from None
    finally:
        con.close()
    return outputs, shards


@dataclass
class _InputRow:
    row: int  # position in the job's input
    shard_id: int
    url: str | None  # the OpenAI request line's url (OpenAI input only)


def _input_rows(manifest: JobManifest) -> dict[str, _InputRow]:
    """Request id -> where it is in the input (from the shard files), in input order."""
    order = {}
    columns = [ROW_COLUMN, REQUEST_ID_COLUMN] + ([URL_COLUMN] if manifest.input_format == "openai" else [])
    for shard in manifest.shards:
        try:
            t = pq.read_table(shard.path, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise ExportError(f"shard file {shard.path} is unreadable, so the rows of shard {shard.shard_id} "
                              f"cannot be listed ({str(exc).strip().splitlines()[0]})") from None
        urls = t.column(URL_COLUMN).to_pylist() if URL_COLUMN in columns else [None] * t.num_rows
        rows, ids = t.column(ROW_COLUMN).to_pylist(), t.column(REQUEST_ID_COLUMN).to_pylist()
        for row, rid, url in zip(rows, ids, urls, strict=True):
            order[rid] = _InputRow(row, shard.shard_id, url)
    return order


def _own_columns(manifest: JobManifest, outputs: pa.Table) -> pa.Table:
    """The view's base columns, `logprobs` where asked, and the job's own extra columns: the view
    also has every other job's extra columns, all null here."""
    base = [f.name for f in OUTPUTS if not f.name.startswith(INTERNAL_PREFIX)]
    logprobs = ["logprobs"] if "logprobs" in outputs.column_names and outputs.column("logprobs").null_count \
        < outputs.num_rows else []
    names = base + logprobs + list(manifest.extra_columns)
    # an extra column no committed part holds yet (every shard failed) is not in the view at all
    columns = [outputs.column(n) if n in outputs.column_names else pa.nulls(outputs.num_rows) for n in names]
    return pa.Table.from_arrays(columns, names=names)


def _in_input_order(manifest: JobManifest, outputs: pa.Table, inputs: dict[str, _InputRow],
                    shards: dict[int, tuple]) -> pa.Table:
    ids = outputs.column("request_id").to_pylist()
    samples = outputs.column("sample_index").to_pylist()
    keys = set(zip(ids, samples, strict=True))
    if len(keys) != len(ids) or not set(ids) <= inputs.keys():
        raise ExportError(f"job {manifest.job_id}: the outputs view holds duplicate or unknown request ids")
    have = set(ids)
    missing = [rid for rid in inputs if rid not in have]
    if missing:
        outputs = pa.concat_tables([outputs, _stand_ins(manifest, outputs.schema, missing, inputs, shards)])
    order = pa.array([inputs[r].row for r in outputs.column("request_id").to_pylist()], pa.int64())
    ordered = outputs.append_column(_ORDER, order).sort_by([(_ORDER, "ascending"),
                                                            ("sample_index", "ascending")])
    return ordered.drop_columns([_ORDER])


def _stand_ins(manifest: JobManifest, schema: pa.Schema, missing: list[str], inputs: dict[str, _InputRow],
               shards: dict[int, tuple]) -> pa.Table:
    """Rows that will never get an output: their shard failed, or the job was cancelled."""
    rows = []
    for rid in missing:
        shard_id = inputs[rid].shard_id
        status, error, _ = shards.get(shard_id, (ShardState.QUEUED.view_status, None, None))
        state = from_view_status(status)
        if state is ShardState.FAILED:
            rows.append(_stand_in(manifest, rid, "error", f"shard {shard_id} failed: {error}"))
        elif state is ShardState.CANCELLED:
            rows.append(_stand_in(manifest, rid, "cancelled", "job cancelled before this row ran"))
        else:
            raise ExportError(f"job {manifest.job_id} is not finished: shard {shard_id} is {status} "
                              f"(request {rid!r} has no output yet)")
    return pa.Table.from_pylist(rows, schema=schema)


def _stand_in(manifest: JobManifest, rid: str, reason: str, error: str) -> dict:
    return {"job_id": manifest.job_id, "request_id": rid, "sample_index": 0, "output_text": None,
            "finish_reason": reason, "prompt_tokens": 0, "output_tokens": 0, "error": error,
            "model": manifest.model}


# ---------------------------------------------------------------- JSONL


def _write_openai(manifest: JobManifest, table: pa.Table, inputs: dict[str, _InputRow],
                  shards: dict[int, tuple], path: Path) -> Exported:
    """The OpenAI batch output: succeeded requests at `path`, failed ones in the errors file."""
    ok, failed = [], []
    for rid, samples in _requests(table):
        where = inputs[rid]
        status, _, finished = shards.get(where.shard_id, (ShardState.QUEUED.view_status, None, None))
        failed_shard = from_view_status(status) is ShardState.FAILED
        line, good = openai_batch.output_line(manifest.job_id, rid, where.url, samples,
                                              server_error=failed_shard, created=int(finished or 0))
        (ok if good else failed).append(json.dumps(line, ensure_ascii=False))
    err_path = errors_path(path)
    _write_lines(path, iter(ok))
    _write_lines(err_path, iter(failed))
    return Exported(path, table.num_rows, len(ok), err_path, len(failed))


def _requests(table: pa.Table) -> Iterator[tuple[str, list[dict]]]:
    """(request id, its output rows) in order: the rows of one request are adjacent."""
    current, samples = None, []
    for row in _rows(table):
        if row["request_id"] != current and samples:
            yield current, samples
            samples = []
        current = row["request_id"]
        samples.append(row)
    if samples:
        yield current, samples


def _rows(table: pa.Table) -> Iterator[dict]:
    for batch in table.to_batches(max_chunksize=4096):
        yield from batch.to_pylist()


def _json_row(row: dict) -> str:
    return json.dumps({k: _json_safe(v) for k, v in row.items()}, ensure_ascii=False, default=str)


def _json_safe(value):
    """NaN and infinities are not JSON: they become null (as pandas' to_json writes them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def _write_lines(path: Path, lines: Iterator[str]) -> int:
    count = [0]

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as out:
            for line in lines:
                out.write(line + "\n")
                count[0] += 1

    _write_atomic(path, write)
    return count[0]


def _write_atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{new_uid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
