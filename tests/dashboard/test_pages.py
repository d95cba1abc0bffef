"""Every page and endpoint over a data dir filled by a real job; the numbers they show equal SQL."""

from __future__ import annotations

import html
import io
import re
import time

import pyarrow.parquet as pq
import pytest

from dashboard import create_app
from dashboard.formatting import fmt_duration, fmt_num, fmt_rate
from engine.stats import IterationStats, RequestStats
from jobs.store.layout import init_data_dir
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent
from jobs.store.workers import WorkerRecord, write_worker_record
from tests.dashboard.conftest import JOB_ID, as_json, sql, sql_one

PAGES = ["/", f"/jobs/{JOB_ID}", "/workers", "/sweeps", "/sql"]
ENDPOINTS = ["/api/jobs", f"/api/jobs/{JOB_ID}", f"/api/jobs/{JOB_ID}/iterations",
             f"/api/jobs/{JOB_ID}/throughput", f"/api/jobs/{JOB_ID}/latency", f"/api/jobs/{JOB_ID}/outputs",
             "/api/workers", "/api/sweeps"]


def stat(page: str, name: str) -> str:
    """data-value of a job page's stat card."""
    m = re.search(rf'data-stat="{name}" data-value="([^"]*)"', page)
    assert m, f"no stat {name} on the page"
    return m.group(1)


@pytest.mark.parametrize("url", PAGES)
def test_page_renders(client, url):
    response = client.get(url)
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert '<link rel="icon" href="data:,">' in page
    assert "cdn" not in page.lower() and "https://" not in page  # everything served from here
    assert response.headers["Content-Security-Policy"].startswith("default-src 'self'")


@pytest.mark.parametrize("url", ENDPOINTS)
def test_endpoint_answers_json(client, url):
    response = client.get(url)
    assert response.status_code == 200
    assert response.mimetype == "application/json"
    assert b"NaN" not in response.data and b"Infinity" not in response.data


def test_static_assets_are_served(client):
    for path in ("/static/vendor/uplot/uPlot.iife.min.js", "/static/vendor/uplot/uPlot.min.css",
                 "/static/app.js", "/static/job.js", "/static/jobs.js", "/static/app.css"):
        with client.get(path) as response:
            assert response.status_code == 200, path


def test_jobs_page_numbers_equal_sql(client, job_data_dir):
    want = sql_one(job_data_dir, f"SELECT *, epoch(finished_at) - epoch(started_at) AS elapsed_s FROM jobs "
                                 f"WHERE job_id = '{JOB_ID}'")
    errors = sql_one(job_data_dir, f"SELECT count(*) AS n FROM outputs WHERE job_id = '{JOB_ID}' "
                                   "AND finish_reason = 'error'")["n"]
    rate = want["output_tokens"] / want["elapsed_s"]
    page = client.get("/").get_data(as_text=True)
    row = re.search(rf'<tr data-job-id="{JOB_ID}">(.*?)</tr>', page, re.S).group(1)
    assert want["status"] == "completed" and "status-completed" in row
    assert f"{fmt_num(want['rows_done'])} / {fmt_num(want['num_requests'])}" in row
    assert re.search(rf'data-field="output_tokens_per_s">{re.escape(fmt_rate(rate))}<', row)
    assert errors == 1 and re.search(r'data-field="errors"[^>]*>1<', row)

    api = as_json(client.get("/api/jobs"))["jobs"][0]
    assert api["rows_done"] == want["rows_done"] == 16
    assert api["output_tokens"] == want["output_tokens"]
    assert api["error_rows"] == errors
    assert api["output_tokens_per_s"] == pytest.approx(rate, rel=1e-6)
    assert api["eta_s"] is None and api["live"] is False


