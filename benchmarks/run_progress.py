"""One progress poll of `batchgen run` / `batchgen status JOB` (jobs.shards.supervise.job_progress) at
10,000 to 390,625 shards: wall time and peak Python heap (tracemalloc).

    python -m benchmarks.run_progress --shards 10000,100000,390625 [--running 256] [--workdir DIR]

For each size a job's manifest (the regular cut, 256-row shards) and its lease directory are written
synthetically as the ledger's writers leave them: 70% of the shards committed, `--running` running
(fresh heartbeats), `--dead` dead (stale heartbeats), 2 failed, the rest never claimed. Then three
polls are timed, each in a fresh call as `batchgen status JOB` makes it: the first (which may build a
summary), a second with nothing changed, and a third after `--running` commits and as many new claims
(the steady state of `batchgen run`: a poll twice a second while shards finish). The claims and commits
go through the lease writers (jobs.shards.leases), so whatever they record for progress is recorded.
Each poll is timed alone, then run again under tracemalloc for its peak heap. The lease TTL is set
to 900 s so that running shards stay running through the setup; dead ones are an hour stale.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

SHARD_SIZE = 256


def write_job(data_dir: Path, job_id: str, num_shards: int) -> None:
    from jobs.manifest import JobManifest, JobPaths, RegularShards, write_manifest

    paths = JobPaths.of(data_dir, job_id)
    rows = num_shards * SHARD_SIZE
    shards = RegularShards(paths, rows, SHARD_SIZE)
    manifest = JobManifest(job_id, str(data_dir), [], rows, SHARD_SIZE, shards, {"model": "m"}, {}, "q",
                           "embedded", 2, 1.0, [], time.time())
    write_manifest(manifest, paths)


def _write_state(leases, shard_id: int, attempt: int, state: str, heartbeat_ts: float, rows: int) -> None:
    from jobs.shards.leases import Lease, LeaseState

    host = "bench-elsewhere"  # another host: no pid check
    leases.claim_file(shard_id, attempt).touch()
    Lease(leases, shard_id, LeaseState("w1", host, 1, attempt, state, heartbeat_ts, heartbeat_ts, rows,
                                       rows * 8)).write()


def write_leases(data_dir: Path, job_id: str, num_shards: int, running: int, dead: int) -> dict:
    """The lease files of a job partway through, written file by file (no claim scans); what each
    state got."""
    from jobs.manifest import JobPaths
    from jobs.shards.leases import ShardLeases

    leases = ShardLeases(JobPaths.of(data_dir, job_id).leases, ttl_s=30)
    leases.directory.mkdir(parents=True, exist_ok=True)
    now = time.time()
    committed = int(num_shards * 0.7)
    plan = {"committed": range(0, committed), "failed": range(committed, committed + 2),
            "running": range(committed + 2, committed + 2 + running),
            "dead": range(committed + 2 + running, committed + 2 + running + dead)}
    for shard_id in plan["committed"]:
        _write_state(leases, shard_id, 1, "committed", now - 60, SHARD_SIZE)
    for shard_id in plan["failed"]:
        _write_state(leases, shard_id, 3, "failed", now - 60, 5)
    for shard_id in plan["running"]:
        _write_state(leases, shard_id, 1, "running", now, 100)
    for shard_id in plan["dead"]:
        _write_state(leases, shard_id, 1, "running", now - 3600, 50)
    return {k: len(v) for k, v in plan.items()}


def advance(data_dir: Path, job_id: str, first_running: int, running: int, first_queued: int) -> None:
    """`running` running shards commit and as many queued ones are claimed, through the lease writers."""
    from jobs.manifest import JobPaths
    from jobs.shards.leases import Lease, LeaseState, ShardLeases
    from jobs.shards.state import ShardState

    leases = ShardLeases(JobPaths.of(data_dir, job_id).leases, ttl_s=30)
    now = time.time()
    for shard_id in range(first_running, first_running + running):
        lease = Lease(leases, shard_id, leases.view(shard_id, 1).state)
        lease.end(ShardState.COMMITTED, rows_done=SHARD_SIZE, output_tokens=SHARD_SIZE * 8)
    for shard_id in range(first_queued, first_queued + running):
        noting = getattr(leases, "noting", None)  # what ShardLeases.try_claim notes around its claim
        with noting(shard_id, 1, ShardState.RUNNING) if noting is not None else contextlib.nullcontext():
            leases.claim_file(shard_id, 1).touch()
            state = LeaseState("w2", "bench-elsewhere", 1, 1, ShardState.RUNNING, now, now)
            Lease(leases, shard_id, state).write()


def poll(data_dir: Path, job_id: str, first: bool = False) -> dict:
    """One poll timed, then the same poll again under tracemalloc; `first`: the job's first poll, whose
    progress summary (where the code keeps one) is removed before the second, so it is built again."""
    from jobs.manifest import JobPaths, load_manifest
    from jobs.shards.supervise import job_progress

    t = time.perf_counter()
    progress = job_progress(load_manifest(data_dir, job_id))
    wall = time.perf_counter() - t
    if first:
        (JobPaths.of(data_dir, job_id).leases / "changes" / "summary.json").unlink(missing_ok=True)
    tracemalloc.start()  # the same poll again, for its heap (tracemalloc slows it several times)
    job_progress(load_manifest(data_dir, job_id))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    counts = {str(s): progress.count(s) for s in ("committed", "running", "dead", "failed", "queued")}
    return {"s": round(wall, 4), "peak_mib": round(peak / 2**20, 2), "rows_done": progress.rows_done,
            "output_tokens": progress.output_tokens, **counts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", default="10000,100000,390625", help="comma-separated shard counts")
    ap.add_argument("--running", type=int, default=256, help="running shards (and commits between polls)")
    ap.add_argument("--dead", type=int, default=4, help="dead shards (stale heartbeats)")
    ap.add_argument("--workdir", default=None, help="where the data dirs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the data dirs")
    args = ap.parse_args(argv)
    os.environ["BATCHGEN_LEASE_TTL_S"] = "900"  # running stays running however long the setup takes
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bg-run-progress-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# host {socket.gethostname()}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    try:
        for num_shards in [int(s) for s in args.shards.split(",") if s]:
            data_dir, job_id = work / f"data-{num_shards}", "job-progress"
            t = time.perf_counter()
            write_job(data_dir, job_id, num_shards)
            plan = write_leases(data_dir, job_id, num_shards, args.running, args.dead)
            setup_s = time.perf_counter() - t
            first = poll(data_dir, job_id, first=True)
            again = poll(data_dir, job_id)
            committed = int(num_shards * 0.7)
            advance(data_dir, job_id, committed + 2, args.running, committed + 2 + args.running + args.dead)
            after = poll(data_dir, job_id)
            print(json.dumps({"shards": num_shards, "setup_s": round(setup_s, 1), "plan": plan,
                              "first": first, "again": again, "after_commits": after}))
            if not args.keep:
                shutil.rmtree(data_dir, ignore_errors=True)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
