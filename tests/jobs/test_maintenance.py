"""The worker janitor compacts the store now and then, so dashboard queries stay fast on long runs."""

from __future__ import annotations

import logging
import threading
import time

from engine import EngineConfig
from jobs.broker import resolve_broker
from jobs.shards.leases import ShardLeases
from jobs.shards.supervise import maintenance
from jobs.store import JobRecord, Store, connect
from jobs.worker_runtime import WorkerRuntime
from tests.jobs.helpers import MODEL, one_torch_thread, wait_for


def _finished_job(store: Store, job_id: str, rows: int) -> None:
    store.record_job(JobRecord(job_id=job_id, model="tiny-random", num_requests=rows, num_shards=1,
                               submitted_ts=time.time()))
    att = store.begin_attempt(job_id, 0, 1, "w1", num_requests=rows)
    for i in range(rows):
        att.add_outputs([{"request_id": f"r{i}", "output_text": "x", "finish_reason": "stop",
                          "prompt_tokens": 1, "output_tokens": 1, "error": None}])
        att.flush()
    att.commit()


def test_maintenance_compacts_finished_jobs_on_its_interval(tmp_path, monkeypatch):
    store = Store(tmp_path)
    _finished_job(store, "job-a", 4)
    settings = resolve_broker(tmp_path, queue="maint-test")
    raw = tmp_path / "store" / "tables" / "outputs" / "raw" / "job-a"
    compacted = tmp_path / "store" / "tables" / "outputs" / "compacted" / "job-a"
    assert len(list(raw.glob("*.parquet"))) == 4

    monkeypatch.setenv("BATCHGEN_COMPACT_EVERY_S", "3600")
    janitor = maintenance(str(tmp_path), settings)
    janitor()
    assert not list(compacted.glob("*.parquet"))  # not due yet

    monkeypatch.setenv("BATCHGEN_COMPACT_EVERY_S", "0")
    janitor()
    assert len(list(compacted.glob("*.parquet"))) == 1
    assert connect(tmp_path).execute("SELECT count(*) FROM outputs").fetchone()[0] == 4


def test_a_long_janitor_pass_does_not_stop_the_heartbeats_of_held_shards(tmp_path, monkeypatch):
    """A compaction of a big store takes minutes: it runs beside the housekeeping thread, so the
    worker's leases stay alive however long it takes (on one thread they would expire under it)."""
    monkeypatch.setenv("BATCHGEN_LEASE_TTL_S", "1")  # heartbeats every 0.2 s
    started, release = threading.Event(), threading.Event()

    def janitor():  # one pass that outlasts the lease's time-to-live three times over
        started.set()
        release.wait(3.0)

    lease = ShardLeases(tmp_path / "leases").try_claim(0, "w-maint")
    assert lease is not None
    with one_torch_thread():
        rt = WorkerRuntime(EngineConfig(model=MODEL, max_num_seqs=2), "w-maint", tmp_path / "data",
                           janitor=janitor, janitor_interval_s=0.1).start()
        try:
            with rt.holding("job-m", lease, tmp_path / "no-cancel-marker"):
                wait_for(started.is_set, 30, "the janitor's pass to start", poll=0.02)
                beats = []
                t_end = time.monotonic() + 2.5
                while time.monotonic() < t_end:  # while the pass runs
                    beats.append(lease.leases.view(0, lease.attempt).state.heartbeat_ts)
                    time.sleep(0.1)
                assert not release.is_set() and started.is_set()
                gaps = [b - a for a, b in zip(beats, beats[1:], strict=False) if b > a]
                assert len(gaps) >= 5, beats  # the heartbeat kept moving during the pass
                assert time.time() - beats[-1] < 1.0  # and was fresh at its end: never expired
        finally:
            release.set()
            rt.stop()


def test_a_stopping_worker_waits_for_the_janitor_pass_but_not_forever(tmp_path, monkeypatch, caplog):
    import jobs.worker_runtime as worker_runtime

    passes: list[str] = []
    started, release = threading.Event(), threading.Event()

    def janitor():
        started.set()
        passes.append("start")
        release.wait(5.0)
        passes.append("end")

    with one_torch_thread():
        rt = WorkerRuntime(EngineConfig(model=MODEL, max_num_seqs=2), "w-stop", tmp_path / "data",
                           janitor=janitor, janitor_interval_s=0.05).start()
        wait_for(started.is_set, 30, "the janitor's pass to start", poll=0.02)
        threading.Timer(0.5, release.set).start()
        rt.stop()  # waits for the pass in progress (a compaction is left whole when it can be)
    assert passes == ["start", "end"]

    monkeypatch.setattr(worker_runtime, "MAINTENANCE_JOIN_S", 0.3)
    started.clear()
    release.clear()
    stuck = threading.Event()
    with one_torch_thread():
        rt = WorkerRuntime(EngineConfig(model=MODEL, max_num_seqs=2), "w-stuck", tmp_path / "data2",
                           janitor=lambda: (started.set(), stuck.wait(30)), janitor_interval_s=0.05).start()
        wait_for(started.is_set, 30, "the janitor's pass to start", poll=0.02)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="jobs.worker_runtime"):
            rt.stop()
        stuck.set()
    assert time.monotonic() - t0 < 15  # bounded by the join, not by the pass
    assert "still running" in caplog.text and "w-stuck" in caplog.text