def test_job_page_numbers_equal_sql(client, job_data_dir):
    want = sql_one(job_data_dir, f"SELECT *, epoch(finished_at) - epoch(started_at) AS elapsed_s FROM jobs "
                                 f"WHERE job_id = '{JOB_ID}'")
    preempted = sql_one(job_data_dir,
                        f"SELECT sum(num_preemptions) AS n FROM requests WHERE job_id = '{JOB_ID}'")
    page = client.get(f"/jobs/{JOB_ID}").get_data(as_text=True)
    assert int(stat(page, "rows_done")) == want["rows_done"]
    assert int(stat(page, "num_requests")) == want["num_requests"]
    assert int(stat(page, "output_tokens")) == want["output_tokens"]
    assert int(stat(page, "request_preemptions")) == preempted["n"]
    elapsed = want["elapsed_s"]
    assert float(stat(page, "elapsed_s")) == pytest.approx(elapsed, rel=1e-6)
    rate = want["output_tokens"] / elapsed
    assert float(stat(page, "output_tokens_per_s")) == pytest.approx(rate, rel=1e-6)


def test_job_page_latency_table_equals_sql(client, job_data_dir):
    want = sql_one(job_data_dir, f"""
        SELECT count(*) AS n, quantile_cont(ttft_s, 0.5) AS p50, quantile_cont(ttft_s, 0.9) AS p90,
               quantile_cont(ttft_s, 0.99) AS p99
        FROM requests WHERE job_id = '{JOB_ID}' AND first_token_ts > 0""")
    itl = sql_one(job_data_dir, f"SELECT quantile_cont(tpot_s, 0.5) AS p50 FROM requests "
                                f"WHERE job_id = '{JOB_ID}' AND output_tokens > 1 AND first_token_ts > 0")
    page = client.get(f"/jobs/{JOB_ID}").get_data(as_text=True)
    ttft_row = re.search(r'<tr data-metric="ttft_s">(.*?)</tr>', page, re.S).group(1)
    for q in ("p50", "p90", "p99"):
        shown = re.search(rf'data-q="{q}" data-value="([^"]*)">([^<]*)<', ttft_row)
        assert float(shown.group(1)) == pytest.approx(want[q], rel=1e-9)
        assert shown.group(2) == html.escape(fmt_duration(want[q]))
    latency = as_json(client.get(f"/api/jobs/{JOB_ID}/latency"))
    assert latency["ttft_s"]["count"] == want["n"] == 15  # the error row never got a first token
    assert latency["itl_s"]["p50"] == pytest.approx(itl["p50"], rel=1e-9)
    assert sum(latency["ttft_s"]["histogram"]["count"]) == want["n"]


def test_shards_table_equals_sql(client, job_data_dir):
    want = sql(job_data_dir, f"SELECT shard_id, status, attempts, worker_id FROM shards "
                             f"WHERE job_id = '{JOB_ID}' ORDER BY shard_id")
    api = as_json(client.get(f"/api/jobs/{JOB_ID}"))["shards"]
    assert [(s["shard_id"], s["status"], s["attempts"], s["worker_id"]) for s in api] == \
        [tuple(r.values()) for r in want]
    page = client.get(f"/jobs/{JOB_ID}").get_data(as_text=True)
    for r in want:
        row = re.search(rf'<tr data-shard-id="{r["shard_id"]}">(.*?)</tr>', page, re.S).group(1)
        assert r["status"] in row and html.escape(r["worker_id"]) in row


def test_iterations_endpoint_equals_sql(client, job_data_dir):
    want = sql_one(job_data_dir, f"""
        SELECT count(*) AS n, sum(decode_tokens) AS decode, sum(prefill_tokens) AS prefill,
               max(num_running) AS max_running, sum(num_preempted) AS preempted,
               max(kv_blocks_total) AS kv_total
        FROM iterations WHERE list_contains(job_ids, '{JOB_ID}')""")
    body = as_json(client.get(f"/api/jobs/{JOB_ID}/iterations"))
    s = body["series"]
    assert body["num_iterations"] == want["n"] > 0 and body["downsampled"] is False
    assert len(s["ts"]) == want["n"] and s["ts"] == sorted(s["ts"])
    assert sum(s["decode_tokens"]) == want["decode"]
    assert sum(s["prefill_tokens"]) == want["prefill"]
    assert max(s["num_running"]) == want["max_running"]
    assert sum(s["num_preempted"]) == want["preempted"]
    assert set(s["kv_blocks_total"]) == {want["kv_total"]}
    assert all(sch <= budget for sch, budget in zip(s["scheduled_tokens"], s["token_budget"], strict=True))


