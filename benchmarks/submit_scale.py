"""`batchgen submit` at 1M, 10M, 100M rows: wall time and peak RSS.

    python -m benchmarks.submit_scale --rows 1000000,10000000 [--workdir DIR] [--keep] [--trace-rss]

For each size, a Parquet file of short prompts (an `id` column of distinct strings, so the duplicate
id check does its full work, and a `prompt` column) is written to disk a row group at a time, never
held whole; then `batchgen submit` runs on it in a child process on the embedded broker, into a fresh
data dir, and the child's wall time and peak RSS (its ru_maxrss) are reported with the data dir's
size. The input files and data dirs are deleted afterwards unless --keep; with --workdir and
--reuse-input an input file already there with the right row count is used again (a 100M-row file takes
minutes to write). --trace-rss runs the submit under benchmarks/submit_trace.py and prints its memory
phase by phase (reading and shard writing, the id check, the manifest, the queued events, the broker
messages): VmRSS at each phase's end and its highest, glibc's heap in use and free, Arrow's pool, the
live Python objects; --tracemalloc and --trim add that script's options of the same names.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROW_GROUP_ROWS = 500_000


def write_prompts(path: Path, rows: int, row_group_rows: int = ROW_GROUP_ROWS) -> None:
    """`rows` short prompts, written a row group at a time (memory bounded by one row group)."""
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string())])
    rng = np.random.default_rng(0)
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for start in range(0, rows, row_group_rows):
            n = min(row_group_rows, rows - start)
            numbers = pa.array(np.arange(start, start + n, dtype=np.int64)).cast(pa.string())
            ids = pc.binary_join_element_wise("req-", numbers, "")
            topics = pa.array(rng.integers(0, 10**9, n)).cast(pa.string())  # poorly compressible
            prompts = pc.binary_join_element_wise("Describe ", topics, ".", "")
            writer.write_table(pa.table({"id": ids, "prompt": prompts}, schema=schema))


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def submit_child(source: Path, data_dir: Path, shard_size: int | None, tree: Path,
                 trace: list[str] | None = None) -> dict:
    """Run `batchgen submit` of the source tree `tree` in a child process; its wall time, peak RSS
    and output; with `trace` (submit_trace.py's options), its phases too (under "trace")."""
    args = ["submit", str(source), "--data-dir", str(data_dir), "--broker", "embedded"]
    if shard_size:
        args += ["--shard-size", str(shard_size)]
    trace_out = data_dir.parent / f"{data_dir.name}.trace.json"
    if trace is None:
        cmd = [sys.executable, "-c", "from jobs.cli import main; main()", *args]
    else:  # the script of this tree, the code of `tree`
        cmd = [sys.executable, str(Path(__file__).with_name("submit_trace.py")), str(trace_out), *trace, "--",
               *args]
    code = ("import resource, subprocess, sys, time, json\n"
            "t = time.perf_counter()\n"
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "wall = time.perf_counter() - t\n"
            "ru = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print(json.dumps({'rc': p.returncode, 'wall_s': wall, 'maxrss_kb': ru.ru_maxrss,\n"
            "                  'out': p.stdout[-2000:], 'err': p.stderr[-4000:]}))\n")
    # a fresh intermediate process, so RUSAGE_CHILDREN holds the submit alone
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, check=True,
                          env=env, cwd=tree)
    run = json.loads(done.stdout)
    if trace is not None and trace_out.exists():
        run["trace"] = json.loads(trace_out.read_text())
        trace_out.unlink()
    return run


