"""The worker runtime: one long-lived engine per worker process, fed by every shard it holds.

Celery runs shard tasks on a thread pool (`--pool threads`, concurrency >= 2, one message
prefetched per thread). Each task thread hands its shard's requests to the `EngineLoop`, the one
thread that owns the `LLMEngine`, and waits. The loop admits new requests between iterations, so
while one shard's last requests drain, the next shard's requests are already waiting in the engine
and fill the running set: no static-batching tail at shard boundaries.

Beside the loop, a housekeeping thread writes the engine's iteration telemetry (the loop's thread
only queues each step's row), keeps each held shard's lease alive (heartbeat with progress), aborts
the requests of a job whose cancel marker appears, periodically re-queues the shards of dead workers
(`jobs.supervise.requeue_dead_shards`), and keeps this worker's record (`jobs.store.workers`) fresh
so the dashboard can tell an idle worker from a gone one.

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
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.faults import describe
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import IterationStats
from jobs.leases import HEARTBEAT_FRACTION, Lease, lease_ttl_s
from jobs.manifest import JobManifest
from jobs.metrics import WorkerMetrics
from jobs.store import Store, WorkerRecord, write_worker_record

log = logging.getLogger(__name__)

IDLE_WAKE_S = 0.5  # an idle engine loop wakes this often (telemetry flush, stop checks)


@dataclass
class EngineRequest:
    """One sample of one row of a shard as the engine sees it."""

    request_id: str  # unique in the engine: "<job>:<shard>:<attempt>:<row in shard>:<sample>"
    prompt: str | None  # text prompt, or None when messages are given
    messages: list[dict] | None  # chat messages (the model's chat template applies)
    params: SamplingParams
    row: int | None = None  # the row in the shard (a row with n samples has n requests); None = its own


@dataclass
class ShardRun:
    """One shard attempt inside the engine: its requests, their outputs as they finish."""

    job_id: str
    key: str  # "<job>:<shard>:<attempt>"
    requests: list[EngineRequest]
    outputs: dict[str, RequestOutput] = field(default_factory=dict)  # request id -> finished output
    output_tokens: int = 0  # tokens of the finished outputs
    rows_done: int = 0  # rows whose every sample finished
    cancelled: bool = False  # its job was cancelled; unfinished rows came back "cancelled"
    handed_back: bool = False  # unfinished rows stopped, the shard goes back to the queue (no retry used)
    hand_back_reason: str = "the worker was interrupted"  # why it was handed back
    error: str | None = None  # set when the worker stopped under it (the attempt is retried)
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._row_of = {r.request_id: r.request_id if r.row is None else r.row for r in self.requests}
        self._left: dict = {}  # row -> samples not finished yet
        for row in self._row_of.values():
            self._left[row] = self._left.get(row, 0) + 1

    def finish(self, out: RequestOutput) -> None:
        self.outputs[out.request_id] = out
        self.output_tokens += len(out.token_ids)
        row = self._row_of.get(out.request_id)
        self._left[row] = self._left.get(row, 1) - 1
        if self._left[row] == 0:
            self.rows_done += 1
        if len(self.outputs) == len(self.requests):
            self.done.set()

    def fail(self, error: str) -> None:
        self.error = error
        self.done.set()

    def hand_back(self, reason: str) -> None:
        """End the run without its rows: the shard goes back to the queue for another worker."""
        self.handed_back, self.hand_back_reason = True, reason
        self.done.set()


class EngineLoop:
    """The thread that owns the engine: admits shards, steps, routes finished outputs back.

    A step that raises failed the engine itself (a request's fault finishes that request inside the
    step, engine.faults): the loop hands every shard it holds back, records why in `fault`, tells
    `on_fault` and ends. It does not rebuild the engine: after an out-of-memory or a device error
    the device is not to be trusted in this process, and another worker takes the shards."""

    def __init__(self, make_engine: Callable[[], object], on_idle: Callable[[], None] = lambda: None,
                 on_finished: Callable[[RequestOutput], None] = lambda out: None,
                 on_fault: Callable[[str], None] = lambda reason: None) -> None:
        self.engine = make_engine()
        self._on_idle = on_idle
        self._on_finished = on_finished  # every request the engine finishes, whoever owned it
        self._on_fault = on_fault  # called once, from the loop's thread, when the engine failed
        self.fault: str | None = None  # why the engine failed (the loop has ended)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._owner: dict[str, ShardRun] = {}  # engine request id -> its shard run
        self._runs: dict[str, ShardRun] = {}  # key -> shard runs in the engine
        self._stopping = False
        self._handing_back = False  # set by hand_back(): no shard runs to its end any more
        self._thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def submit(self, run: ShardRun) -> None:
        """Queue a shard's requests for admission (thread-safe); `run.done` is set when all finished."""
        if not run.requests:
            run.done.set()
            return
        self._inbox.put(("submit", run))

    def abort_job(self, job_id: str) -> None:
        """Cancel the job's requests in the engine (thread-safe); they finish as "cancelled"."""
        self._inbox.put(("abort", job_id))

    def hand_back(self) -> None:
        """Stop every shard in the engine, and every one submitted from now on, as handed back
        (thread-safe): their unfinished requests are aborted and each run is done soon after."""
        self._inbox.put(("hand_back", None))

    def stop(self, timeout: float | None = None) -> None:
        """Stop after failing whatever is still in the engine (warm shutdown has drained it first)."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the loop
    def _main(self) -> None:
        while self.fault is None:
            self._drain_inbox(block=not self.engine.has_unfinished_requests())
            if self._stopping:
                self._fail_all("worker stopped before the shard finished")
                self._on_idle()
                return
            if self.engine.has_unfinished_requests():
                self._step()
            else:
                self._on_idle()
        self._on_idle()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAKE_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, what: str, arg) -> None:
        if what == "submit":
            self._admit(arg)
        elif what == "abort":
            self._abort(arg)
        elif what == "hand_back":
            self._hand_back_all()
        elif what == "stop":
            self._stopping = True

    def _admit(self, run: ShardRun) -> None:
        if self._handing_back:
            run.handed_back = True
            run.done.set()
            return
        self._runs[run.key] = run
        try:
            for req in run.requests:
                self.engine.add_request(req.request_id, req.prompt, req.params, messages=req.messages,
                                        job_id=run.job_id)
                self._owner[req.request_id] = run
        except Exception as exc:  # noqa: BLE001 - a request the engine refuses fails its shard attempt
            self._drop(run, f"engine refused a request: {exc!r}")

    def _abort(self, job_id: str) -> None:
        ids = [rid for rid, run in self._owner.items() if run.job_id == job_id]
        for run in self._runs.values():
            if run.job_id == job_id:
                run.cancelled = True
        self.engine.abort_request(ids)

    def _hand_back_all(self) -> None:
        self._handing_back = True
        for run in self._runs.values():
            run.handed_back = True
        self.engine.abort_request(list(self._owner))

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine failed, not a request (see the class)
            self._engine_failed(exc)
            return
        for out in finished:
            self._on_finished(out)
            run = self._owner.pop(out.request_id, None)
            if run is None:
                continue  # a request of a run already dropped
            run.finish(out)
            if run.done.is_set():
                self._runs.pop(run.key, None)

    def _drop(self, run: ShardRun, error: str) -> None:
        ids = [rid for rid, owner in self._owner.items() if owner is run]
        for rid in ids:
            del self._owner[rid]
        self.engine.abort_request(ids)
        self._runs.pop(run.key, None)
        run.fail(error)

    def _fail_all(self, error: str) -> None:
        for run in list(self._runs.values()):
            self._drop(run, error)

    def _engine_failed(self, exc: BaseException) -> None:
        """Hand every shard back (no row of theirs is written, no retry used) and end the loop."""
        self.fault = f"engine failed: {describe(exc)}"
        log.error("%s; handing %d shard attempt(s) back and stopping the engine loop", self.fault,
                  len(self._runs), exc_info=exc)
        for run in list(self._runs.values()):
            run.hand_back(self.fault)
        self._runs.clear()
        self._owner.clear()
        self._on_fault(self.fault)
        self._hand_back_inbox()

    def _hand_back_inbox(self) -> None:
        """Shards submitted after the fault: handed back too (run_shard also checks `fault`)."""
        while True:
            try:
                what, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "submit":
                arg.hand_back(self.fault)


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
        return self

    def stop(self) -> None:
        self._stop.set()
        self.loop.stop(timeout=60)
        self._house.join(timeout=10)
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
        last_janitor = last_record = time.monotonic()
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
            if self._janitor is not None and time.monotonic() - last_janitor >= self._janitor_interval_s:
                last_janitor = time.monotonic()
                self._guarded(self._janitor, "re-queueing dead shards failed")

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
