"""`batchgen run`: a whole job on this machine, with no broker server.

Submit to the embedded broker (a queue of the job's own; or, when the same command ran before,
queue what that job has left: jobs.shards.resume), start worker subprocesses (`batchgen worker`, logs under
the job's directory), show progress from the lease files (rows done / total, tokens/s, ETA: a bar on
a terminal, else a line every PROGRESS_LOG_S; with `--log-format json` a log record each time),
re-queue shards of a worker that died, stop the workers when every shard is committed or failed,
then print a summary and write `--output`.

Ctrl-C hands the shards in flight back: each worker (in a session of its own, so the terminal's
SIGINT reaches only this process) gets one SIGINT, aborts its running rows and gives its shards back
within seconds; then the run prints where the job stands and the command that resumes it (or, if
the job finished meanwhile, the summary and `--output` as usual). A run killed outright (SIGKILL, OOM)
leaves no worker behind either: each watches its parent and hands its shards back when the run is
gone (jobs.parent_watch.exit_with_parent); the same command then resumes the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import click

import engine
from engine.config import EngineConfig
from jobs.broker import BROKER_ENV, BrokerSettings
from jobs.manifest import JobManifest, JobPaths
from jobs.parent_watch import PARENT_PID_ENV
from jobs.shards.leases import lease_ttl_s
from jobs.shards.state import ShardState
from jobs.shards.supervise import JobProgress, hand_back_dead_attempts, job_progress, requeue_dead_shards
from jobs.store import Store

log = logging.getLogger(__name__)

POLL_S = 0.5
STOP_TIMEOUT_S = 60.0
# After Ctrl-C a worker hands its shards back at the end of the engine step it is in (under a second
# to a few seconds on CPU); one still busy after this long (a long prefill on a loaded machine) is
# killed, and its attempts are ended as handed back on its behalf.
HAND_BACK_TIMEOUT_S = 5.0
MAX_RESTARTS = 3  # per worker slot, for workers killed by a signal
LOG_TAIL_LINES = 15
PROGRESS_LOG_S = 5.0  # a progress line (or JSON log record) this often when there is no bar


class RunError(Exception):
    """The local run could not finish (a worker cannot start, or keeps dying)."""


@dataclass
class WorkerProcess:
    """One worker subprocess of the run."""

    index: int
    proc: subprocess.Popen
    log_path: Path
    restarts: int = 0


def worker_env(environ: Mapping[str, str], num_workers: int) -> dict[str, str]:
    """The environment of a worker this process starts: this one's, less the broker setting (the
    worker gets --broker), plus this process's pid (the worker exits, handing back, if it dies). Two
    or more workers share the cores, so their OpenMP threads must not spin between parallel regions
    (engine/openmp.py): GOMP_SPINCOUNT 0 unless the user set it, and each steps on its share of the
    CPUs (OMP_NUM_THREADS, unless the user set it; `--cpu-threads` wins over both)."""
    env = {k: v for k, v in environ.items() if k != BROKER_ENV}
    env[PARENT_PID_ENV] = str(os.getpid())
    if num_workers > 1:
        engine.no_spin_unless_chosen(env)
        engine.share_cpus(env, num_workers)
    return env


class LocalRun:
    def __init__(self, manifest: JobManifest, broker: BrokerSettings, config: EngineConfig, *, workers: int,
                 concurrency: int, show_progress: bool = True, progress_as_log: bool = False,
                 resume: bool = False, output_path: str = "", resume_command: str = "",
                 devices: list[str] | None = None) -> None:
        self.manifest = manifest
        self.broker = broker
        self.config = config
        self.num_workers = workers
        self.devices = devices or [config.device] * workers  # worker i's --device (jobs.placement)
        self.concurrency = concurrency
        self.show_progress = show_progress
        self.progress_as_log = progress_as_log  # JSON logs: progress as log records, not a bar
        self.resume = resume  # the job was started before: queue what it has left
        self.output_path = output_path or manifest.output_path  # this command's --output
        self.resume_command = resume_command  # printed after Ctrl-C
        self.paths = JobPaths.of(manifest.data_dir, manifest.job_id)
        self.store = Store(manifest.data_dir)
        self.workers: list[WorkerProcess] = []

    def run(self) -> int:
        """Run the job to its end; the exit code: 0 completed, 1 failed or cancelled, 130 interrupted
        (Ctrl-C, or SIGTERM / SIGHUP, which would otherwise end this process and leave its workers,
        in sessions of their own, running)."""
        t0 = time.time()
        try:
            with _interrupt_on(signal.SIGTERM, signal.SIGHUP):
                if self._publish():
                    self.workers = [self._start(i) for i in range(self.num_workers)]
                    self._watch()
        except KeyboardInterrupt:
            return self._interrupted(time.time() - t0)
        finally:
            self._stop_workers()
        return self._finish(time.time() - t0)

    def _publish(self) -> bool:
        """Queue the job's shards (on a resume: those not committed); False when none is left."""
        from jobs.shards.resume import JobBusyError, describe_resume, resume_job
        from jobs.submit import publish_job

        if not self.resume:
            publish_job(self.manifest, self.broker)
            return True
        try:
            pending = resume_job(self.manifest, self.broker)
        except JobBusyError as exc:
            raise RunError(str(exc)) from None
        if pending is None:  # the run that made it was interrupted before publishing it
            publish_job(self.manifest, self.broker)
            pending = [s.shard_id for s in self.manifest.shards]
        click.echo(describe_resume(self.manifest, pending), err=True)
        return bool(pending)

    # -- workers
    def _start(self, index: int, restarts: int = 0) -> WorkerProcess:
        log_dir = self.paths.root / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"worker-{index}.log"
        worker_id = f"run{index}-{self.manifest.job_id}-{os.getpid()}@{socket.gethostname()}"
        cmd = [sys.executable, "-m", "jobs.cli", "worker", "--job", self.manifest.job_id,
               "--data-dir", self.manifest.data_dir, "--broker", "embedded", "--queue", self.broker.queue,
               "--concurrency", str(self.concurrency), "--worker-id", worker_id,
               "--shard-timeout", str(self.manifest.shard_timeout_s or self.broker.shard_timeout_s),
               "--device", self.devices[index]]
        env = worker_env(os.environ, self.num_workers)
        with open(log_path, "ab") as log:
            # a session of its own: a terminal's Ctrl-C reaches this process only, which then sends
            # each worker exactly one SIGINT (a second one would be Celery's cold shutdown)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
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
        # warm shutdown: finish and commit the shards in flight
        self._signal_workers(signal.SIGTERM, STOP_TIMEOUT_S)

    def _signal_workers(self, sig: int, timeout_s: float) -> list[WorkerProcess]:
        """Send `sig` to every live worker, wait up to `timeout_s` for all to exit, kill the rest
        (returned)."""
        live = [wp for wp in self.workers if wp.proc.poll() is None]
        for wp in live:
            wp.proc.send_signal(sig)
        deadline, killed = time.monotonic() + timeout_s, []
        for wp in live:
            try:
                wp.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                wp.proc.kill()
                wp.proc.wait()
                killed.append(wp)
        return killed

    # -- progress
    def _watch(self) -> JobProgress:
        report = _reporter(self.manifest, self.show_progress, self.progress_as_log)
        janitor_every, last_janitor, gen_start = lease_ttl_s() / 2, time.monotonic(), None
        try:
            while True:
                progress = job_progress(self.manifest, self.store)
                if gen_start is None and (progress.rows_done or progress.count("running")):
                    gen_start = time.monotonic()
                report.show(progress, gen_start)
                if progress.finished:
                    return progress
                self._check_workers()
                if time.monotonic() - last_janitor >= janitor_every:
                    last_janitor = time.monotonic()
                    requeue_dead_shards(self.manifest.data_dir, self.broker)
                time.sleep(POLL_S)
        finally:
            report.close()

    # -- Ctrl-C
    def _interrupted(self, elapsed_s: float) -> int:
        """Hand the shards in flight back, then say where the job stands and how to resume it."""
        click.echo(f"\ninterrupted: handing job {self.manifest.job_id}'s shards in flight back "
                   "(Ctrl-C again to kill the workers)", err=True)
        try:
            killed = self._signal_workers(signal.SIGINT, HAND_BACK_TIMEOUT_S)
        except KeyboardInterrupt:
            killed = [wp for wp in self.workers if wp.proc.poll() is None]
            for wp in killed:
                wp.proc.kill()
                wp.proc.wait()
        handed = hand_back_dead_attempts(self.manifest, self.store)
        if killed:
            click.echo(f"stopped {len(killed)} worker(s) still inside an engine step after "
                       f"{HAND_BACK_TIMEOUT_S:.0f} s; handed back their shard(s) {handed} for them", err=True)
        progress = job_progress(self.manifest, self.store)
        if progress.finished:
            return self._finish(elapsed_s)
        click.echo(describe_interrupted(progress), err=True)
        click.echo(f"resume with: {self.resume_command}" if self.resume_command else
                   f"resume with the same `batchgen run` command and --job-id {self.manifest.job_id}",
                   err=True)
        return 130

    # -- the end
    def _finish(self, elapsed_s: float) -> int:
        from jobs.store import compact_job, write_catalog
        from jobs.summary import job_summary

        summary = job_summary(self.manifest)
        click.echo(summary.render(elapsed_s, resumed=self.resume))
        code = 0 if summary.status == "completed" else 1
        try:  # fewer files: fast queries from now on; an optimisation, never the job's outcome
            compact_job(self.manifest.data_dir, self.manifest.job_id)
            write_catalog(self.manifest.data_dir)
        except Exception as exc:  # noqa: BLE001 - a full disk (OSError, duckdb.IOException), ...
            click.echo(f"warning: the job's parts were not compacted ({_first_line(exc)}); its outputs are "
                       "intact and a worker compacts them later", err=True)
        if not self.output_path:
            sql = f"SELECT * FROM outputs WHERE job_id = '{self.manifest.job_id}'"
            click.echo(f'outputs: batchgen sql "{sql}" --data-dir {self.manifest.data_dir}')
            return code
        return self._write_output(code)

    def _write_output(self, code: int) -> int:
        """--output; when the disk is full the job stays done and the message says how to write it."""
        from jobs.export import ExportError, export_job

        try:
            written = export_job(self.manifest, self.output_path)
        except ExportError as exc:
            click.echo(f"output not written: {exc}", err=True)
            return 1
        except Exception as exc:  # noqa: BLE001 - a full disk (OSError, duckdb.IOException), ...
            click.echo(f"output not written ({_first_line(exc)}); the job's outputs are stored: write it "
                       f"once there is room with: batchgen export {self.manifest.job_id} --data-dir "
                       f"{shlex.quote(self.manifest.data_dir)} --output {shlex.quote(self.output_path)}",
                       err=True)
            return code
        click.echo(f"output: {written.path}" + (f" (failed requests: {written.errors_path})"
                                                if written.errors_path else ""))
        return code


