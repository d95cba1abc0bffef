"""A running job compacted while it runs: every dashboard query and `status` answers as before, at each
step (raw parts merged, compacted files merged, inputs collected), and the file count goes down."""

from __future__ import annotations

import importlib
import json
import math
import random
import time

import pytest

from dashboard import queries as q
from engine.stats import IterationStats, RequestStats
from jobs.store import Store, connect
from jobs.store.compact import collect_garbage, compact, compact_live_job
from jobs.store.schemas import JobRecord, ShardEvent

catalog = importlib.import_module("jobs.store.catalog")
compact_mod = importlib.import_module("jobs.store.compact")  # the package exports a function `compact`

JOB = "job-live"
SHARD = 8


def _attempt(store: Store, rng: random.Random, shard: int, attempt: int, *, commit: bool, flushes: int = 3):
    att = store.begin_attempt(JOB, shard, attempt, f"w{shard % 3}", num_requests=SHARD, flush_interval_s=1e9)
    now = time.time() - 100
    for lo in range(0, SHARD, math.ceil(SHARD / flushes)):
        outputs, timings = [], []
        for i in range(lo, min(lo + math.ceil(SHARD / flushes), SHARD)):
            rid, out = str(shard * SHARD + i), rng.randint(1, 50)
            outputs.append({"request_id": rid, "output_text": "x" * out, "finish_reason": "stop",
                            "prompt_tokens": rng.randint(5, 60), "output_tokens": out, "error": None})
            arrival = now + rng.uniform(0, 50)
            stats = RequestStats(arrival, arrival + 0.1, arrival + 0.5, arrival + 0.5 + out * 0.02,
                                 rng.randint(0, 1), 10, out)
            timings.append({"request_id": rid, "finish_reason": "stop", **stats.as_row()})
        att.add_outputs(outputs)
        att.add_requests(timings)
        att.flush()
    if commit:
        att.commit()
    else:
        att.fail("killed") if attempt == 1 and shard % 2 else None  # some left open, some failed


def _write(store: Store, rng: random.Random, shards: range) -> None:
    for shard in shards:
        if shard % 4 == 1:  # a first attempt that never commits, then the one that does
            _attempt(store, rng, shard, 1, commit=False)
        _attempt(store, rng, shard, 2 if shard % 4 == 1 else 1, commit=shard % 5 != 3)  # some still running
    buf = store.telemetry_buffer("w0", flush_interval_s=1e9)
    buf.max_rows = 4
    for it in range(12):
        buf.append(IterationStats("w0", shards.start * 100 + it, time.time() - 90 + it, 0.05, 3, 1, 3, 0, 3,
                                  0, 3, 3, 256, 8, 10, 100, 0, 0, 0, [JOB]))
    buf.close()


NOW = time.time()


def _answers(data_dir) -> dict:
    """Every dashboard query over the job, rows normalized (floats to 9 digits) and sorted."""
    now = NOW
    job = {"job_id": JOB}
    asked = {
        "jobs": (q.JOBS_SUMMARY, {"limit": 10}), "job": (q.JOB_SUMMARY, {**job, "limit": 1}),
        "counts": (q.JOB_SHARD_COUNTS, job),
        "page": (q.JOB_SHARDS_PAGE, {**job, "status": None, "limit": 1000, "offset": 0}),
        "shard_workers": (q.JOB_SHARD_WORKERS, {**job, "limit": 100}),
        "outputs": (q.JOB_OUTPUTS_ALL, job),
        "iterations": (q.JOB_ITERATIONS, {**job, "max_points": 5, "t0": 0, "t_end": 1e12}),
        "rolled": (q.JOB_ITERATIONS_ROLLED, {**job, "max_points": 5}),
        "outstanding": (q.JOB_OUTSTANDING_AT, {**job, "points": [now - 80, now - 60, now - 40]}),
        "rate": (q.JOB_OUTPUT_RATE, {**job, "n": 7}), "latency": (q.JOB_LATENCY, {**job, "bins": 5}),
        "preemptions": (q.JOB_PREEMPTIONS, job), "workers": (q.WORKERS, {"now": 1e10, "window_s": 60.0}),
        "worker_shards": (q.WORKER_SHARDS, {}), "latest": (q.WORKER_LATEST_JOB, {}),
        "shard_status": (q.SHARD_STATUS_COUNTS, {}), "rows": (q.ROWS_COMMITTED, {}),
        "requests_live": ("SELECT * FROM requests_live ORDER BY request_id, attempt", {}),
    }
    con = connect(data_dir)
    try:
        out = {}
        for name, (sql, params) in asked.items():
            rows = con.execute(sql, params or None).fetchall()
            out[name] = sorted((tuple(round(v, 9 - int(math.floor(math.log10(abs(v)))))
                                      if isinstance(v, float) and v else v for v in row) for row in rows),
                               key=repr)
        return out
    finally:
        con.close()


