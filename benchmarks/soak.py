#!/usr/bin/env python3
"""`make soak`: faults against a real job, then a count of every row (not part of the test run).

Two `batchgen worker` processes on Redis serve one job (default 20,000 rows, short outputs, the tiny
random-weight model) while this script does each planned fault once the job's progress reaches it
(a fraction of its shards committed), so a fast machine cannot finish the job before the faults:

- at 10, 30, 50 and 60%: kills a random worker with SIGKILL and starts a new one in its place;
- at 20%: flushes the Redis database (every queued shard message is lost: the workers' janitors
  re-publish them after $BATCHGEN_REPUBLISH_AFTER_S);
- at 40%: fills the data dir's disk for a while (when a small tmpfs can be mounted for it, i.e. as
  root; otherwise this fault is not planned and the report says so), then frees it;
- at 70%: truncates or deletes a committed shard's output part, then recovers the documented way:
  `batchgen store check --repair` marks the shard for re-run, `batchgen retry` queues it (last: the
  recovery takes seconds, during which the job may run to its end, leaving no later fault a chance).

A worker that exits by itself is started again, as a process supervisor would (the report counts
those exits). A planned fault that could not be done (the job finished first, the flush found no message, the
repair did not mark the shard) fails the soak: it would prove nothing. At the end it counts the
job's output rows: every input row must be there exactly once (0 lost, 0 duplicated) and `store
check` must find the store healthy; exit 0 only then. The figures are printed as one table.

    batchgen bench soak [--rows 20000] [--shard-size 200] [--redis redis://127.0.0.1:6379/13]
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


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="batchgen-soak-"))
    data_dir, tmpfs = _data_dir(base, args.tmpfs_mb)
    env = dict(os.environ, PYTHONPATH=str(ROOT), BATCHGEN_LEASE_TTL_S=str(args.lease_ttl),
               OMP_NUM_THREADS="1", BATCHGEN_REPUBLISH_AFTER_S=str(args.republish_after),
               BATCHGEN_COMPACT_EVERY_S="30")
    os.environ.update({k: env[k] for k in ("BATCHGEN_LEASE_TTL_S", "BATCHGEN_REPUBLISH_AFTER_S")})
    plan = _plan(args, tmpfs)
    figures = {"rows": args.rows, "shards": -(-args.rows // args.shard_size), "kills": 0, "broker_flushes": 0,
               "disk_full_s": 0.0 if tmpfs else "not planned (no tmpfs: mounting one needs root)",
               "parts_lost": 0}
    soak = None
    try:
        manifest = _submit(base, data_dir, args)
        figures["queue"] = manifest.queue
        soak = _Soak(data_dir, manifest, args, env, base / "logs", rng, figures)
        ok = soak.run(plan)
        figures.update(_count(data_dir, manifest))
        figures["republished"] = _republished(manifest)
        figures["store_check_at_end"] = _store_check(data_dir, env)
        figures["finished"] = ok
    finally:
        if soak is not None:
            with contextlib.suppress(Exception):
                soak.stop_all()
        if tmpfs:
            subprocess.run(["umount", str(data_dir)], check=False)
    for key, value in figures.items():
        print(f"{key:>24}: {value}")
    missed = [f for f in figures.get("faults", []) if not f.startswith("done")]
    good = (figures.get("finished") and figures.get("lost") == 0 and figures.get("duplicated") == 0
            and not missed and figures.get("store_check_at_end") == "healthy")
    if good:
        shutil.rmtree(base, ignore_errors=True)
    else:
        why = f"; planned faults that did not happen: {missed}" if missed else ""
        print(f"soak FAILED{why}; logs kept under {base}")
    return 0 if good else 1


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="batchgen bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--shard-size", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--redis", default=os.environ.get("BATCHGEN_SOAK_REDIS_URL", "redis://127.0.0.1:6379/13"),
                   help="a Redis database of its own: it is flushed once")
    p.add_argument("--kill-at", type=float, nargs="*", default=[0.1, 0.3, 0.5, 0.6], metavar="FRACTION",
                   help="kill -9 a worker when this fraction of the shards is committed")
    p.add_argument("--flush-at", type=float, default=0.2, help="FLUSHDB at this fraction committed")
    p.add_argument("--disk-full-at", type=float, default=0.4, help="fill the disk at this fraction committed")
    p.add_argument("--disk-full-for", type=float, default=15.0)
    p.add_argument("--lose-part-at", type=float, default=0.7,
                   help="truncate or delete a committed shard's output part at this fraction committed, then "
                        "recover it the documented way (store check --repair, retry)")
    p.add_argument("--tmpfs-mb", type=int, default=512)
    p.add_argument("--lease-ttl", type=float, default=6.0)
    p.add_argument("--republish-after", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=14)
    return p.parse_args(argv)


def _plan(args, tmpfs: bool) -> list[tuple[float, str]]:
    """(fraction of shards committed, fault) in the order they are due."""
    plan = [(at, "kill") for at in args.kill_at]
    plan += [(args.flush_at, "flush"), (args.lose_part_at, "lose_part")]
    if tmpfs:
        plan.append((args.disk_full_at, "disk_full"))
    return sorted(plan)


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

    def run(self, plan: list[tuple[float, str]]) -> bool:
        """Serve the job with two workers, doing each planned fault once its fraction of the shards is
        committed; True when every shard committed. A fault the job finished before is recorded as missed."""
        from jobs.shards.supervise import job_progress

        self.workers = [self._start(), self._start()]
        t0 = time.monotonic()
        faults: list[str] = self.figures.setdefault("faults", [])
        last_line = 0.0
        while time.monotonic() - t0 < self.args.timeout:
            progress = job_progress(self.manifest)
            done = progress.count("committed") / progress.num_shards
            while plan and done >= plan[0][0] and not progress.finished:
                at, kind = plan.pop(0)
                faults.append(f"{self._fault(kind)} ({kind} at {at:.0%}, {done:.0%} committed)")
            self._restart_exited()
            if progress.finished:
                self.figures["elapsed_s"] = round(time.monotonic() - t0, 1)
                faults += [f"MISSED: the job finished first ({kind} at {at:.0%})" for at, kind in plan]
                return True
            if time.monotonic() - last_line >= 2.0:
                last_line = time.monotonic()
                print(f"{time.strftime('%H:%M:%S')} {progress.rows_done}/{progress.num_requests} rows, "
                      f"shards {progress.count('committed')}/{progress.num_shards} committed, "
                      f"kills {self.figures['kills']}", flush=True)
            time.sleep(0.25)
        self.figures["elapsed_s"] = f"timed out after {self.args.timeout:.0f} s"
        return False

    def _restart_exited(self) -> None:
        """Start a worker in the place of one that exited by itself (a full disk at its start, say), as
        the process supervisor of a real deployment does; the report counts them."""
        for i, proc in enumerate(self.workers):
            if proc.poll() is None:
                continue
            self.figures["worker_exits"] = self.figures.get("worker_exits", 0) + 1
            print(f"  worker {i} (pid {proc.pid}) exited with code {proc.returncode}; starting another",
                  flush=True)
            self.workers[i] = self._start()

    def _fault(self, kind: str) -> str:
        """Do one fault; "done: ..." when it happened as planned, else "MISSED: why"."""
        try:
            return "done: " + getattr(self, f"_{kind}")()
        except _Missed as exc:
            return f"MISSED: {exc}"

    def _kill(self) -> str:
        i = self.rng.randrange(len(self.workers))
        victim = self.workers[i]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        self.figures["kills"] += 1
        print(f"  kill -9 worker {i} (pid {victim.pid}); starting another", flush=True)
        self.workers[i] = self._start()
        return f"killed worker pid {victim.pid}"

    def _flush(self) -> str:
        import redis

        client = redis.Redis.from_url(self.args.redis)
        try:
            held = client.llen(self.manifest.queue)
            client.flushdb()
        finally:
            client.close()
        if not held:
            raise _Missed("FLUSHDB found no queued shard message to lose")
        self.figures["broker_flushes"] += 1
        self.figures["messages_flushed"] = held
        print(f"  FLUSHDB: {held} queued shard messages lost", flush=True)
        return f"{held} queued messages flushed"

    def _lose_part(self) -> str:
        """Damage a committed shard's output part, then the documented recovery: `batchgen store check
        --repair` marks the shard for re-run, `batchgen retry` queues it."""
        from jobs.store import Layout, Store

        job = self.manifest.job_id
        committed = [s for s in range(len(self.manifest.shards)) if Store(self.data_dir).committed(job, s)]
        if not committed:
            raise _Missed("no committed shard to damage")
        shard = self.rng.choice(committed)
        record = Store(self.data_dir).committed(job, shard)
        [name] = [p for p in record.parts if p.endswith(".parquet") and "~outputs~" in p][:1]
        part = Layout.of(self.data_dir).raw_dir("outputs", job) / name
        how = self.rng.choice(["truncated", "deleted"])
        if how == "deleted":
            part.unlink()
        else:
            part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
        self.figures["parts_lost"] += 1
        print(f"  {how} {part.name} (shard {shard}); recovering: store check --repair, retry", flush=True)
        repaired = _batchgen(self.env, "store", "check", "--repair", "--data-dir", str(self.data_dir))
        if f"shard {shard}: marked for re-run" not in repaired.stdout:
            said = repaired.stdout + repaired.stderr
            raise _Missed(f"store check --repair did not mark shard {shard}: {said}")
        retried = _batchgen({**self.env, "BATCHGEN_BROKER_URL": self.args.redis}, "retry", job,
                            "--data-dir", str(self.data_dir))
        if f"re-queued failed shard(s) {shard}" not in retried.stdout:
            raise _Missed(f"retry did not re-queue shard {shard}: {retried.stdout}{retried.stderr}")
        return f"shard {shard}'s output part {how}, marked for re-run and retried"

    def _disk_full(self) -> str:
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
        return f"disk full for {self.args.disk_full_for:.0f} s"

    def stop_all(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


class _Missed(Exception):
    """A worker that exits by itself is started again, as a process supervisor would (the report counts
those exits). A planned fault that could not be done (the soak then fails: it would prove nothing)."""


def _batchgen(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def _store_check(data_dir: Path, env: dict) -> str:
    done = _batchgen(env, "store", "check", "--data-dir", str(data_dir))
    return "healthy" if done.returncode == 0 else f"exit {done.returncode}: {done.stdout}{done.stderr}"


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
