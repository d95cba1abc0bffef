"""Peak memory and time of one compaction merge against the rows it merges.

    python -m benchmarks.compact_memory --rows 1000000 --text-bytes 1500 [--limits 512MB,1000GB]
        [--dedup auto,always] [--unsorted]

Writes one job's outputs (`--rows` rows of `--text-bytes` bytes of output text each, in shards of
`--shard-size` rows: one part per shard, through the Store API) into a temporary data dir, then merges
every part into one file as the janitor's compaction of the finished job does (jobs.store.compact's
merge), once per memory limit, each in a fresh process with BATCHGEN_STORE_MERGE_MEMORY set, and reports
its peak RSS and wall time. A limit far above the machine's memory ("1000GB") is the merge as it ran
before the limit: its memory grows with the rows. `--dedup auto,always` merges once as the compactor does
(parts that no two inputs share, as here, are not deduplicated) and once deduplicating all the same, as
it did before, per limit, alternated; `--unsorted` merges as a writer merges outputs (not sorted).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = """
import importlib, json, resource, sys, time
from pathlib import Path
from jobs.store.layout import init_data_dir
compact = importlib.import_module("jobs.store.compact")
if sys.argv[3] == "always":  # as before the compactor told disjoint inputs
    compact.files_disjoint = lambda *args, **kwargs: False
layout = init_data_dir(sys.argv[1])
inputs = sorted(layout.raw_dir("outputs", "mem-job").glob("*.parquet"))
t, cpu = time.perf_counter(), time.process_time()
rows, out = compact._merge(layout, "outputs", inputs, Path(sys.argv[2]), sort=sys.argv[4] == "sorted")
print(json.dumps({"rows": rows, "wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu,
                  "bytes_out": out.stat().st_size,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
out.unlink()
"""


def write_job(data_dir: Path, rows: int, shard_size: int, text_bytes: int) -> int:
    """The job's outputs, one part per shard; the bytes of output text written."""
    from jobs.store import JobRecord, Store

    rng = random.Random(0)
    store = Store(data_dir, compact_as_written=False)
    store.record_job(JobRecord("mem-job", "tiny", rows, -(-rows // shard_size), time.time()))
    text = 0
    for shard, lo in enumerate(range(0, rows, shard_size)):
        att = store.begin_attempt("mem-job", shard, 1, "w")
        batch = [{"request_id": str(i), "finish_reason": "stop", "prompt_tokens": 1, "output_tokens": 1,
                  "error": None, "output_text": rng.randbytes(text_bytes // 2).hex()}
                 for i in range(lo, min(rows, lo + shard_size))]
        text += sum(len(r["output_text"]) for r in batch)
        att.add_outputs(batch)
        att.commit()
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--text-bytes", type=int, default=1500, help="bytes of output text per row")
    ap.add_argument("--shard-size", type=int, default=4096, help="rows per shard (one part each)")
    ap.add_argument("--limits", default="512MB,1000GB",
                    help="comma-separated BATCHGEN_STORE_MERGE_MEMORY values, one merge each")
    ap.add_argument("--dedup", default="auto",
                    help="comma-separated: auto (as the compactor merges), always (deduplicating, as "
                         "before it told disjoint inputs); one merge each per limit, alternated")
    ap.add_argument("--unsorted", action="store_true", help="merge unsorted, as a writer merges outputs")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if bad := [d for d in args.dedup.split(",") if d not in ("auto", "always")]:
        raise SystemExit(f"--dedup: auto or always, got {bad[0]!r}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bg-compact-memory-") as tmp:
        data_dir = Path(tmp) / "data"
        t = time.time()
        text = write_job(data_dir, args.rows, args.shard_size, args.text_bytes)
        print(f"{args.rows:,} output rows ({text / 1e6:,.0f} MB of text) written in {time.time() - t:.0f} s",
              flush=True)
        sort = "unsorted" if args.unsorted else "sorted"
        for limit in args.limits.split(","):
            for dedup in args.dedup.split(","):
                env = {**os.environ, "BATCHGEN_STORE_MERGE_MEMORY": limit}
                done = subprocess.run([sys.executable, "-c", _CHILD, str(data_dir), str(Path(tmp) / "out"),
                                       dedup, sort], env=env, capture_output=True, text=True)
                what = f"limit {limit:>8}, dedup {dedup:>6}, {sort}"
                if done.returncode:
                    lines = [ln for ln in done.stderr.strip().splitlines() if "Error" in ln] or ["killed"]
                    result = {"limit": limit, "dedup": dedup, "sort": sort, "error": lines[-1]}
                    print(f"{what}: failed: {result['error']}", flush=True)
                else:
                    result = {"limit": limit, "dedup": dedup, "sort": sort,
                              **json.loads(done.stdout.strip().splitlines()[-1])}
                    print(f"{what}: {result['rows']:,} rows merged in {result['wall_s']:.1f} s "
                          f"({result['cpu_s']:.1f} s CPU), peak RSS {result['peak_rss_mb']:,.0f} MB",
                          flush=True)
                results.append(result)
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "text_bytes": args.text_bytes,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
