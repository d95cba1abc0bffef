"""A worker's Prometheus metrics (jobs.metrics) fed by a real engine in-process, scraped over HTTP and parsed
with prometheus_client's own parser, checked against the `iterations` and `requests` views; the worker's
record (jobs.store.workers) written on start, on heartbeats and on stop."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineConfig
from engine.stats import IterationStats, RequestStats
from jobs.broker import resolve_broker
from jobs.metrics import ITL_BUCKETS, WorkerMetrics
from jobs.shard_runner import ShardTask, process_shard
from jobs.store.workers import WorkerRecord, read_worker_records
from jobs.submit import JobRequest, prepare_job
from jobs.worker_runtime import WorkerRuntime
from tests.jobs.helpers import MODEL, one_torch_thread, query, wait_for, write_prompts

WORKER = "w-metrics"
CONFIG = EngineConfig(model=MODEL, max_num_seqs=3, max_num_batched_tokens=64, block_size=4, num_kv_blocks=24)


# what Prometheus sends: OpenMetrics first (prometheus_client would write batchgen_... names there)
PROMETHEUS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from a /metrics page parsed by prometheus_client."""
    request = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert not [name for name, _ in samples if name.startswith("batchgen_")], "names keep their colon"
    return samples


def value(samples: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted({"worker": WORKER, "model": MODEL, **labels}.items())))
    assert key in samples, f"{name}{labels} not scraped; have {sorted(n for n, _ in samples)[:50]}"
    return samples[key]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A runtime with metrics served on a free port; one job of 2 shards run through it."""
    data_dir = tmp_path_factory.mktemp("metrics") / "data"
    src = data_dir.parent / "in.parquet"
    write_prompts(src, 8)
    metrics = WorkerMetrics(WORKER, CONFIG)
    port = metrics.serve("127.0.0.1", 0)
    record = WorkerRecord(WORKER, "testhost", 1, time.time(), time.time(), ttl_s=30.0, model=MODEL)
    req = JobRequest(str(src), str(data_dir), {"model": MODEL}, {"max_tokens": 24, "temperature": 0.0}, 4)
    manifest = prepare_job(req, resolve_broker(data_dir, embedded=True))
    with one_torch_thread():
        runtime = WorkerRuntime(CONFIG, WORKER, data_dir, metrics=metrics, record=record).start()
        try:
            # engine limits small enough that requests wait and KV blocks run out (preemptions)
            outcomes = [process_shard(ShardTask(manifest.job_id, s, str(data_dir)),
                                      runtime) for s in range(2)]
            assert [o.result for o in outcomes] == ["committed", "committed"]
            yield {"data_dir": data_dir, "url": f"http://127.0.0.1:{port}/metrics", "runtime": runtime,
                   "metrics": metrics, "job_id": manifest.job_id}
        finally:
            runtime.stop()
            metrics.close()


def _iterations(data_dir) -> dict:
    sql = ("SELECT count(*) AS n, sum(scheduled_tokens) AS tokens, sum(num_preempted) AS pre, "
           "arg_max(kv_blocks_used, ts) AS kv_used, arg_max(kv_blocks_total, ts) AS kv_total "
           "FROM iterations WHERE worker_id = ?")
    return query(data_dir, sql, [WORKER])[0]


def test_scraped_metrics_add_up_to_the_views(served):
    data_dir, runtime = served["data_dir"], served["runtime"]
    # iterations reach the store when the engine idles (flush): wait until every step is there
    its = wait_for(lambda: (lambda r: r if r["n"] == runtime.iterations else None)(_iterations(data_dir)),
                   30, "every iteration in the view")
    req = query(data_dir, """
        SELECT count(*) AS n, sum(prompt_tokens) AS prompt, sum(output_tokens) AS output, sum(ttft_s) AS ttft,
               sum(e2e_s) AS e2e, sum(queue_s) AS queue,
               sum(output_tokens - 1) FILTER (WHERE output_tokens > 1) AS gaps,
               sum(tpot_s * (output_tokens - 1)) FILTER (WHERE output_tokens > 1) AS gap_s,
               count(*) FILTER (WHERE finish_reason = 'length') AS length
        FROM requests WHERE worker_id = ?""", [WORKER])[0]
    m = scrape(served["url"])
    assert req["n"] == 8 and its["pre"] > 0, "the engine limits make requests preempt"
    assert value(m, "batchgen:prompt_tokens_total") == req["prompt"]
    assert value(m, "batchgen:generation_tokens_total") == req["output"]
    assert value(m, "batchgen:num_preemptions_total") == its["pre"]
    assert value(m, "batchgen:iteration_tokens_total_count") == its["n"]
    assert value(m, "batchgen:iteration_tokens_total_sum") == its["tokens"]
    assert value(m, "batchgen:time_to_first_token_seconds_count") == req["n"]
    assert value(m, "batchgen:time_to_first_token_seconds_sum") == pytest.approx(req["ttft"], rel=1e-6)
    assert value(m, "batchgen:e2e_request_latency_seconds_count") == req["n"]
    assert value(m, "batchgen:e2e_request_latency_seconds_sum") == pytest.approx(req["e2e"], rel=1e-6)
    assert value(m, "batchgen:request_queue_time_seconds_sum") == pytest.approx(req["queue"], abs=1e-6)
    assert value(m, "batchgen:inter_token_latency_seconds_count") == req["gaps"]
    assert value(m, "batchgen:inter_token_latency_seconds_sum") == pytest.approx(req["gap_s"], rel=1e-6)
    assert value(m, "batchgen:request_success_total", finished_reason="length") == req["length"]
    # idle now: nothing runs or waits; KV usage is the last step's
    assert value(m, "batchgen:num_requests_running") == 0 and value(m, "batchgen:num_requests_waiting") == 0
    assert value(m, "batchgen:kv_cache_usage_perc") == pytest.approx(its["kv_used"] / its["kv_total"])
    assert value(m, "batchgen:engine_config_info", dtype="float32", device="cpu", max_num_seqs="3",
                 max_num_batched_tokens="64", block_size="4", enable_chunked_prefill="True",
                 enable_prefix_caching="False", scheduling_policy="fcfs", enforce_eager="False") == 1
    assert not [k for k in m if k[0] == "batchgen:shards_running"], "no shard held: no job series left"
    assert ("process_cpu_seconds_total", ()) in m


def test_histogram_buckets_are_cumulative_and_end_at_the_count(served):
    m = scrape(served["url"])
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds",
                 "iteration_tokens_total"):
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in m.items()
                          if k[0] == f"batchgen:{name}_bucket"))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf"), name
        assert counts[-1] == value(m, f"batchgen:{name}_count"), name


def test_weighted_histogram_counts_each_gap_of_a_request():
    metrics = WorkerMetrics("w", EngineConfig(model=MODEL))
    metrics.on_request(RequestStats(arrival_ts=10, scheduled_ts=10, first_token_ts=11, finished_ts=12,
                                    prompt_tokens=3, output_tokens=5), "stop")  # 4 gaps of 0.25 s
    metrics.on_request(RequestStats(arrival_ts=10, first_token_ts=10.5, finished_ts=10.5, output_tokens=1),
                       "length")  # one token: no gap
    family = next(f for f in metrics.itl.collect())
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("batchgen:inter_token_latency_seconds_count", None)] == 4
    assert samples[("batchgen:inter_token_latency_seconds_sum", None)] == pytest.approx(1.0)
    first_holding = min(b for b in ITL_BUCKETS if b >= 0.25)
    assert samples[("batchgen:inter_token_latency_seconds_bucket", repr(float(first_holding)))] == 4
    assert samples[("batchgen:inter_token_latency_seconds_bucket", "0.2")] == 0


def test_shard_gauge_keeps_only_jobs_held_now():
    metrics = WorkerMetrics("w", EngineConfig(model=MODEL))
    metrics.shard_started("a")
    metrics.shard_started("a")
    metrics.shard_started("b")
    metrics.shard_ended("a")
    metrics.shard_ended("b")
    held = {s.labels["job"]: s.value for f in metrics.registry.collect()
            if f.name == "batchgen:shards_running" for s in f.samples}
    assert held == {"a": 1}


def test_idle_engine_reports_nothing_running():
    metrics = WorkerMetrics("w", EngineConfig(model=MODEL))
    metrics.on_iteration(IterationStats(num_running=2, num_waiting=5, kv_blocks_used=3, kv_blocks_total=0))
    metrics.on_idle()
    values = {f.name: f.samples[0].value for f in metrics.registry.collect()
              if f.name in ("batchgen:num_requests_running", "batchgen:num_requests_waiting",
                            "batchgen:kv_cache_usage_perc")}
    assert values == {"batchgen:num_requests_running": 0, "batchgen:num_requests_waiting": 0,
                      "batchgen:kv_cache_usage_perc": 0}


def test_other_paths_are_404(served):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(served["url"].replace("/metrics", "/nope"), timeout=10)
    err.value.close()
    assert err.value.code == 404


def test_a_taken_port_is_an_os_error_naming_nothing_served(served):
    port = int(served["url"].rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError):
        WorkerMetrics("w2", EngineConfig(model=MODEL)).serve("127.0.0.1", port)


def test_worker_record_says_alive_then_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_LEASE_TTL_S", "1")  # a heartbeat every 0.2 s
    record = WorkerRecord("w-rec", "testhost", 1, time.time(), time.time(), ttl_s=1.0, model=MODEL)
    with one_torch_thread():
        runtime = WorkerRuntime(EngineConfig(model=MODEL), "w-rec", tmp_path / "data", record=record).start()
        try:
            first = read_worker_records(tmp_path / "data")[0]
            assert first.state(time.time()) == "alive" and first.stopped_ts == 0
            wait_for(lambda: read_worker_records(tmp_path / "data")[0].heartbeat_ts > first.heartbeat_ts, 30,
                     "a heartbeat after the first record")
        finally:
            runtime.stop()
    last = read_worker_records(tmp_path / "data")[0]
    assert last.state(time.time() + 3600) == "stopped" and last.gone_since(time.time()) == last.stopped_ts > 0
