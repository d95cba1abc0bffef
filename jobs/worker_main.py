"""`batchgen worker` inside: load the engine once, then consume shard tasks with Celery.

Celery runs with the threads pool so every task thread shares this process's one engine (see
jobs.worker_runtime). Shutdown: on SIGTERM Celery's warm shutdown waits for the shards in flight to
finish and commit; only then is the engine loop stopped. SIGINT (Ctrl-C, or an interrupted
`batchgen run`) is quicker: the shards in flight are handed back (their running rows aborted, each
attempt ended "handed back", its message requeued without using a retry), then the same shutdown
runs. Celery may still deliver a message or two while its consumer loop winds down (measured: its
last poll runs after the signal); the runtime is draining by then and hands those back to the
broker (reject + requeue) without starting them. A second signal (cold shutdown) exits at once:
the attempts in flight die with the process, their leases go stale and the shards are re-queued
(nothing is lost, the attempt is redone).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

from engine.config import EngineConfig
from jobs.broker import EMBEDDED, BrokerSettings
from jobs.parent_watch import exit_with_parent

log = logging.getLogger(__name__)

def _wake_hub_every_second(sender=None, **_) -> None:
    """With RabbitMQ, Celery's event loop sleeps up to 10 s between timer checks and only then notices
    a shutdown request (measured: SIGTERM to exit took 11 s on an idle worker). A 1 s no-op timer
    bounds that wait."""
    hub = getattr(sender, "hub", None)
    if hub is not None:
        hub.call_repeatedly(1.0, lambda: None)


def _on_shutdown(runtime, sig: str | None) -> None:
    """Celery's first SIGINT or SIGTERM: hand the shards in flight back (SIGINT) or finish them."""
    if sig == "SIGINT":
        log.info("SIGINT: handing the shards in flight back")
        runtime.hand_back()
    else:
        runtime.drain()


def run_worker(config: EngineConfig, settings: BrokerSettings, data_dir: str, worker_id: str,
               concurrency: int, loglevel: str = "INFO", metrics_at: tuple[str, int] | None = None) -> int:
    """Serve shard tasks until shut down; the process exit code. `metrics_at` (host, port): serve
    Prometheus /metrics there (port 0 picks a free one; the worker's record says which)."""
    from celery import signals

    from jobs.celery_app import make_app, worker_options
    from jobs.shard_runner import register_shard_task
    from jobs.shards.supervise import maintenance
    from jobs.worker_runtime import WorkerRuntime, set_runtime

    exit_with_parent()
    app = make_app(settings)
    register_shard_task(app)
    _celery_notices_to_logging()
    record = _record(config, settings, worker_id, concurrency)
    metrics = _serve_metrics(worker_id, config, metrics_at, record) if metrics_at else None
    if metrics_at and metrics is None:
        return 1
    try:
        runtime = WorkerRuntime(config, worker_id, data_dir, janitor=maintenance(data_dir, settings),
                                on_fatal=lambda: os.kill(os.getpid(), signal.SIGTERM), metrics=metrics,
                                record=record, on_tick=_revoke_watch(data_dir, settings)).start()
    except Exception as exc:  # noqa: BLE001 - e.g. a model that cannot be found or loaded
        log.error("worker %s cannot start its engine: %s", worker_id, exc)
        if metrics is not None:
            metrics.close()
        return 1
    set_runtime(runtime)
    signals.worker_shutting_down.connect(lambda sig=None, **_: _on_shutdown(runtime, sig), weak=False)
    signals.worker_ready.connect(_wake_hub_every_second, weak=False)
    log.info("worker %s: model %s loaded, dtype %s (%s); consuming %s queue %r (concurrency %d)",
             worker_id, config.model, config.dtype, config.dtype_reason, settings.display_url, settings.queue,
             concurrency)
    try:
        celery_worker = app.Worker(
            hostname=worker_id, pool="threads", concurrency=concurrency, queues=[settings.queue],
            loglevel=loglevel, prefetch_multiplier=1, quiet=True, **worker_options(settings),
        )
        celery_worker.start()
        if runtime.engine_fault is not None:
            log.error("worker %s stopped: its %s; its shards went back to the queue", worker_id,
                      runtime.engine_fault)
            return 1
        return celery_worker.exitcode or 0
    finally:
        runtime.stop()
        set_runtime(None)
        if metrics is not None:
            metrics.close()


def _celery_notices_to_logging() -> None:
    """Celery writes its shutdown notices ("worker: Warm shutdown (MainProcess)") straight to the
    terminal, past logging, so that eventlet/gevent patching cannot break them; this worker runs
    neither, so they go through logging and `--log-format json` holds for every line. A revoke's
    warning about the missing result backend is dropped."""
    import celery.apps.worker as celery_worker

    notices = logging.getLogger("celery.apps.worker")
    celery_worker.safe_say = lambda msg, f=None: notices.warning(msg)
    logging.getLogger("celery.worker.control").addFilter(_no_backend_to_mark)


def _no_backend_to_mark(record: logging.LogRecord) -> bool:
    """Celery warns on every `revoke` that it could not mark the task revoked in the result backend;
    batchgen keeps results in the store and runs no backend by design, so that warning says nothing."""
    return "No result backend is configured" not in record.getMessage()


def _record(config: EngineConfig, settings: BrokerSettings, worker_id: str, concurrency: int):
    from dataclasses import asdict

    from jobs.shards.leases import lease_ttl_s
    from jobs.store import WorkerRecord

    now = time.time()
    return WorkerRecord(worker_id, socket.gethostname(), os.getpid(), now, now, lease_ttl_s(),
                        model=config.model, queue=settings.queue, broker=settings.display_url,
                        concurrency=concurrency, engine_config=asdict(config), device=config.device)


def _serve_metrics(worker_id: str, config: EngineConfig, at: tuple[str, int], record):
    """The worker's metrics, served on `at`; None (after saying why) when the port cannot be bound."""
    from jobs.metrics import WorkerMetrics

    host, port = at
    metrics = WorkerMetrics(worker_id, config)
    try:
        bound = metrics.serve(host, port)
    except OSError as exc:
        log.error("worker %s cannot serve metrics on --metrics-host %s --metrics-port %d: %s", worker_id,
                  host, port, exc)
        return None
    shown = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
    record.metrics_url = f"http://{f'[{shown}]' if ':' in shown else shown}:{bound}/metrics"
    log.info("worker %s: Prometheus metrics on %s", worker_id, record.metrics_url)
    return metrics


def _revoke_watch(data_dir: str, settings: BrokerSettings):
    """Where workers hear remote control (Redis, RabbitMQ): cancel the jobs of revoked shard tasks."""
    if settings.kind == EMBEDDED:
        return None
    from jobs.revoke import RevokeWatcher, celery_revoked_ids

    return RevokeWatcher(data_dir, celery_revoked_ids).check