@contextlib.contextmanager
def _interrupt_on(*signals: int) -> Iterator[None]:
    """Turn `signals` into KeyboardInterrupt while the block runs (only the main thread can)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    before = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def describe_interrupted(progress: JobProgress) -> str:
    """Where an interrupted job stands, from its lease files (the truth, not a guess)."""
    total = progress.num_shards
    committed, failed = progress.count(ShardState.COMMITTED), progress.count(ShardState.FAILED)
    rows = progress.committed_rows
    rest = total - committed - failed
    return (f"job {progress.job_id}: interrupted with {committed} of {total} shard(s) committed "
            f"({rows} of {progress.num_requests} rows), {failed} failed, {rest} queued to run")


def resume_command(argv: list[str], job_id: str, data_dir: str) -> str:
    """The command line that resumes the job: this one, with the job id and data dir made explicit."""
    args = ["batchgen", *argv]
    if not any(a == "--job-id" or a.startswith("--job-id=") for a in argv):
        args += ["--job-id", job_id]
    if not any(a == "--data-dir" or a.startswith("--data-dir=") for a in argv):
        args += ["--data-dir", data_dir]
    return shlex.join(args)


# ---------------------------------------------------------------- progress output


def _reporter(manifest: JobManifest, show: bool, as_records: bool = False):
    if not show:
        return _Quiet()
    if sys.stderr.isatty() and not as_records:
        return _Bar(manifest)
    return _LogLines(manifest, as_records)


class _Quiet:
    def show(self, progress: JobProgress, gen_start: float | None) -> None:
        pass

    def close(self) -> None:
        pass


class _Bar:
    """A tqdm bar on a terminal."""

    def __init__(self, manifest: JobManifest) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=manifest.num_requests, unit="row", dynamic_ncols=True, desc=manifest.job_id)

    def show(self, progress: JobProgress, gen_start: float | None) -> None:
        self.bar.n = progress.rows_done
        done = progress.count(ShardState.COMMITTED)
        self.bar.set_postfix_str(f"{_tok_s(progress, gen_start):.1f} tok/s, shards "
                                 f"{done}/{progress.num_shards}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class _LogLines:
    """A progress line every PROGRESS_LOG_S seconds (and at the end): for logs, CI and pipes; as log
    records (the numbers as fields too) when logs are JSON."""

    def __init__(self, manifest: JobManifest, as_records: bool = False) -> None:
        self.manifest = manifest
        self.as_records = as_records
        self.last = -PROGRESS_LOG_S
        self.latest: JobProgress | None = None
        self.gen_start: float | None = None

    def show(self, progress: JobProgress, gen_start: float | None) -> None:
        self.latest, self.gen_start = progress, gen_start
        if time.monotonic() - self.last >= PROGRESS_LOG_S:
            self.last = time.monotonic()
            self._emit(progress, gen_start)

    def close(self) -> None:
        if self.latest is not None:
            self._emit(self.latest, self.gen_start)

    def _emit(self, progress: JobProgress, gen_start: float | None) -> None:
        if self.as_records:
            _log_progress(progress, gen_start)
        else:
            click.echo(progress_line(progress, gen_start), err=True)


def progress_line(progress: JobProgress, gen_start: float | None) -> str:
    """One line: time, rows done, shards by state, tokens/s and the ETA."""
    done, total = progress.rows_done, progress.num_requests
    elapsed = time.monotonic() - gen_start if gen_start else 0.0
    eta = ""
    if done and elapsed > 0 and done < total:
        eta = f", ETA {_duration(elapsed / done * (total - done))}"
    shards = f"{progress.count(ShardState.COMMITTED)}/{progress.num_shards}"
    return (f"{time.strftime('%H:%M:%S')} {progress.job_id}: {done}/{total} rows "
            f"({100.0 * done / max(total, 1):.0f}%), shards {shards} committed, "
            f"{progress.count('running')} running, {_tok_s(progress, gen_start):.1f} tok/s{eta}")


def _tok_s(progress: JobProgress, gen_start: float | None) -> float:
    elapsed = time.monotonic() - gen_start if gen_start else 0.0
    return progress.output_tokens / elapsed if elapsed >= 1.0 else 0.0  # no rate from one poll


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _log_progress(progress: JobProgress, gen_start: float | None) -> None:
    """The progress bar's numbers as one log record (its fields as JSON keys too)."""
    fields = {"job_id": progress.job_id, "rows_done": progress.rows_done,
              "num_requests": progress.num_requests,
              "output_tokens_per_s": round(_tok_s(progress, gen_start), 2),
              "shards_committed": progress.count(ShardState.COMMITTED), "num_shards": progress.num_shards}
    log.info("job %(job_id)s: %(rows_done)d/%(num_requests)d rows, %(output_tokens_per_s).1f tok/s, "
             "shards %(shards_committed)d/%(num_shards)d", fields, extra=fields)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:])
