"""A worker's Prometheus metrics: vLLM's names under the `batchgen:` prefix, served on --metrics-port.

Fed by the engine's own telemetry, hooked in the worker runtime: one `IterationStats` per engine
step (gauges, preemptions, tokens per iteration) and one `RequestStats` per finished request (token
counters, latency histograms). So the numbers add up to the store's views over the same worker:

    batchgen:prompt_tokens_total          = sum(prompt_tokens)  FROM requests
    batchgen:generation_tokens_total      = sum(output_tokens)  FROM requests
    batchgen:num_preemptions_total        = sum(num_preempted)  FROM iterations
    batchgen:iteration_tokens_total       count = count(*), sum = sum(scheduled_tokens) FROM iterations
    batchgen:time_to_first_token_seconds  count, sum over ttft_s of requests with a first token
    batchgen:e2e_request_latency_seconds  count, sum over e2e_s of finished requests
    batchgen:inter_token_latency_seconds  count = sum(output_tokens - 1),
                                          sum = sum(tpot_s * (output_tokens - 1))

(counting only requests that ran in the engine: a row refused before it (an `error` row) is in the
views with zero tokens and no latency). The engine records a request's first and last token times,
not every token's, so each request's output_tokens - 1 gaps are counted in the bucket of its mean
gap: count and sum are exact, the spread within one request is not.

Labels are `worker` and `model` (fixed for a worker's life) plus `job` on `shards_running` (at most
--concurrency jobs at once) and `finished_reason` (stop, length, error, cancelled): a bounded set.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import asdict
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector

from engine.config import EngineConfig
from engine.stats import IterationStats, RequestStats

log = logging.getLogger(__name__)

PREFIX = "batchgen:"
LABELS = ("worker", "model")

# vLLM's buckets, with finer ones below its smallest where a small model on a CPU lands
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class WeightedHistogram(Collector):
    """A histogram whose observations carry a weight: `observe(v, n)` counts n observations of v."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 labels: dict[str, str]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = [*buckets, float("inf")]
        self.labels = labels
        self._counts = [0] * len(self.bounds)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, weight: int = 1) -> None:
        index = next(i for i, bound in enumerate(self.bounds) if value <= bound)
        with self._lock:
            self._counts[index] += weight
            self._sum += value * weight

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip(self.bounds, counts, strict=True):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), cumulative, total)
        yield family


class WorkerMetrics:
    """The metrics of one worker process, in a registry of their own."""

    def __init__(self, worker_id: str, config: EngineConfig) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        labels = {"worker": worker_id, "model": config.model}
        self._values = tuple(labels.values())
        self._declare(labels)
        info = Gauge(PREFIX + "engine_config_info", "The engine settings this worker runs (value 1).",
                     [*LABELS, *_info_labels(config)], registry=self.registry)
        info.labels(*self._values, *_info_labels(config).values()).set(1)
        self.server = None  # the HTTP server once `serve` ran

    def _declare(self, labels: dict[str, str]) -> None:
        reg, names, v = self.registry, list(LABELS), self._values
        gauge = lambda name, doc: Gauge(PREFIX + name, doc, names, registry=reg).labels(*v)
        counter = lambda name, doc: Counter(PREFIX + name, doc, names, registry=reg).labels(*v)
        hist = lambda name, doc, b: Histogram(PREFIX + name, doc, names, buckets=b, registry=reg).labels(*v)
        self.running = gauge("num_requests_running", "Requests running in the engine (holding KV blocks).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the engine for admission.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means every block is in use.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Output tokens of finished requests.")
        self.preemptions = counter("num_preemptions", "Running sequences preempted (recomputed later).")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens scheduled per engine iteration "
                                     "(prefill + decode).", ITERATION_TOKEN_BUCKETS)
        self.itl = WeightedHistogram(PREFIX + "inter_token_latency_seconds",
                                     "Gaps between a request's output tokens (each request's gaps counted "
                                     "at its mean gap).", ITL_BUCKETS, labels)
        reg.register(self.itl)
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               [*names, "finished_reason"], registry=reg)
        self.shards = Gauge(PREFIX + "shards_running", "Shard attempts this worker holds, per job.",
                            [*names, "job"], registry=reg)
        self._held: dict[str, int] = {}  # job id -> shard attempts held
        self._held_lock = threading.Lock()

    # -- hooks (engine thread, task threads)
    def on_iteration(self, stats: IterationStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        self.preemptions.inc(stats.num_preempted)
        self.iteration_tokens.observe(stats.scheduled_tokens)

    def on_idle(self) -> None:
        """The engine holds no request: nothing runs or waits (the last step counted before it finished)."""
        self.running.set(0)
        self.waiting.set(0)

    def on_request(self, stats: RequestStats, finish_reason: str | None) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.output_tokens)
        self.success.labels(*self._values, finish_reason or "unknown").inc()
        if stats.first_token_ts:
            self.ttft.observe(stats.ttft_s)
        if stats.finished_ts:
            self.e2e.observe(stats.e2e_s)
        if stats.scheduled_ts:
            self.queue.observe(stats.queue_s)
        if stats.output_tokens > 1 and stats.first_token_ts:
            self.itl.observe(stats.tpot_s, stats.output_tokens - 1)

    def shard_started(self, job_id: str) -> None:
        self._count_shard(job_id, +1)

    def shard_ended(self, job_id: str) -> None:
        self._count_shard(job_id, -1)

    def _count_shard(self, job_id: str, delta: int) -> None:
        with self._held_lock:
            held = self._held.get(job_id, 0) + delta
            if held > 0:
                self._held[job_id] = held
                self.shards.labels(*self._values, job_id).set(held)
            else:  # the job's series goes away: labels stay bounded by the shards held at once
                self._held.pop(job_id, None)
                if delta < 0:
                    self.shards.remove(*self._values, job_id)

    # -- serving
    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port in a daemon thread; the port bound (port 0 picks a free one)."""
        self.server = _metrics_server(host, port, self.registry)
        threading.Thread(target=self.server.serve_forever, name="metrics-http", daemon=True).start()
        return self.server.server_port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


# Always the classic text format: prometheus_client's OpenMetrics writer (0.26, what a Prometheus
# server asks for first) turns the ':' of sample names into '_' while its HELP/TYPE lines keep it,
# so Prometheus would store batchgen_jobs instead of batchgen:jobs. The text format keeps names as
# written, and every Prometheus reads it.
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass  # one stderr line per scrape would drown the worker's log (and break JSON logs)


def _metrics_server(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """A threaded HTTP server answering GET /metrics (and /) with the registry in text format."""

    def app(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"metrics are at /metrics\n"]
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", TEXT_CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [body]

    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (ThreadingMixIn, WSGIServer),
                        {"address_family": family, "daemon_threads": True})
    return make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)


def _info_labels(config: EngineConfig) -> dict[str, str]:
    """The settings that say what a worker runs, as label values (model is a label already)."""
    keep = ("dtype", "device", "max_num_seqs", "max_num_batched_tokens", "block_size",
            "enable_chunked_prefill", "enable_prefix_caching", "scheduling_policy", "enforce_eager")
    values = asdict(config)
    return {k: str(values[k]) for k in keep}
