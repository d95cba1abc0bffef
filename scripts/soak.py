#!/usr/bin/env python3
"""`make soak`: faults against a real job, then a count of every row (not part of the test run).

Two `batchgen worker` processes on Redis serve one job (default 20,000 rows, short outputs, the tiny
random-weight model) while this script, on a seeded schedule:

- kills a random worker with SIGKILL every 20-40 s and starts a new one in its place;
- flushes the Redis database once (every queued shard message is lost: the workers' janitors
  re-publish them after $BATCHGEN_REPUBLISH_AFTER_S);
- fills the data dir's disk once for a while (when a small tmpfs can be mounted for it, i.e. as
  root; otherwise this phase is skipped and the report says so), then frees it.

At the end it counts the job's output rows: every input row must be there exactly once (0 lost, 0
duplicated); exit 0 only then. The figures are printed as one table.

    PYTHONPATH=. python scripts/soak.py [--rows 20000] [--shard-size 200] [--redis redis://127.0.0.1:6379/13]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "tiny-random"


def main() -> int:
    args = _args()
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="batchgen-soak-"))
    data_dir, tmpfs = _data_dir(base, args.tmpfs_mb)
    env = dict(os.environ, PYTHONPATH=str(ROOT), BATCHGEN_LEASE_TTL_S=str(args.lease_ttl),
               OMP_NUM_THREADS="1", BATCHGEN_REPUBLISH_AFTER_S=str(args.republish_after),
               BATCHGEN_COMPACT_EVERY_S="30")
    os.environ.update({k: env[k] for k in ("BATCHGEN_LEASE_TTL_S", "BATCHGEN_REPUBLISH_AFTER_S")})
    figures = {"rows": args.rows, "shards": -(-args.rows // args.shard_size), "kills": 0, "broker_flushes": 0,
               "disk_full_s": 0.0 if tmpfs else "skipped (no tmpfs: not root)"}
    try:
        manifest = _submit(base, data_dir, args)
        figures["queue"] = manifest.queue
        soak = _Soak(data_dir, manifest, args, env, base / "logs", rng, figures)
        ok = soak.run()
        figures.update(_count(data_dir, manifest))
        figures["republished"] = _republished(manifest)
        figures["finished"] = ok
    finally:
        with contextlib.suppress(Exception):
            soak.stop_all()
        if tmpfs:
            subprocess.run(["umount", str(data_dir)], check=False)
    for key, value in figures.items():
        print(f"{key:>24}: {value}")
    good = figures.get("finished") and figures.get("lost") == 0 and figures.get("duplicated") == 0
    if good:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"soak FAILED; logs kept under {base}")
    return 0 if good else 1


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--shard-size", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--redis", default=os.environ.get("BATCHGEN_SOAK_REDIS_URL", "redis://127.0.0.1:6379/13"),
                   help="a Redis database of its own: it is flushed once")
    p.add_argument("--kill-every", type=float, nargs=2, default=(20.0, 40.0), metavar=("MIN_S", "MAX_S"))
    p.add_argument("--flush-after", type=float, default=30.0, help="seconds into the run")
    p.add_argument("--disk-full-after", type=float, default=60.0, help="seconds into the run")
    p.add_argument("--disk-full-for", type=float, default=15.0)
    p.add_argument("--tmpfs-mb", type=int, default=512)
    p.add_argument("--lease-ttl", type=float, default=6.0)
    p.add_argument("--republish-after", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=14)
    return p.parse_args()


def _data_dir(base: Path, size_mb: int) -> tuple[Path, bool]:
    """DATA_DIR on a tmpfs of `size_mb` when one can be mounted (so its disk can be filled)."""
    data_dir = base / "data"
    data_dir.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(data_dir)],
                             capture_output=True).returncode == 0
    return data_dir, mounted


def _submit(base: Path, data_dir: Path, args):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.broker import resolve_broker
    from jobs.submit import JobRequest, prepare_job, publish_job

    src = base / "prompts.parquet"
    prompts = [f"soak row {i}: " + "xyz"[: i % 3 + 1] for i in range(args.rows)]
    pq.write_table(pa.table({"prompt": prompts}), src)
    broker = resolve_broker(data_dir, queue=f"soak.{int(time.time())}", url=args.redis)
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0}
    req = JobRequest(str(src), str(data_dir), {"model": MODEL}, sampling, args.shard_size,
                     max_retries=20, retry_backoff_s=2.0, apply_chat_template="never")
    manifest = prepare_job(req, broker)
    publish_job(manifest, broker)
    return manifest


class _Soak:
    def __init__(self, data_dir, manifest, args, env, log_dir, rng, figures) -> None:
        self.data_dir, self.manifest, self.args, self.env, self.rng = data_dir, manifest, args, env, rng
        self.figures = figures
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: list[subprocess.Popen] = []
        self.started = 0

    def _start(self) -> subprocess.Popen:
        self.started += 1
        name = f"soak{self.started}@soakhost"
        cmd = [sys.executable, "-m", "jobs.cli", "worker", "--model", MODEL, "--data-dir", str(self.data_dir),
               "--broker", self.args.redis, "--queue", self.manifest.queue, "--worker-id", name,
               "--max-num-seqs", "64", "--concurrency", "2"]
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - kept open for the process
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def run(self) -> bool:
        from jobs.supervise import job_progress

        self.workers = [self._start(), self._start()]
        t0 = time.monotonic()
        next_kill = t0 + self.rng.uniform(*self.args.kill_every)
        flushed = filled = False
        while time.monotonic() - t0 < self.args.timeout:
            progress = job_progress(self.manifest)
            if progress.finished:
                self.figures["elapsed_s"] = round(time.monotonic() - t0, 1)
                return True
            now = time.monotonic()
            if now >= next_kill:
                self._kill_one()
                next_kill = now + self.rng.uniform(*self.args.kill_every)
            if not flushed and now - t0 >= self.args.flush_after:
                flushed = self._flush()
            if not filled and now - t0 >= self.args.disk_full_after and self.figures["disk_full_s"] == 0.0:
                self._fill_disk()
                filled = True
            print(f"{time.strftime('%H:%M:%S')} {progress.rows_done}/{progress.num_requests} rows, shards "
                  f"{progress.count('committed')}/{len(progress.shards)} committed, "
                  f"kills {self.figures['kills']}",
                  flush=True)
            time.sleep(2.0)
        self.figures["elapsed_s"] = f"timed out after {self.args.timeout:.0f} s"
        return False

    def _kill_one(self) -> None:
        i = self.rng.randrange(len(self.workers))
        self.workers[i].send_signal(signal.SIGKILL)
        self.workers[i].wait()
        self.figures["kills"] += 1
        print(f"  kill -9 worker {i} (pid {self.workers[i].pid}); starting another", flush=True)
        self.workers[i] = self._start()

    def _flush(self) -> bool:
        import redis

        client = redis.Redis.from_url(self.args.redis)
        try:
            held = client.llen(self.manifest.queue)
            client.flushdb()
        finally:
            client.close()
        self.figures["broker_flushes"] += 1
        self.figures["messages_flushed"] = held
        print(f"  FLUSHDB: {held} queued shard messages lost", flush=True)
        return True

    def _fill_disk(self) -> None:
        """Write a ballast file until the tmpfs is full, hold it, remove it."""
        ballast = self.data_dir / "ballast"
        chunk = b"\0" * (1 << 20)
        with open(ballast, "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(chunk)
                    f.flush()
        print(f"  disk full ({ballast.stat().st_size >> 20} MiB ballast) for {self.args.disk_full_for:.0f} s",
              flush=True)
        time.sleep(self.args.disk_full_for)
        ballast.unlink()
        self.figures["disk_full_s"] = self.args.disk_full_for

    def stop_all(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _count(data_dir: Path, manifest) -> dict:
    from jobs.store import connect

    con = connect(data_dir)
    try:
        total, distinct, errors = con.execute(
            "SELECT count(*), count(DISTINCT request_id), count(*) FILTER (WHERE finish_reason = 'error') "
            "FROM outputs WHERE job_id = ?", [manifest.job_id]).fetchone()
        attempts = con.execute("SELECT sum(attempts), max(attempts) FROM shards WHERE job_id = ?",
                               [manifest.job_id]).fetchone()
        status = con.execute("SELECT status FROM jobs WHERE job_id = ?", [manifest.job_id]).fetchone()[0]
    finally:
        con.close()
    return {"job_status": status, "output_rows": total, "distinct_rows": distinct,
            "lost": manifest.num_requests - distinct, "duplicated": total - distinct, "error_rows": errors,
            "shard_attempts_total": attempts[0], "shard_attempts_max": attempts[1]}


def _republished(manifest) -> int:
    from jobs.manifest import JobPaths

    return len(list(JobPaths.of(manifest.data_dir, manifest.job_id).leases.glob("*.republished-*")))


if __name__ == "__main__":
    sys.exit(main())