def test_outstanding_requests_are_request_concurrency(client, job_data_dir):
    """At each iteration: the job's requests that arrived and had not finished, not running sequences."""
    body = as_json(client.get(f"/api/jobs/{JOB_ID}/iterations"))["series"]
    requests = sql(job_data_dir,
                   f"SELECT arrival_ts, finished_ts FROM requests_live WHERE job_id = '{JOB_ID}'")
    for ts, shown in list(zip(body["ts"], body["outstanding_requests"], strict=True))[::7]:
        assert shown == sum(1 for r in requests if r["arrival_ts"] <= ts < r["finished_ts"])
    # the engine admitted fewer than were outstanding at some point: the distinction is visible
    assert any(o > r for o, r in zip(body["outstanding_requests"], body["num_running"], strict=True))


def test_throughput_buckets_add_up_to_output_tokens(client, job_data_dir):
    want = sql_one(job_data_dir, f"SELECT sum(output_tokens) AS n FROM requests WHERE job_id = '{JOB_ID}' "
                                 "AND first_token_ts > 0")
    body = as_json(client.get(f"/api/jobs/{JOB_ID}/throughput"))
    tokens = sum(rate * body["bucket_s"] for rate in body["series"]["output_tokens_per_s"])
    assert tokens == pytest.approx(want["n"], rel=1e-6)
    assert body["output_tokens"] == want["n"]


def test_outputs_sample_and_download_equal_the_view(client, job_data_dir):
    want = sql(job_data_dir, f"SELECT request_id, finish_reason, output_tokens, topic FROM outputs "
                             f"WHERE job_id = '{JOB_ID}' ORDER BY request_id::INT")
    sample = as_json(client.get(f"/api/jobs/{JOB_ID}/outputs"))["outputs"]
    assert [(o["request_id"], o["finish_reason"], o["output_tokens"], o["topic"]) for o in sample] == \
        [tuple(r.values()) for r in want][: len(sample)]
    with client.get(f"/jobs/{JOB_ID}/outputs.parquet") as response:
        assert response.status_code == 200
        assert f"{JOB_ID}.outputs.parquet" in response.headers["Content-Disposition"]
        table = pq.read_table(io.BytesIO(response.data))
    assert table.num_rows == len(want) == 16
    assert {"job_id", "request_id", "output_text", "finish_reason", "topic"} <= set(table.column_names)
    assert table.column("request_id").to_pylist() == [r["request_id"] for r in want]


def test_workers_page_equals_sql(client, job_data_dir):
    want = sql_one(job_data_dir, "SELECT worker_id, count(*) AS n, max(ts + duration_s) AS last, "
                                 "sum(decode_tokens) / (max(ts + duration_s) - min(ts)) AS rate "
                                 "FROM iterations GROUP BY worker_id")
    workers = as_json(client.get("/api/workers"))["workers"]
    assert len(workers) == 1
    w = workers[0]
    assert (w["worker_id"], w["iterations"]) == (want["worker_id"], want["n"])
    assert w["last_seen_ts"] == pytest.approx(want["last"])
    assert w["lifetime_decode_tokens_per_s"] == pytest.approx(want["rate"])
    assert w["current_shards"] == [] and w["latest_job_id"] == JOB_ID
    assert w["engine_config"]["max_num_seqs"] == 6 and w["engine_config"]["block_size"] == 4
    page = client.get("/workers").get_data(as_text=True)
    assert html.escape(want["worker_id"]) in page
    assert re.search(rf'data-field="lifetime_decode_tokens_per_s">{re.escape(fmt_rate(want["rate"]))}<', page)


