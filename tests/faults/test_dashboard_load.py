"""Issue 14 item 9: the job page's JSON endpoints under 50 concurrent requests while the job writes.

The page cache serves a result while the store's listing is unchanged, computes each query once
for all the requests waiting on it, and never serves a result older than the files a request saw.
"""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks import dashboard_load as loadbench
from dashboard import create_app
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent

JOB = loadbench.JOB
SHARDS = 200
URLS = [e.format(job=JOB) for e in loadbench.ENDPOINTS]


@pytest.fixture
def data_dir(tmp_path):
    loadbench.seed(str(tmp_path), 4, SHARDS)
    return tmp_path


def rows_done(client) -> int:
    return client.get(f"/api/jobs/{JOB}").json["job"]["rows_done"]


def test_a_new_part_invalidates_the_cache(data_dir):
    app = create_app({"TESTING": True, "DATA_DIR": data_dir})
    cache = app.extensions["batchgen_query_cache"]
    client = app.test_client()
    assert rows_done(client) == 4 * loadbench.ROWS_PER_SHARD
    misses = cache.misses
    assert rows_done(client) == 4 * loadbench.ROWS_PER_SHARD
    assert cache.misses == misses and cache.hits > 0  # nothing changed: served from the cache
    store = Store(data_dir)
    with store.telemetry_buffer(loadbench.WORKER, flush_interval_s=loadbench.NO_AUTO_FLUSH_S) as telemetry:
        loadbench.write_shard(store, 4, telemetry, time.time())
    assert rows_done(client) == 5 * loadbench.ROWS_PER_SHARD  # the new parts are seen at once
    assert cache.misses > misses


def test_concurrent_misses_compute_each_query_once(data_dir):
    one = create_app({"TESTING": True, "DATA_DIR": data_dir})
    for url in URLS:
        assert one.test_client().get(url).status_code == 200
    queries = one.extensions["batchgen_query_cache"].misses

    app = create_app({"TESTING": True, "DATA_DIR": data_dir})
    statuses, start = [], threading.Barrier(50)

    def get(i: int) -> None:
        client = app.test_client()
        start.wait()
        statuses.append(client.get(URLS[i % len(URLS)]).status_code)

    threads = [threading.Thread(target=get, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 50
    assert app.extensions["batchgen_query_cache"].misses == queries  # not 10 times each


def test_cache_off_still_answers(data_dir):
    app = create_app({"TESTING": True, "DATA_DIR": data_dir, "PAGE_CACHE_ENTRIES": 0})
    assert app.extensions["batchgen_query_cache"] is None
    assert rows_done(app.test_client()) == 4 * loadbench.ROWS_PER_SHARD


def test_fifty_concurrent_clients_while_the_job_writes_get_no_errors(data_dir):
    """Through waitress, as served: 50 clients at once over the 5 endpoints while shards commit."""
    proc, base = loadbench.serve(str(data_dir), 256, threads=8)
    done = threading.Event()
    written = []

    def write() -> None:
        store = Store(data_dir)
        flush_s = loadbench.NO_AUTO_FLUSH_S
        with store.telemetry_buffer(loadbench.WORKER, flush_interval_s=flush_s) as telemetry:
            for shard in range(4, SHARDS):
                if done.is_set():
                    return
                loadbench.write_shard(store, shard, telemetry, time.time())
                written.append(shard)
                time.sleep(0.2)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        results = loadbench.burst(base, concurrency=50, requests=1, timeout_s=60.0)
    finally:
        done.set()
        writer.join()
        loadbench.stop(proc)
    assert [e for _, e in results if e] == []
    assert len(results) == 50 and written


def test_job_record_and_events_alone(tmp_path):
    """A job with no parts yet (queued) is served from the cache too, and counts 0 rows."""
    store = Store(tmp_path)
    store.record_job(JobRecord("queued-job", "tiny-random", 10, 2, time.time()))
    store.record_shard_events([ShardEvent("queued-job", s, "queued", time.time()) for s in range(2)])
    client = create_app({"TESTING": True, "DATA_DIR": tmp_path}).test_client()
    for _ in range(2):
        job = client.get("/api/jobs/queued-job").json["job"]
        assert (job["status"], job["rows_done"]) == ("queued", 0)


def test_while_a_newer_result_is_computed_the_previous_one_is_served():
    from dashboard.cache import Listing, QueryCache
    from jobs.store import QueryResult

    def result(n: int) -> QueryResult:
        return QueryResult(["n"], [(n,)], False, 0.0)

    cache = QueryCache(max_stale_s=30.0)
    t0 = time.monotonic()
    assert cache.get("q", {"job_id": "j"}, Listing("a", t0), lambda: result(1)).rows == [(1,)]
    release, computing = threading.Event(), threading.Event()

    def slow() -> QueryResult:
        computing.set()
        release.wait(10)
        return result(2)

    fresh = []
    listing_b = Listing("b", t0 + 1)
    thread = threading.Thread(target=lambda: fresh.append(cache.get("q", {"job_id": "j"}, listing_b, slow)))
    thread.start()
    assert computing.wait(10)
    assert cache.get("q", {"job_id": "j"}, Listing("c", t0 + 2), lambda: result(3)).rows == [(1,)]
    assert cache.stale == 1
    release.set()
    thread.join()
    assert fresh[0].rows == [(2,)]  # the request that computed gets what it listed
    assert cache.get("q", {"job_id": "j"}, Listing("b", t0 + 3), lambda: result(4)).rows == [(2,)]
    # too old to serve while computing: the request waits for (or makes) a result as new as its listing
    assert cache.get("q", {"job_id": "j"}, Listing("d", t0 + 100), lambda: result(5)).rows == [(5,)]
