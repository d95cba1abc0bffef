"""`batchgen run`: a whole job on this machine, with no broker server.

Submit to the embedded broker (a queue of the job's own), start worker subprocesses (`batchgen
worker`, logs under the job's directory), show a progress bar from the lease files (rows done /
total, tokens/s, ETA; with `--log-format json` a log record every PROGRESS_LOG_S instead), re-queue
shards of a worker that died, stop the workers when every shard is committed or failed, then print
a summary and write `--output`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from engine.config import EngineConfig
from jobs.broker import BROKER_ENV, BrokerSettings
from jobs.leases import lease_ttl_s
from jobs.manifest import JobManifest, JobPaths
from jobs.store.parts import Store
from jobs.supervise import JobProgress, job_progress, requeue_dead_shards

log = logging.getLogger(__name__)

POLL_S = 0.5
PROGRESS_LOG_S = 10.0  # progress as log records (JSON logs): this often
STOP_TIMEOUT_S = 60.0
MAX_RESTARTS = 3  # per worker slot, for workers killed by a signal
LOG_TAIL_LINES = 15


class RunError(Exception):
    """The local run could not finish (a worker cannot start, or keeps dying)."""


@dataclass
class WorkerProcess:
    """One worker subprocess of the run."""

    index: int
    proc: subprocess.Popen
    log_path: Path
    restarts: int = 0


class LocalRun:
    def __init__(self, manifest: JobManifest, broker: BrokerSettings, config: EngineConfig, *, workers: int,
                 concurrency: int, show_progress: bool = True, progress_as_log: bool = False) -> None:
        self.manifest = manifest
        self.broker = broker
        self.config = config
        self.num_workers = workers
        self.concurrency = concurrency
        self.show_progress = show_progress and not progress_as_log  # a bar is no log line
        self.progress_as_log = progress_as_log and show_progress
        self.paths = JobPaths.of(manifest.data_dir, manifest.job_id)
        self.store = Store(manifest.data_dir)
        self.workers: list[WorkerProcess] = []

    def run(self) -> int:
        """Run the job to its end; the exit code: 0 completed, 1 failed or cancelled, 130 interrupted."""
        from jobs.submit import publish_job

        t0 = time.time()
        publish_job(self.manifest, self.broker)
        try:
            self.workers = [self._start(i) for i in range(self.num_workers)]
            progress = self._watch()
        except KeyboardInterrupt:
            self._stop_workers()
            m = self.manifest
            click.echo(f"\ninterrupted: job {m.job_id} stays queued; resume it with `batchgen worker "
                       f"--broker embedded --queue {self.broker.queue} --data-dir {m.data_dir}` "
                       f"or cancel it with `batchgen cancel {m.job_id}`", err=True)
            return 130
        finally:
            self._stop_workers()
        return self._finish(progress, time.time() - t0)

    # -- workers
    def _start(self, index: int, restarts: int = 0) -> WorkerProcess:
        from jobs.commands import engine_flags

        log_dir = self.paths.root / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"worker-{index}.log"
        worker_id = f"run{index}-{self.manifest.job_id}-{os.getpid()}@{socket.gethostname()}"
        cmd = [sys.executable, "-m", "jobs.cli", "worker", *engine_flags(self.config),
               "--data-dir", self.manifest.data_dir, "--broker", "embedded", "--queue", self.broker.queue,
               "--concurrency", str(self.concurrency), "--worker-id", worker_id,
               "--shard-timeout", str(self.manifest.shard_timeout_s or self.broker.shard_timeout_s)]
        env = {k: v for k, v in os.environ.items() if k != BROKER_ENV}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env)
        return WorkerProcess(index, proc, log_path, restarts)

    def _check_workers(self) -> None:
        """Restart a worker killed by a signal; a worker that exits with an error ends the run."""
        for i, wp in enumerate(self.workers):
            rc = wp.proc.poll()
            if rc is None:
                continue
            tail = _tail(wp.log_path)
            if rc >= 0 or wp.restarts >= MAX_RESTARTS:
                raise RunError(f"worker {wp.index} exited with code {rc}; last lines of "
                               f"{wp.log_path}:\n{tail}")
            click.echo(f"\nworker {wp.index} was killed (signal {-rc}); restarting it", err=True)
            self.workers[i] = self._start(wp.index, wp.restarts + 1)

    def _stop_workers(self) -> None:
        live = [wp for wp in self.workers if wp.proc.poll() is None]
        for wp in live:
            wp.proc.send_signal(signal.SIGTERM)  # warm shutdown: finish and commit shards in flight
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for wp in live:
            try:
                wp.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                wp.proc.kill()
                wp.proc.wait()

    # -- progress
    def _watch(self) -> JobProgress:
        from tqdm import tqdm

        bar = tqdm(total=self.manifest.num_requests, unit="row", dynamic_ncols=True,
                   disable=not self.show_progress, desc=self.manifest.job_id)
        janitor_every, last_janitor, gen_start = lease_ttl_s() / 2, time.monotonic(), None
        last_log = time.monotonic()
        try:
            while True:
                progress = job_progress(self.manifest, self.store)
                if gen_start is None and (progress.rows_done or progress.count("running")):
                    gen_start = time.monotonic()
                _show(bar, progress, gen_start)
                due = progress.finished or time.monotonic() - last_log >= PROGRESS_LOG_S
                if self.progress_as_log and due:
                    last_log = time.monotonic()
                    _log_progress(progress, gen_start)
                if progress.finished:
                    return progress
                self._check_workers()
                if time.monotonic() - last_janitor >= janitor_every:
                    last_janitor = time.monotonic()
                    requeue_dead_shards(self.manifest.data_dir, self.broker)
                time.sleep(POLL_S)
        finally:
            bar.close()

    # -- the end
    def _finish(self, progress: JobProgress, elapsed_s: float) -> int:
        from jobs.store.catalog import write_catalog
        from jobs.store.compact import compact_job
        from jobs.summary import job_summary

        summary = job_summary(self.manifest)
        click.echo(summary.render(elapsed_s))
        compact_job(self.manifest.data_dir, self.manifest.job_id)  # fewer files: fast queries from now on
        write_catalog(self.manifest.data_dir)
        if self.manifest.output_path:
            from jobs.export import ExportError, export_job

            try:
                export_job(self.manifest, self.manifest.output_path)
                click.echo(f"output: {self.manifest.output_path}")
            except ExportError as exc:
                click.echo(f"output not written: {exc}", err=True)
                return 1
        else:
            sql = f"SELECT * FROM outputs WHERE job_id = '{self.manifest.job_id}'"
            click.echo(f'outputs: batchgen sql "{sql}" --data-dir {self.manifest.data_dir}')
        return 0 if summary.status == "completed" else 1


def _tokens_per_s(progress: JobProgress, gen_start: float | None) -> float:
    elapsed = time.monotonic() - gen_start if gen_start else 0.0
    return progress.output_tokens / elapsed if elapsed > 0 else 0.0


def _show(bar, progress: JobProgress, gen_start: float | None) -> None:
    bar.n = progress.rows_done
    done = progress.count("committed")
    tok_s = _tokens_per_s(progress, gen_start)
    bar.set_postfix_str(f"{tok_s:.1f} tok/s, shards {done}/{len(progress.shards)}", refresh=False)
    bar.refresh()


def _log_progress(progress: JobProgress, gen_start: float | None) -> None:
    """The progress bar's numbers as one log record (its fields as JSON keys too)."""
    fields = {"job_id": progress.job_id, "rows_done": progress.rows_done,
              "num_requests": progress.num_requests,
              "output_tokens_per_s": round(_tokens_per_s(progress, gen_start), 2),
              "shards_committed": progress.count("committed"), "num_shards": len(progress.shards)}
    log.info("job %(job_id)s: %(rows_done)d/%(num_requests)d rows, %(output_tokens_per_s).1f tok/s, "
             "shards %(shards_committed)d/%(num_shards)d", fields, extra=fields)


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:])
