"""A job's output as one Parquet file: every input row exactly once, in input order.

Rows come from the `outputs` view (committed attempts only). A row with no output yet is written
only when it will never get one: its shard failed for good (finish_reason "error", the shard's
error as the message) or its job was cancelled first ("cancelled"). A job still running cannot be
exported.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobs.manifest import REQUEST_ID_COLUMN, ROW_COLUMN, JobManifest
from jobs.store.catalog import connect
from jobs.store.layout import new_uid


class ExportError(Exception):
    """The job's output cannot be written (yet)."""


def export_job(manifest: JobManifest, path: str | os.PathLike) -> pa.Table:
    """Write the job's output Parquet at `path` (atomically) and return it."""
    con = connect(manifest.data_dir)
    try:
        outputs = con.sql("SELECT * FROM outputs WHERE job_id = $job",
                          params={"job": manifest.job_id}).to_arrow_table()
        shards = con.execute("SELECT shard_id, status, error FROM shards WHERE job_id = ?",
                             [manifest.job_id]).fetchall()
    finally:
        con.close()
    table = _in_input_order(manifest, outputs, {s: (status, error) for s, status, error in shards})
    _write_atomic(table, Path(path))
    return table


def _in_input_order(manifest: JobManifest, outputs: pa.Table,
                    shards: dict[int, tuple[str, str | None]]) -> pa.Table:
    order = _input_order(manifest)  # request id -> (input row, shard id)
    ids = outputs.column("request_id").to_pylist()
    have = set(ids)
    if len(have) != len(ids) or not have <= order.keys():
        raise ExportError(f"job {manifest.job_id}: the outputs view holds duplicate or unknown request ids")
    missing = [rid for rid in order if rid not in have]
    if missing:
        outputs = pa.concat_tables([outputs, _stand_ins(manifest, outputs.schema, missing, order, shards)])
    rows = pc.array_sort_indices(pa.array([order[r][0] for r in outputs.column("request_id").to_pylist()]))
    return outputs.take(rows)


def _input_order(manifest: JobManifest) -> dict[str, tuple[int, int]]:
    order = {}
    for shard in manifest.shards:
        t = pq.read_table(shard.path, columns=[ROW_COLUMN, REQUEST_ID_COLUMN])
        rows, ids = t.column(ROW_COLUMN).to_pylist(), t.column(REQUEST_ID_COLUMN).to_pylist()
        for row, rid in zip(rows, ids, strict=True):
            order[rid] = (row, shard.shard_id)
    return order


def _stand_ins(manifest: JobManifest, schema: pa.Schema, missing: list[str], order: dict,
               shards: dict[int, tuple[str, str | None]]) -> pa.Table:
    """Rows that will never get an output: their shard failed, or the job was cancelled."""
    rows = []
    for rid in missing:
        shard_id = order[rid][1]
        status, error = shards.get(shard_id, ("queued", None))
        if status == "failed":
            rows.append(_stand_in(manifest.job_id, rid, "error", f"shard {shard_id} failed: {error}"))
        elif status == "cancelled":
            rows.append(_stand_in(manifest.job_id, rid, "cancelled", "job cancelled before this row ran"))
        else:
            raise ExportError(f"job {manifest.job_id} is not finished: shard {shard_id} is {status} "
                              f"(request {rid!r} has no output yet)")
    return pa.Table.from_pylist(rows, schema=schema)


def _stand_in(job_id: str, rid: str, reason: str, error: str) -> dict:
    return {"job_id": job_id, "request_id": rid, "output_text": None, "finish_reason": reason,
            "prompt_tokens": 0, "output_tokens": 0, "error": error}


def _write_atomic(table: pa.Table, path: Path) -> None:
    path = path.expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{new_uid()}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
