"""The worker runtime: one long-lived engine per worker process (its `EngineLoop`, jobs.engine_loop),
and the housekeeping of the shards it holds.

Beside the loop, a housekeeping thread writes the engine's iteration telemetry (the loop's thread
only queues each step's row), keeps each held shard's lease alive (heartbeat with progress), aborts
the requests of a job whose cancel marker appears, periodically re-queues the shards of dead workers
(`jobs.shards.supervise.requeue_dead_shards`), and keeps this worker's record (`jobs.store.workers`)
fresh so the dashboard can tell an idle worker from a gone one.

The janitor (re-queueing dead workers' shards, compacting the store) runs on a maintenance thread of
its own: a compaction of a large store takes minutes, and on the housekeeping thread it would stop
the heartbeats of the shards this worker holds, so other workers would take them for dead.

When the engine itself fails (out of memory, a kernel that does not compile, a device error:
engine.faults) the worker hands every shard it holds back to the queue, unwritten and with no retry
used, writes the reason into its record (`batchgen status`, the dashboard's workers page) and stops.

The engine's telemetry goes to the store (iterations, through the stat logger) and, when the worker
serves Prometheus metrics, to `jobs.metrics.WorkerMetrics` (iterations, and each finished request).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.stats import IterationStats
from jobs.engine_loop import EngineLoop, EngineRequest, ShardRun
from jobs.manifest import JobManifest
from jobs.metrics import WorkerMetrics
from jobs.shards.leases import HEARTBEAT_FRACTION, Lease, lease_ttl_s
from jobs.store import Store, WorkerRecord, write_worker_record

log = logging.getLogger(__name__)

MAINTENANCE_JOIN_S = 30.0  # a stopping worker waits this long for a janitor pass (a compaction) to end


@dataclass
class _Held:
    """A shard attempt this worker holds now (its lease is kept alive until it ends)."""

    job_id: str
    lease: Lease
    cancel_marker: Path  # the job's cancel marker file
    run: ShardRun | None = None  # set while its requests are in the engine


class WorkerRuntime:
    """One engine, its loop, its telemetry, and the housekeeping of the shards it holds."""

    def __init__(self, config: EngineConfig, worker_id: str, data_dir: str | Path, *,
                 janitor: Callable[[], None] | None = None, janitor_interval_s: float | None = None,
                 on_fatal: Callable[[], None] | None = None, metrics: WorkerMetrics | None = None,
                 record: WorkerRecord | None = None, on_tick: Callable[[], None] | None = None) -> None:
        self.config = config
        self.worker_id = worker_id
        self.data_dir = data_dir
        self.store = Store(data_dir)
        self.telemetry = self.store.telemetry_buffer(worker_id)
        # iteration rows wait here for the housekeeping thread (or an idle engine) to write them: the
        # engine's thread only appends, a part's write never takes a step's time
        self._pending_iterations: collections.deque[IterationStats] = collections.deque()
        self._telemetry_lock = threading.Lock()  # the buffer is written from both threads
        self.metrics = metrics
        self.record = record  # written on every heartbeat when given (jobs.store.workers)
        self._on_tick = on_tick  # called every housekeeping tick (revoked tasks, ...)
        self.iterations = 0  # engine steps so far
        self._telemetry_failing = False  # the last telemetry write failed (warned once per spell)
        self._held: dict[str, _Held] = {}
        self._draining = threading.Event()  # shutting down: finish held shards, take no new ones
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._janitor = janitor
        self._on_fatal = on_fatal  # called once if the engine loop dies (the worker process stops)
        ttl = lease_ttl_s()
        self._tick_s = min(ttl * HEARTBEAT_FRACTION, 1.0)
        self._record_every_s = ttl * HEARTBEAT_FRACTION
        self._janitor_interval_s = janitor_interval_s or ttl / 2
        self.loop = EngineLoop(self._make_engine, on_idle=self._on_idle, on_finished=self._on_request,
                               on_fault=self._on_engine_fault)
        self._house = threading.Thread(target=self._housekeeping, name="worker-housekeeping", daemon=True)
        self._maintenance = threading.Thread(target=self._maintain, name="worker-maintenance", daemon=True)

    def _make_engine(self):
        from engine.llm_engine import LLMEngine

        return LLMEngine(self.config, stat_loggers=[self._on_iteration])

    def _on_iteration(self, stats: IterationStats) -> None:
        """Called by the engine at the end of every step, on its thread: nothing here may wait."""
        stats.worker_id = self.worker_id
        self.iterations += 1
        self._pending_iterations.append(stats)
        if self.metrics is not None:
            self.metrics.on_iteration(stats)

    def _write_telemetry(self, flush: bool) -> None:
        """Move the steps' rows into the telemetry buffer (which writes a part every few seconds),
        and write them all now when `flush`."""
        with self._telemetry_lock:
            rows = []
            while self._pending_iterations:
                rows.append(self._pending_iterations.popleft())
            if rows:
                self._telemetry(lambda: self.telemetry.extend(rows))
            if flush:
                self._telemetry(self.telemetry.flush)

    def flush_telemetry(self) -> None:
        """Write every iteration row the engine has made so far, now (thread-safe: under the same lock
        as the engine's idle flush and the housekeeping thread's writes)."""
        self._write_telemetry(flush=True)

    def _on_request(self, out: RequestOutput) -> None:
        if self.metrics is not None:
            self.metrics.on_request(out.metrics, out.finish_reason)

    def _on_engine_fault(self, reason: str) -> None:
        """The engine failed: take no more shards, and say why in the worker's record at once."""
        self._draining.set()
        if self.record is not None:
            self.record.engine_error = reason
            self._guarded(self._write_record, "writing the worker record failed")

    def _on_idle(self) -> None:
        if self.metrics is not None:  # first: a reader that sees the flushed telemetry sees an idle engine
            self.metrics.on_idle()
        self._write_telemetry(flush=True)

    def _telemetry(self, write: Callable[[], object]) -> None:
        """Telemetry is best effort: a write that fails (a full disk) keeps its rows for the next one,
        and never fails an engine step (its shards) or stops the engine loop (the worker)."""
        try:
            write()
        except OSError as exc:
            if not self._telemetry_failing:
                log.warning("worker %s: telemetry not written (%s); kept for the next write",
                            self.worker_id, exc)
            self._telemetry_failing = True
        else:
            self._telemetry_failing = False

    def start(self) -> WorkerRuntime:
        self._write_record()
        self.loop.start()
        self._house.start()
        if self._janitor is not None:
            self._maintenance.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.loop.stop(timeout=60)
        self._house.join(timeout=10)
        if self._maintenance.is_alive():
            # a compaction publishes by rename and deletes nothing, so one cut short at exit only
            # leaves a temporary file and its group's lock (broken once stale); still, let it end
            self._maintenance.join(timeout=MAINTENANCE_JOIN_S)
            if self._maintenance.is_alive():
                log.warning("worker %s: the janitor's pass (a compaction) is still running after %.0f s; "
                            "stopping without it", self.worker_id, MAINTENANCE_JOIN_S)
        if self.record is not None:
            self.record.stopped_ts = time.time()
            self._write_record()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def drain(self) -> None:
        """Stop taking shards (warm shutdown): new deliveries are handed back to the broker."""
        self._draining.set()

    def hand_back(self) -> None:
        """Stop taking shards and stop the shards held now (an interrupt): their unfinished rows are
        aborted, their attempts end "handed back" and their messages go back to the broker."""
        self._draining.set()
        self.loop.hand_back()

    @property
    def tokenizer(self):
        """The engine's tokenizer (None for a model without one)."""
        return self.loop.engine.tokenizer

    @property
    def has_chat_template(self) -> bool:
        tokenizer = self.tokenizer
        return tokenizer is not None and bool(tokenizer.chat_template)

    # -- shards
    def check_model(self, manifest: JobManifest) -> None:
        """A job runs only on a worker serving its model."""
        if manifest.model and manifest.model != self.config.model:
            raise RuntimeError(f"job {manifest.job_id} wants model {manifest.model!r}; worker "
                               f"{self.worker_id} serves {self.config.model!r}")

    @contextlib.contextmanager
    def holding(self, job_id: str, lease: Lease, cancel_marker: Path) -> Iterator[None]:
        """Keep `lease` alive (heartbeats with progress) for as long as the attempt lasts."""
        key = f"{job_id}:{lease.shard_id}:{lease.attempt}"
        with self._lock:
            self._held[key] = _Held(job_id, lease, cancel_marker)
        if self.metrics is not None:
            self.metrics.shard_started(job_id)
        try:
            yield
        finally:
            with self._lock:
                self._held.pop(key, None)
            if self.metrics is not None:
                self.metrics.shard_ended(job_id)

    def run_shard(self, job_id: str, key: str, requests: list[EngineRequest]) -> ShardRun:
        """Hand a shard attempt's requests to the engine and wait until every one finished."""
        run = ShardRun(job_id, key, requests)
        if self.loop.fault is None:
            if not self.loop.alive:
                raise RuntimeError(f"worker {self.worker_id}: the engine loop is not running")
            with self._lock:
                if key in self._held:
                    self._held[key].run = run
            self.loop.submit(run)
            while not run.done.wait(1.0) and self.loop.fault is None:
                if not self.loop.alive:
                    run.fail("the engine loop stopped")
        if self.loop.fault is not None and (run.handed_back or not run.done.is_set()):
            run.hand_back(f"{self.loop.fault} on worker {self.worker_id}")  # under it, or before it
        return run

    # -- housekeeping
    def _housekeeping(self) -> None:
        last_record = time.monotonic()
        while not self._stop.wait(self._tick_s):
            if not self.loop.alive:
                self._give_up()
                return
            with self._lock:
                held = list(self._held.values())
            for h in held:
                self._tend(h)
            self._write_telemetry(flush=False)
            if self._on_tick is not None:
                self._guarded(self._on_tick, "a housekeeping hook failed")
            if time.monotonic() - last_record >= self._record_every_s:
                last_record = time.monotonic()
                self._guarded(self._write_record, "writing the worker record failed")

    def _maintain(self) -> None:
        """The janitor, every janitor interval, on this thread alone: however long a pass takes (a
        compaction), the housekeeping thread's heartbeats go on."""
        while not self._stop.wait(self._janitor_interval_s):
            if not self.loop.alive:
                return
            self._guarded(self._janitor, "the janitor (re-queueing dead shards, compaction) failed")

    def _write_record(self) -> None:
        """Stamp and write this worker's record (jobs.store.workers): its heartbeat for the dashboard."""
        if self.record is None:
            return
        with self._lock:
            self.record.shards_held = len(self._held)
        self.record.heartbeat_ts = time.time()
        self.record.iterations = self.iterations
        write_worker_record(self.data_dir, self.record)

    @property
    def engine_fault(self) -> str | None:
        """Why this worker's engine failed (it then hands every shard back and stops), or None."""
        return self.loop.fault

    def _give_up(self) -> None:
        """The engine loop ended (its engine failed): stop the worker; its shards were handed back."""
        self._draining.set()
        log.error("worker %s: the engine loop ended (%s); shutting the worker down", self.worker_id,
                  self.loop.fault or "no engine")
        if self._on_fatal is not None:
            self._on_fatal()

    def _tend(self, h: _Held) -> None:
        run = h.run
        try:
            if run is None:
                h.lease.heartbeat()
                return
            h.lease.heartbeat(run.rows_done, run.output_tokens)
            if not run.done.is_set() and h.cancel_marker.exists():
                self.loop.abort_job(h.job_id)  # repeated each tick: also catches requests admitted late
        except OSError:
            log.exception("heartbeat of job %s shard %d failed", h.job_id, h.lease.shard_id)

    @staticmethod
    def _guarded(work: Callable[[], None], what: str) -> None:
        try:
            work()
        except Exception:  # noqa: BLE001 - retried at the next interval; housekeeping must go on
            log.exception(what)


_current: WorkerRuntime | None = None


def set_runtime(runtime: WorkerRuntime | None) -> None:
    global _current
    _current = runtime


def current_runtime() -> WorkerRuntime:
    if _current is None:
        raise RuntimeError("no worker runtime in this process: shard tasks run under `batchgen worker`")
    return _current
