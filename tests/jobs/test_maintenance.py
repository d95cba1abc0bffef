"""The worker janitor compacts the store now and then, so dashboard queries stay fast on long runs."""

from __future__ import annotations

import time

from jobs.broker import resolve_broker
from jobs.shards.supervise import maintenance
from jobs.store import JobRecord, Store, connect


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
