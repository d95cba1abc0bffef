"""The dashboard's /metrics: the store's view of jobs, shards and workers, parsed with prometheus_client's
parser and checked against the views; per-job series bounded; guarded by the token like every page."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from dashboard import create_app
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent
from jobs.store.workers import WorkerRecord, write_worker_record
from tests.dashboard.conftest import JOB_ID, sql

STATUSES = ("queued", "running", "completed", "failed", "cancelled")


def scrape(client, **headers) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.data[:300]
    assert response.content_type.startswith("text/plain; version=0.0.4")
    families = text_string_to_metric_families(response.get_data(as_text=True))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_metrics_equal_the_views(client, job_data_dir):
    m = scrape(client)
    count = "SELECT status, count(*) AS n FROM {} GROUP BY 1"
    jobs = {r["status"]: r["n"] for r in sql(job_data_dir, count.format("jobs"))}
    shards = {r["status"]: r["n"] for r in sql(job_data_dir, count.format("shards"))}
    for status in STATUSES:
        assert m[("batchgen:jobs", (("status", status),))] == jobs.get(status, 0)
        assert m[("batchgen:shards", (("status", status),))] == shards.get(status, 0)
    job = sql(job_data_dir, f"SELECT * FROM jobs WHERE job_id = '{JOB_ID}'")[0]
    errors = sql(job_data_dir, f"SELECT count(*) AS n FROM outputs WHERE job_id = '{JOB_ID}' "
                               "AND finish_reason = 'error'")[0]["n"]
    labels = (("job", JOB_ID), ("model", "tiny-random"))
    assert m[("batchgen:job_rows", labels)] == job["num_requests"] == 16
    assert m[("batchgen:job_rows_done", labels)] == job["rows_done"] == 16
    assert m[("batchgen:job_output_tokens", labels)] == job["output_tokens"]
    assert m[("batchgen:job_error_rows", labels)] == errors == 1
    assert m[("batchgen:rows_committed", ())] == 16
    for status in STATUSES:
        assert m[("batchgen:job_status", (("job", JOB_ID), ("status", status)))] == (status == "completed")
    assert m[("batchgen:job_shards", (("job", JOB_ID), ("status", "completed")))] == 2
    # the `batchgen run` worker stopped when the job ended: its record says so
    workers = [m[("batchgen:workers", (("state", s),))] for s in ("running", "idle", "gone")]
    assert workers == [0, 0, 1]


def test_a_scraper_asking_for_openmetrics_still_gets_colon_names(client):
    """Prometheus asks for OpenMetrics first; prometheus_client would write batchgen_jobs there."""
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    m = scrape(client, Accept=accept)
    assert ("batchgen:jobs", (("status", "completed"),)) in m
    assert not [name for name, _ in m if name.startswith("batchgen_")]


def test_per_job_series_are_bounded_live_jobs_first(tmp_path):
    store = Store(tmp_path)
    now = time.time()
    for i in range(5):  # five jobs, the oldest one still queued
        store.record_job(JobRecord(f"job-{i}", "m", 4, 1, now - 100 + i))
        store.record_shard_events([ShardEvent(f"job-{i}", 0, "queued", now)])
        if i > 0:
            store.request_cancel(f"job-{i}", "test")
    client = create_app({"TESTING": True, "DATA_DIR": tmp_path, "METRICS_MAX_JOBS": 2}).test_client()
    m = scrape(client)
    exported = {dict(k[1])["job"] for k in m if k[0] == "batchgen:job_rows"}
    assert exported == {"job-0", "job-4"}, "the live job, then the newest finished one"
    assert m[("batchgen:jobs", (("status", "cancelled"),))] == 4, "fleet totals still count every job"


def test_worker_states_count_records(tmp_path):
    now = time.time()
    for worker, beat, stopped in (("a", now, 0.0), ("b", now - 100, 0.0), ("c", now - 5, now - 4)):
        write_worker_record(tmp_path, WorkerRecord(worker, "h", 1, now - 200, beat, 30.0, stopped_ts=stopped))
    m = scrape(create_app({"TESTING": True, "DATA_DIR": tmp_path}).test_client())
    assert [m[("batchgen:workers", (("state", s),))] for s in ("running", "idle", "gone")] == [0, 1, 2]


def test_empty_data_dir_scrapes_zeros(empty_app):
    m = scrape(empty_app.test_client())
    assert m[("batchgen:jobs", (("status", "queued"),))] == 0
    assert not [k for k in m if k[0] == "batchgen:job_rows"]


def test_token_guards_metrics(job_data_dir):
    client = create_app({"TESTING": True, "DATA_DIR": job_data_dir, "TOKEN": "s3cret"}).test_client()
    assert client.get("/metrics").status_code == 401
    assert scrape(client, Authorization="Bearer s3cret")[("batchgen:rows_committed", ())] == 16
