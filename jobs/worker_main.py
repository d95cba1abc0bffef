"""`batchgen worker` inside: load the engine once, then consume shard tasks with Celery.

Celery runs with the threads pool so every task thread shares this process's one engine (see
jobs.runtime). Shutdown: on SIGTERM Celery's warm shutdown waits for the shards in flight to
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

from engine.config import EngineConfig
from jobs.broker import BrokerSettings

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
               concurrency: int, loglevel: str = "INFO") -> int:
    """Serve shard tasks until shut down; the process exit code."""
    from celery import signals

    from jobs.celery_app import make_app
    from jobs.runtime import WorkerRuntime, set_runtime
    from jobs.supervise import maintenance

    app = make_app(settings)
    try:
        runtime = WorkerRuntime(config, worker_id, data_dir, janitor=maintenance(data_dir, settings),
                                on_fatal=lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    except Exception as exc:  # noqa: BLE001 - e.g. a model that cannot be found or loaded
        log.error("worker %s cannot start its engine: %s", worker_id, exc)
        return 1
    set_runtime(runtime)
    signals.worker_shutting_down.connect(lambda sig=None, **_: _on_shutdown(runtime, sig), weak=False)
    signals.worker_ready.connect(_wake_hub_every_second, weak=False)
    log.info("worker %s: model %s loaded; consuming %s queue %r (concurrency %d)", worker_id, config.model,
             settings.display_url, settings.queue, concurrency)
    try:
        celery_worker = app.Worker(
            hostname=worker_id, pool="threads", concurrency=concurrency, queues=[settings.queue],
            loglevel=loglevel, prefetch_multiplier=1, without_gossip=True, without_mingle=True,
            without_heartbeat=True, quiet=True,
        )
        celery_worker.start()
        return celery_worker.exitcode or 0
    finally:
        runtime.stop()
        set_runtime(None)
