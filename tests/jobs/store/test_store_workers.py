"""Worker records (jobs.store.workers): round trip, the three states, and files that cannot be read."""

from __future__ import annotations

import logging

from jobs.store.workers import WorkerRecord, read_worker_records, workers_dir, write_worker_record


def _record(worker_id: str = "celery@host-1", **kw) -> WorkerRecord:
    return WorkerRecord(worker_id, "host-1", 42, started_ts=100.0, heartbeat_ts=200.0, ttl_s=30.0, **kw)


def test_round_trip_and_rewrite(tmp_path):
    write_worker_record(tmp_path, _record(model="m", metrics_url="http://h:9400/metrics"))
    write_worker_record(tmp_path, _record(model="m", iterations=7))
    [got] = read_worker_records(tmp_path)
    assert got == _record(model="m", iterations=7)
    assert [p.name for p in workers_dir(tmp_path).iterdir()] == ["celery_host-1.json"], "no temporary left"


def test_states_alive_lost_stopped():
    alive = _record()
    assert (alive.state(229.0), alive.gone_since(229.0)) == ("alive", None)
    assert (alive.state(231.0), alive.gone_since(231.0)) == ("lost", 200.0)
    stopped = _record(stopped_ts=210.0)
    assert (stopped.state(211.0), stopped.gone_since(211.0)) == ("stopped", 210.0)


def test_no_directory_is_no_workers(tmp_path):
    assert read_worker_records(tmp_path / "nothing") == []


def test_unreadable_or_foreign_files_are_skipped_with_a_warning(tmp_path, caplog):
    write_worker_record(tmp_path, _record())
    (workers_dir(tmp_path) / "broken.json").write_text("{not json")
    (workers_dir(tmp_path) / "partial.json").write_text('{"worker_id": "x"}')
    with caplog.at_level(logging.WARNING, logger="jobs.store.workers"):
        records = read_worker_records(tmp_path)
    assert [r.worker_id for r in records] == ["celery@host-1"]
    assert "broken.json" in caplog.text and "partial.json" in caplog.text
