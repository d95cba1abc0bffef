"""The engine loop: the one thread of a worker that owns its engine, fed by every shard it holds.

Celery runs shard tasks on a thread pool (`--pool threads`, concurrency >= 2, one message
prefetched per thread). Each task thread hands its shard's requests to the `EngineLoop`, the one
thread that owns the `LLMEngine`, and waits. The loop admits new requests between iterations, so
while one shard's last requests drain, the next shard's requests are already waiting in the engine
and fill the running set: no static-batching tail at shard boundaries.

When the engine itself fails (out of memory, a kernel that does not compile, a device error:
engine.faults) the loop hands every shard it holds back and ends; the worker runtime
(jobs.worker_runtime) then stops the worker.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.faults import describe
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

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