def test_job_page_shows_the_engine_config_its_workers_really_ran(client, job_data_dir):
    worker = sql_one(job_data_dir, f"SELECT any_value(worker_id) AS w FROM shards WHERE job_id = '{JOB_ID}'")
    page = client.get(f"/jobs/{JOB_ID}").get_data(as_text=True)
    start = page.index('id="engine-config"')
    table = page[start:page.index("</table>", start + 30)]
    assert html.escape(worker["w"]) in table
    assert re.search(r"<td>max_num_seqs</td><td><code>6</code>", table), table


@pytest.mark.parametrize("url", ["/jobs/no-such-job", "/api/jobs/no-such-job",
                                 "/api/jobs/no-such-job/iterations", "/jobs/no-such-job/outputs.parquet"])
def test_unknown_job_is_404(client, url):
    response = client.get(url)
    assert response.status_code == 404
    assert b"no-such-job" in response.data


@pytest.mark.parametrize("bad", ["..", "a%27%20OR%201=1--", "-x", "a" * 200, "x%00y", "%2e%2e%2fetc"])
def test_malformed_job_id_is_404_and_never_queried(client, bad):
    for url in (f"/jobs/{bad}", f"/api/jobs/{bad}", f"/api/jobs/{bad}/latency"):
        response = client.get(url)
        assert response.status_code == 404, url


@pytest.mark.parametrize("url", ["/", "/workers", "/sweeps", "/sql", "/api/jobs", "/api/workers",
                                 "/api/sweeps"])
def test_missing_data_dir_shows_empty_state(empty_app, url):
    response = empty_app.test_client().get(url)
    assert response.status_code == 200
    if url == "/":
        assert b"does not exist yet" in response.data


def test_missing_data_dir_job_is_404_not_500(empty_app):
    response = empty_app.test_client().get(f"/api/jobs/{JOB_ID}")
    assert response.status_code == 404 and JOB_ID in response.json["error"]


def test_empty_data_dir_shows_no_jobs(tmp_path):
    init_data_dir(tmp_path)
    client = create_app({"TESTING": True, "DATA_DIR": tmp_path}).test_client()
    assert b"No jobs in" in client.get("/").data
    assert as_json(client.get("/api/jobs"))["jobs"] == []
    assert b"No worker has written" in client.get("/workers").data
    assert b"No sweeps" in client.get("/sweeps").data


def test_queued_job_with_nothing_finished(tmp_path):
    """A job just submitted: every page and endpoint answers, nothing is NaN, it shows as live."""
    store = Store(tmp_path)
    store.record_job(JobRecord("fresh", "tiny-random", 10, 2, time.time() - 5))
    store.record_shard_events([ShardEvent("fresh", s, "queued", time.time()) for s in range(2)])
    client = create_app({"TESTING": True, "DATA_DIR": tmp_path}).test_client()
    for url in ("/", "/jobs/fresh", "/api/jobs/fresh/iterations", "/api/jobs/fresh/throughput",
                "/api/jobs/fresh/latency", "/workers"):
        response = client.get(url)
        assert response.status_code == 200, url
        assert b"NaN" not in response.data, url
    job = as_json(client.get("/api/jobs/fresh"))["job"]
    assert (job["status"], job["live"], job["rows_done"], job["progress"]) == ("queued", True, 0, 0.0)
    assert job["output_tokens_per_s"] is None and job["eta_s"] is None and job["age_s"] >= 5
    assert b'data-live="1"' in client.get("/jobs/fresh").data