def print_trace(trace: dict) -> None:
    """One line per phase of a traced submit (MB)."""
    mb = lambda v: f"{v / 1e6:,.0f}" if isinstance(v, (int, float)) else "-"
    print(f"  (Arrow C++'s default pool: {trace.get('arrow_pool')})")
    print(f"  {'phase':<14} {'wall s':>8} {'RSS in':>7} {'RSS out':>7} {'RSS max':>7} {'anon max':>8} "
          f"{'heap used':>9} {'heap free':>9} {'arrow':>6} {'py objs':>9} {'trim':>6}")
    for ph in trace["phases"]:
        print(f"  {ph['phase']:<14} {ph.get('wall_s', 0):>8.1f} {mb(ph['rss_in']):>7} "
              f"{mb(ph.get('rss_out')):>7} {mb(ph['rss_max']):>7} {mb(ph['anon_max']):>8} "
              f"{mb(ph.get('heap_in_use')):>9} {mb(ph.get('heap_free')):>9} {mb(ph.get('arrow_out')):>6} "
              f"{ph.get('python_objects', 0):>9,} "
              f"{mb(ph.get('trim_gave_back')):>6}")
        for line in ph.get("tracemalloc_top", []):
            print(f"      {line}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1000000,10000000", help="comma-separated row counts")
    ap.add_argument("--workdir", default=None, help="where the inputs and data dirs go (default: a temp dir)")
    ap.add_argument("--shard-size", type=int, default=None, help="--shard-size of submit (default: its own)")
    ap.add_argument("--keep", action="store_true", help="keep the input files and data dirs")
    ap.add_argument("--reuse-input", action="store_true",
                    help="use an input file already in --workdir when it has the asked row count")
    ap.add_argument("--trace-rss", action="store_true", help="report the submit's memory phase by phase")
    ap.add_argument("--tracemalloc", action="store_true", help="with --trace-rss: top allocation sites")
    ap.add_argument("--trim", action="store_true",
                    help="with --trace-rss: malloc_trim(0) at each phase's end, reporting what it gave back")
    ap.add_argument("--before", default=None,
                    help="another source tree (e.g. `git archive` of an older commit): each size is "
                         "submitted with it too, in the same run, for a before/after comparison")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.rows.split(",") if s]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bg-submit-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    here = Path(__file__).resolve().parent.parent
    trees = [("this", here)] + ([("before", Path(args.before).resolve())] if args.before else [])
    trace = None
    if args.trace_rss:
        trace = (["--tracemalloc"] if args.tracemalloc else []) + (["--trim"] if args.trim else [])
    try:
        for rows in sizes:
            source = work / f"prompts-{rows}.parquet"
            t = time.perf_counter()
            reuse = args.reuse_input and source.exists() and pq.ParquetFile(source).metadata.num_rows == rows
            if not reuse:
                write_prompts(source, rows)
            gen_s = time.perf_counter() - t
            for name, tree in trees:
                data_dir = work / f"data-{rows}-{name}"
                run = submit_child(source, data_dir, args.shard_size, tree, trace)
                if run["rc"] != 0:
                    print(run["err"], file=sys.stderr)
                    raise SystemExit(f"submit of {rows} rows ({name}) failed (exit {run['rc']})")
                row = {"code": name, "rows": rows, "input_mb": source.stat().st_size / 1e6,
                       "row_groups": pq.ParquetFile(source).num_row_groups, "generate_s": gen_s,
                       "submit_s": run["wall_s"], "peak_rss_mb": run["maxrss_kb"] / 1024,
                       "data_dir_mb": du(data_dir) / 1e6, "files": sum(1 for _ in data_dir.rglob("*"))}
                results.append(row)
                print(json.dumps(row), flush=True)
                if "trace" in run:
                    print_trace(run["trace"])
                    if args.keep:
                        (work / f"trace-{rows}-{name}.json").write_text(json.dumps(run["trace"]))
                    sys.stdout.flush()
                if not args.keep:
                    shutil.rmtree(data_dir)
            if not args.keep and not args.reuse_input:
                source.unlink()
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'code':>6} {'rows':>12} {'input MB':>9} {'groups':>6} {'submit s':>9} {'peak RSS MB':>11} "
          f"{'data dir MB':>11}")
    for r in results:
        print(f"{r['code']:>6} {r['rows']:>12,} {r['input_mb']:>9.1f} {r['row_groups']:>6} "
              f"{r['submit_s']:>9.1f} {r['peak_rss_mb']:>11.0f} {r['data_dir_mb']:>11.1f}")
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"(this process's own peak RSS: {own:.0f} MB)")


if __name__ == "__main__":
    main()
