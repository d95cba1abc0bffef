"""A busy writer never makes a page fail: pages are hammered while a worker writes and a compactor merges."""

from __future__ import annotations

import threading
import time

from dashboard import create_app
from engine.stats import IterationStats, RequestStats
from jobs.store.compact import collect_garbage, compact_group, compact_job
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent

JOB = "busy"
WORKER = "busy-worker"
NUM_SHARDS = 400  # more than the writer gets through while the pages are read
PER_SHARD = 4
# Old files go only after a grace (the design's "old files removed later"; the store's default is
# 600 s, and workers collect garbage once a minute). Here: the shortest grace the store allows and a
# collection every second, so that files are deleted many times while the pages are read.
QUERY_TIMEOUT_S = 2.0
GRACE_S = 0.0
GC_EVERY_S = 1.0


def write_shard(store: Store, shard_id: int, telemetry) -> None:
    """One shard as a worker writes it: running event, outputs, request timings, iterations, commit."""
    attempt = store.begin_attempt(JOB, shard_id, 1, WORKER, num_requests=PER_SHARD)
    now = time.time()
    for i in range(PER_SHARD):
        rid = str(shard_id * PER_SHARD + i)
        attempt.add_outputs([{"request_id": rid, "output_text": "x" * 8, "finish_reason": "length",
                              "prompt_tokens": 5, "output_tokens": 8, "error": None}])
        attempt.add_request(rid, "length", RequestStats(now - 0.2, now - 0.19, now - 0.1, now, 0, 5, 8))
        telemetry.append(IterationStats(iteration=shard_id * PER_SHARD + i, ts=now, duration_s=0.01,
                                        num_running=3, num_waiting=1, decode_tokens=3, scheduled_tokens=3,
                                        token_budget=64, max_num_seqs=8, kv_blocks_used=5, kv_blocks_total=40,
                                        job_ids=[JOB]))
    telemetry.flush()
    attempt.commit()


def writer(data_dir, stop: threading.Event, errors: list, deleted: list) -> None:
    try:
        store = Store(data_dir)
        layout = store.layout
        last_gc = time.monotonic()
        with store.telemetry_buffer(WORKER, flush_interval_s=0.0) as telemetry:
            for shard_id in range(NUM_SHARDS):
                if stop.is_set():
                    break
                write_shard(store, shard_id, telemetry)
                if shard_id % 5 == 4:
                    compact_job(data_dir, JOB, force=True)
                    compact_group(layout, "iterations", WORKER)
                if time.monotonic() - last_gc >= GC_EVERY_S:
                    deleted.append(collect_garbage(data_dir, grace_s=GRACE_S))
                    last_gc = time.monotonic()
    except Exception as exc:  # reported by the test
        errors.append(exc)


def test_pages_never_fail_while_a_worker_writes_and_compaction_deletes(tmp_path):
    store = Store(tmp_path)
    store.record_job(JobRecord(JOB, "tiny-random", NUM_SHARDS * PER_SHARD, NUM_SHARDS, time.time()))
    store.record_shard_events([ShardEvent(JOB, s, "queued", time.time()) for s in range(NUM_SHARDS)])
    client = create_app({"TESTING": True, "DATA_DIR": tmp_path,
                         "PAGE_QUERY_TIMEOUT_S": QUERY_TIMEOUT_S}).test_client()
    stop, errors, deleted = threading.Event(), [], []
    thread = threading.Thread(target=writer, args=(tmp_path, stop, errors, deleted))
    thread.start()
    urls = ["/", f"/jobs/{JOB}", "/api/jobs", f"/api/jobs/{JOB}/iterations", f"/api/jobs/{JOB}/throughput",
            f"/api/jobs/{JOB}/latency", "/workers"]
    seen, deadline = [], time.monotonic() + 6.0
    try:
        while (time.monotonic() < deadline or len(seen) < 3) and thread.is_alive():
            for url in urls:
                response = client.get(url)
                assert response.status_code == 200, (url, response.data[:300])
            seen.append(client.get("/api/jobs").json["jobs"][0]["rows_done"])
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert sum(deleted) > 0  # files really were deleted while the pages were read
    assert seen == sorted(seen) and seen[-1] > seen[0]  # progress only moves forward
