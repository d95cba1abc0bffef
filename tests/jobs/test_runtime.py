"""The worker runtime in-process: process_shard (the plain function the Celery task wraps) over one
long-lived engine; idempotence, cancellation, retries, engine failures. No broker involved."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from jobs.broker import resolve_broker
from jobs.engine_loop import EngineRequest, ShardRun
from jobs.manifest import JobPaths
from jobs.shard_runner import ShardTask, backoff_s, process_shard
from jobs.shards.ledger import ShardLedger
from jobs.submit import JobRequest, prepare_job
from tests.jobs.helpers import MODEL, outputs_of, query, shards_of, wait_for, worker_runtime, write_prompts

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runtime") / "data"


@pytest.fixture(scope="module")
def runtime(data_dir):
    with worker_runtime(data_dir, "w-inproc", max_num_seqs=4) as rt:
        yield rt


def _job(data_dir, tmp_path, n, shard_size, **kw):
    src = tmp_path / f"in{n}.parquet"
    texts = write_prompts(src, n)
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    req = JobRequest(str(src), str(data_dir), {"model": MODEL}, sampling, shard_size, retry_backoff_s=0.01,
                     **kw)
    return prepare_job(req, resolve_broker(data_dir, embedded=True)), texts


def _task(m, shard_id, retries=0):
    return ShardTask(m.job_id, shard_id, m.data_dir, retries)


def test_shard_commits_greedy_outputs_once(runtime, data_dir, tmp_path):
    m, texts = _job(data_dir, tmp_path, 5, 5)
    out = process_shard(_task(m, 0), runtime)
    assert (out.result, out.attempt, out.rows) == ("committed", 1, 5)
    # --apply-chat-template auto (the default): the model has a template, so a prompt is a user turn
    ref = LLM(MODEL).chat([[{"role": "user", "content": t}] for t in texts],
                          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    rows = outputs_of(data_dir, m.job_id)
    assert [r["output_text"] for r in rows] == [o.text for o in ref]
    assert [r["output_tokens"] for r in rows] == [len(o.token_ids) for o in ref]
    assert [r["row_tag"] for r in rows] == [f"tag{i}" for i in range(5)]
    timing = query(data_dir, "SELECT * FROM requests WHERE job_id = ?", [m.job_id])
    assert len(timing) == 5 and all(t["worker_id"] == "w-inproc" and t["e2e_s"] > 0 for t in timing)
    again = process_shard(_task(m, 0), runtime)
    assert (again.result, again.reason) == ("skipped", "already committed")
    assert query(data_dir, "SELECT count(*) AS n FROM outputs WHERE job_id = ?", [m.job_id])[0]["n"] == 5
    its = wait_for(lambda: query(data_dir, "SELECT * FROM iterations WHERE list_contains(job_ids, ?)",
                                 [m.job_id]), 10, "iteration telemetry (flushed when the engine idles)")
    assert all(i["worker_id"] == "w-inproc" and i["num_scheduled_seqs"] > 0 for i in its)
    assert sum(i["decode_tokens"] + i["num_prefill_seqs"] for i in its) >= out.output_tokens


def test_next_shard_is_admitted_while_the_current_one_drains(runtime):
    """Two shard runs in one engine: the second's requests run before the first's last one ends."""
    long_p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short_p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    a = ShardRun("j", "j:0:1", [EngineRequest("j:0:1:0", "a long one", None, long_p)] +
                 [EngineRequest(f"j:0:1:{i}", f"short {i}", None, short_p) for i in range(1, 4)])
    b = ShardRun("j", "j:1:1", [EngineRequest(f"j:1:1:{i}", f"next {i}", None, short_p) for i in range(4)])
    runtime.loop.submit(a)
    runtime.loop.submit(b)
    assert a.done.wait(60) and b.done.wait(60)
    a_end = max(o.metrics.finished_ts for o in a.outputs.values())
    b_end = max(o.metrics.finished_ts for o in b.outputs.values())
    b_first = min(o.metrics.scheduled_ts for o in b.outputs.values())
    assert b_first < a_end and b_end < a_end, "shard b ran while shard a's long request was still running"


def test_cancel_stops_running_rows_and_skips_queued_shards(runtime, data_dir, tmp_path, monkeypatch):
    engine = runtime.loop.engine
    step = engine.step

    def slow_step():  # the tiny model decodes 1900 tokens in under a heartbeat tick: pace it
        time.sleep(0.003)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    m, _ = _job(data_dir, tmp_path, 6, 3)
    paths = JobPaths.of(m.data_dir, m.job_id)
    m.sampling_defaults.update(max_tokens=1900, ignore_eos=True)  # long enough to be cancelled mid-way
    from jobs.manifest import write_manifest

    write_manifest(m, paths)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=process_shard(_task(m, 0), runtime)))
    start = runtime.iterations
    worker.start()
    wait_for(lambda: runtime.iterations > start + 20, 30, "the shard to be running")
    paths.cancel_marker.write_text("test\n")
    worker.join(60)
    assert result["out"].result == "cancelled"
    reasons = [r["finish_reason"] for r in outputs_of(data_dir, m.job_id)]
    assert len(reasons) == 3 and "cancelled" in reasons
    skipped = process_shard(_task(m, 1), runtime)
    assert (skipped.result, skipped.reason) == ("skipped", "job cancelled")
    assert shards_of(data_dir, m.job_id)[1]["status"] == "cancelled"


def test_corrupt_shard_retries_with_backoff_then_fails_with_its_reason(runtime, data_dir, tmp_path):
    m, _ = _job(data_dir, tmp_path, 4, 2, max_retries=2)
    shard_file = Path(m.shard(1).path)
    good = shard_file.read_bytes()
    shard_file.write_bytes(b"garbage" * 10)
    outcomes = [process_shard(_task(m, 1, retries), runtime) for retries in range(3)]
    assert [o.result for o in outcomes] == ["retry", "retry", "failed"]
    assert [o.retry_in_s for o in outcomes[:2]] == [backoff_s(0.01, 0), backoff_s(0.01, 1)]
    assert [o.attempt for o in outcomes] == [1, 2, 3]
    row = shards_of(data_dir, m.job_id)[1]
    assert row["status"] == "failed" and row["attempts"] == 3
    assert "unreadable" in row["error"] and "gave up after 3 tries" in row["error"]
    shard_file.write_bytes(good)
    assert process_shard(_task(m, 1), runtime).result == "committed"
    assert shards_of(data_dir, m.job_id)[1]["status"] == "completed"


def test_wrong_model_fails_the_attempt(runtime, data_dir, tmp_path):
    m, _ = _job(data_dir, tmp_path, 2, 2, max_retries=0)
    m.engine["model"] = "smollm2-135m"
    from jobs.manifest import write_manifest

    write_manifest(m, JobPaths.of(m.data_dir, m.job_id))
    out = process_shard(_task(m, 0), runtime)
    assert out.result == "failed" and "wants model 'smollm2-135m'" in out.reason


DEVICE_FAULTS = {
    "out-of-memory": lambda: __import__("torch").OutOfMemoryError("CUDA out of memory (4 GiB)"),
    "sticky-device-error": lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
}


@pytest.mark.parametrize("kind", list(DEVICE_FAULTS))
def test_a_device_fault_hands_the_shards_back_and_stops_the_worker(data_dir, tmp_path, kind):
    """The engine's fault is not the rows': the shard goes back to the queue (no error row, no
    output written, no retry used), the worker takes nothing more, says why in its record (which
    `batchgen status` and the dashboard show) and asks to be stopped."""
    import os
    import socket

    from engine import EngineConfig
    from jobs.shards.supervise import retries_used
    from jobs.status import engine_faults, render_jobs
    from jobs.store import WorkerRecord, read_worker_records
    from jobs.worker_runtime import WorkerRuntime
    from tests.jobs.helpers import one_torch_thread

    now, worker_id = time.time(), f"w-fault-{kind}"
    record = WorkerRecord(worker_id, socket.gethostname(), os.getpid(), now, now, 30.0, model=MODEL)
    fatal = threading.Event()
    with one_torch_thread():
        rt = WorkerRuntime(EngineConfig(model=MODEL, max_num_seqs=4), worker_id, data_dir, record=record,
                           on_fatal=fatal.set).start()
        try:
            m, _ = _job(data_dir, tmp_path, 4, 2, max_retries=3)
            model = rt.loop.engine.runner.model
            real, calls = model.forward, []

            def forward(*args, **kwargs):
                calls.append(1)
                if len(calls) > 2:  # a few good steps first: the shard is half-way
                    raise DEVICE_FAULTS[kind]()
                return real(*args, **kwargs)

            model.forward = forward
            out = process_shard(_task(m, 0), rt)
            assert out.result == "handed_back", out.describe()
            assert "engine failed" in out.reason and worker_id in out.reason
            assert len(calls) == 3  # not re-run in halves
            assert outputs_of(data_dir, m.job_id) == []  # no error rows
            leases = ShardLedger(m.data_dir, m.job_id).leases
            attempts = leases.claimed_attempts()[0]
            assert leases.view(0, attempts[-1]).state.state == "handed_back"
            assert retries_used(leases, 0, attempts) == 0
            assert shards_of(data_dir, m.job_id)[0]["status"] == "queued"
            wait_for(fatal.is_set, 30, "the worker to ask to be stopped")
            assert rt.engine_fault is not None and not rt.loop.alive
            later = process_shard(_task(m, 1), rt)  # a delivery after the fault goes back untouched
            assert later.result == "handed_back" and later.attempt == 0
        finally:
            rt.stop()
    saved = next(r for r in read_worker_records(data_dir) if r.worker_id == worker_id)
    assert saved.engine_error == rt.engine_fault and saved.stopped_ts > 0
    assert type(DEVICE_FAULTS[kind]()).__name__ in saved.engine_error
    faults = [f for f in engine_faults(str(data_dir)) if f["worker_id"] == worker_id]
    assert len(faults) == 1
    text = render_jobs([], faults)
    assert f"worker {worker_id}" in text and saved.engine_error in text and "went back to the queue" in text


def test_chat_messages_rows_use_the_chat_template(runtime, data_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    conversations = [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "name a color"}]]
    src = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": conversations, "stop": [None, "\n"]}), src)
    req = JobRequest(str(src), str(data_dir), {"model": MODEL}, {"max_tokens": 8, "temperature": 0.0}, 2)
    m = prepare_job(req, resolve_broker(data_dir, embedded=True))
    assert process_shard(_task(m, 0), runtime).result == "committed"
    ref = LLM(MODEL).chat(conversations, [SamplingParams(max_tokens=8, temperature=0.0),
                                          SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"])])
    rows = outputs_of(data_dir, m.job_id)
    assert [(r["output_text"], r["finish_reason"], r["prompt_tokens"]) for r in rows] == \
        [(o.text, o.finish_reason, len(o.prompt_token_ids)) for o in ref]


def test_the_engine_thread_never_writes_telemetry_while_it_has_work(runtime, monkeypatch):
    """A step's telemetry row is queued on the engine's thread and written by the housekeeping
    thread (or when the engine idles): a part's write never takes an engine step's time."""
    writes = []
    engine = runtime.loop.engine
    for name in ("extend", "flush"):
        real = getattr(runtime.telemetry, name)

        def recorded(*args, _real=real, _name=name):
            rows = list(args[0]) if _name == "extend" else []
            busy = engine.has_unfinished_requests()
            writes.append((_name, threading.current_thread().name, busy, len(rows)))
            return _real(rows) if _name == "extend" else _real(*args)

        monkeypatch.setattr(runtime.telemetry, name, recorded)
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    run = ShardRun("t", "t:0:1", [EngineRequest(f"t:0:1:{i}", f"prompt {i}", None, p) for i in range(3)])
    runtime.loop.submit(run)
    assert run.done.wait(60)
    wait_for(lambda: any(w[0] == "flush" and w[1] == "engine-loop" for w in writes), 10, "the idle flush")
    assert [w for w in writes if w[1] == "engine-loop" and w[2]] == []
    assert sum(w[3] for w in writes if w[0] == "extend") >= 30  # every step's row was written, off the steps