def _files(data_dir) -> int:
    return sum(1 for _ in (data_dir / "store").rglob("*.parquet"))


@pytest.fixture
def no_delays(monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)  # a compacted file counts at once
    monkeypatch.setattr(compact_mod, "LIVE_GRACE_S", 0.0)


def test_a_running_job_compacted_in_steps_answers_every_query_the_same(tmp_path, no_delays):
    """The janitor's steps (compact_live_job, collect_garbage): the writers leave compaction to it here."""
    store, rng = Store(tmp_path, compact_as_written=False), random.Random(7)
    store.record_job(JobRecord(JOB, "m", 40 * SHARD, 40, time.time() - 200, json.dumps({"queue": "q"})))
    store.record_shard_events([ShardEvent(JOB, s, "queued", time.time() - 200, num_requests=SHARD)
                               for s in range(40)])
    _write(store, rng, range(0, 12))
    before, files = _answers(tmp_path), _files(tmp_path)
    assert before["job"][0][1] == "running"
    report = compact_live_job(tmp_path, JOB, min_age_s=0, min_parts=4, max_compacted=2)
    assert report.groups >= 4 and report.files_in > 50
    assert _answers(tmp_path) == before  # the raw parts still there, the compacted files counting
    assert collect_garbage(tmp_path) == report.files_in  # a running job's inputs: LIVE_GRACE_S, not GRACE_S
    assert _answers(tmp_path) == before and _files(tmp_path) < files / 4
    for step in range(3):  # more shards land; the compacted files pile up and get merged (max_compacted)
        _write(store, rng, range(12 + 8 * step, 20 + 8 * step))
        before = _answers(tmp_path)
        compact_live_job(tmp_path, JOB, min_age_s=0, min_parts=4, max_compacted=2)
        assert _answers(tmp_path) == before
        collect_garbage(tmp_path)
        assert _answers(tmp_path) == before
    outputs_dir = store.layout.compacted_dir("outputs", JOB)
    assert len(list(outputs_dir.glob("*.parquet"))) <= 3  # max_compacted + the newest
    assert before["job"][0][1] == "running"


def test_compact_takes_running_jobs_past_the_part_threshold_only(tmp_path, no_delays, monkeypatch):
    store, rng = Store(tmp_path, compact_as_written=False), random.Random(3)
    store.record_job(JobRecord(JOB, "m", 10 * SHARD, 10, time.time() - 200, "{}"))
    _write(store, rng, range(0, 3))
    assert compact(tmp_path, min_age_s=0).groups == 1  # only the worker's telemetry: too few job parts
    monkeypatch.setattr(compact_mod, "LIVE_MIN_PARTS", 4)
    before = _answers(tmp_path)
    assert compact(tmp_path, min_age_s=0).groups >= 3  # outputs, requests, shard events (commits: 3 < 4)
    assert compact(tmp_path, min_age_s=3600).groups == 0  # parts younger than min_age_s stay raw
    assert _answers(tmp_path) == before