def test_progress_of_a_running_attempt_shows_before_its_commit(tmp_path):
    store = Store(tmp_path)
    store.record_job(JobRecord("running-job", "tiny-random", 6, 2, time.time() - 10))
    store.record_shard_events([ShardEvent("running-job", s, "queued", time.time()) for s in range(2)])
    done = store.begin_attempt("running-job", 0, 1, "w1", num_requests=3)
    rows = [{"request_id": str(i), "output_text": "x", "finish_reason": "length", "prompt_tokens": 4,
             "output_tokens": 5, "error": None} for i in range(3)]
    done.add_outputs(rows)
    for i in range(3):
        done.add_request(str(i), "length", RequestStats(time.time() - 3, time.time() - 3, time.time() - 2,
                                                        time.time() - 1, 0, 4, 5))
    done.commit()
    running = store.begin_attempt("running-job", 1, 1, "w1", num_requests=3)
    running.add_request("3", "stop", RequestStats(time.time() - 2, time.time() - 2, time.time() - 1,
                                                  time.time(), 0, 4, 7))
    running.flush()  # written, not committed
    client = create_app({"TESTING": True, "DATA_DIR": tmp_path}).test_client()
    job = as_json(client.get("/api/jobs/running-job"))["job"]
    assert (job["status"], job["rows_done"], job["output_tokens"]) == ("running", 4, 22)
    assert job["progress"] == pytest.approx(4 / 6) and job["eta_s"] > 0
    committed = sql_one(tmp_path, "SELECT rows_done FROM jobs")["rows_done"]
    live = sql_one(tmp_path, "SELECT count(*) AS n FROM requests_live WHERE job_id = 'running-job'")["n"]
    assert (committed, live) == (3, 4)


def test_workers_show_running_idle_and_gone_with_when(tmp_path):
    """Liveness comes from worker records: a stopped or silent worker is gone, with when, never idle."""
    now = time.time()
    records = {"busy": dict(heartbeat_ts=now - 1, shards_held=2, device="cuda:1"),
               "idle": dict(heartbeat_ts=now - 2),
               "lost": dict(heartbeat_ts=now - 300),
               "stopped": dict(heartbeat_ts=now - 120, stopped_ts=now - 120),
               "failed": dict(heartbeat_ts=now - 60, stopped_ts=now - 60,
                              engine_error="engine failed: OutOfMemoryError: CUDA out of memory")}
    for name, fields in records.items():
        url = f"http://host-a:9400/metrics?{name}"
        write_worker_record(tmp_path, WorkerRecord(name, "host-a", 7, now - 900, ttl_s=30.0, model="m",
                                                   metrics_url=url, **fields))
    with Store(tmp_path).telemetry_buffer("old-telemetry-only") as buf:  # no record: judged by its iterations
        buf.append(IterationStats(ts=now - 600, duration_s=0.1, num_running=1, kv_blocks_total=8))
    client = create_app({"TESTING": True, "DATA_DIR": tmp_path}).test_client()
    workers = {w["worker_id"]: w for w in as_json(client.get("/api/workers"))["workers"]}
    got = {w: (v["state"], v["gone_reason"]) for w, v in workers.items()}
    assert got == {"busy": ("running", None), "idle": ("idle", None), "lost": ("gone", "lost"),
                   "stopped": ("gone", "stopped"), "failed": ("gone", "stopped"),
                   "old-telemetry-only": ("gone", "silent")}
    assert workers["failed"]["engine_error"] == "engine failed: OutOfMemoryError: CUDA out of memory"
    assert workers["stopped"]["engine_error"] is None
    assert workers["lost"]["gone_since_ts"] == pytest.approx(now - 300)
    assert workers["stopped"]["gone_since_ts"] == pytest.approx(now - 120)
    assert workers["old-telemetry-only"]["gone_since_ts"] == pytest.approx(now - 599.9)
    assert [w["worker_id"] for w in as_json(client.get("/api/workers"))["workers"]][:2] == ["busy", "idle"]
    page = client.get("/workers").get_data(as_text=True)
    for name, (state, _) in got.items():
        assert re.search(rf'data-worker-id="{re.escape(name)}" data-state="{state}"', page), name
    assert re.search(r'class="gone-note"[^>]*>stopped 2m 0[0-9]s ago<br>', page)
    assert re.search(r'class="gone-note"[^>]*>heartbeat lost 5m 0[0-9]s ago<br>', page)
    assert 'href="http://host-a:9400/metrics?busy"' in page
    assert '<small class="engine-error">engine failed: OutOfMemoryError: CUDA out of memory</small>' in page
    assert workers["busy"]["device"] == "cuda:1" and '<code data-field="device">cuda:1</code>' in page
