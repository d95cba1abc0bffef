"""The Celery app: its settings for a broker and queue.

Its one task, `batchgen.run_shard`, is a thin wrapper over `jobs.shard_runner`, which registers it on
a worker's app (`register_shard_task`); publishers (`jobs.shards.broker_messages.publish_shard`) send
it by name and need no task. Delivery guarantees: late acks (a message is acknowledged when its
shard is committed, failed for good, or handed to a retry), rejected when the worker is lost, one
message prefetched per worker thread, retries with exponential backoff up to the job's
`max_retries`. Idempotence lives in the shard runner: a committed shard is never generated again.

Publishing goes through `send_task` by name, so `submit`, `status` and `retry` never import the
engine. A shard task's id names its job and shard (`jobs.shards.broker_messages.shard_task_id`), so
`celery inspect active`, Flower and `celery control revoke` show and take ids a person can read, and a
worker that hears a revoke knows which job it is about (jobs.revoke).

Celery's own tools: `celery -A jobs.celery_app inspect ping|active|stats|active_queues` and Flower
use the module attribute `app`, built on first access for the broker in force ($BATCHGEN_BROKER_URL,
$BATCHGEN_QUEUE, $BATCHGEN_DATA_DIR). On Redis and RabbitMQ workers answer remote control and send
task events and heartbeats. The embedded transport has no fanout exchange (a broadcast would reach
one consumer, not every worker) and keeps topic bindings in each process's memory (events would
reach nobody), so there all three stay off.
"""

from __future__ import annotations

import functools
import logging
import os

from celery import Celery
from kombu import Exchange, Queue

import jobs.embedded_broker  # noqa: F401 - registers the embedded transport with kombu
from jobs.broker import BROKER_ENV, EMBEDDED, BrokerSettings, resolve_broker

log = logging.getLogger(__name__)

TASK_NAME = "batchgen.run_shard"


def celery_config(settings: BrokerSettings) -> dict:
    """Celery settings for one broker and queue."""
    timeout = settings.shard_timeout_s
    transport_options: dict = {"visibility_timeout": timeout}
    consumer_arguments = {}
    if settings.kind == "amqp":
        transport_options = {}
        consumer_arguments = {"x-consumer-timeout": int(timeout * 1000)}
    elif settings.kind == "embedded":
        transport_options["polling_interval"] = 0.1
    queue = Queue(settings.queue, Exchange(settings.queue, type="direct"), routing_key=settings.queue,
                  consumer_arguments=consumer_arguments or None)
    fleet = settings.kind != EMBEDDED  # a server broker carries broadcasts and events
    return {
        "broker_url": settings.url,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "task_queues": [queue],
        "task_default_queue": settings.queue,
        "task_default_exchange": settings.queue,
        "task_default_routing_key": settings.queue,
        "task_create_missing_queues": False,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_backend": None,
        "worker_prefetch_multiplier": 1,
        "worker_enable_remote_control": fleet,  # celery inspect / control, Flower's worker pages
        "worker_send_task_events": fleet,  # task-received/started/succeeded...: Flower's task list
        "task_send_sent_event": fleet,  # task-sent from the publisher: queued shards show in Flower
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }


def worker_options(settings: BrokerSettings) -> dict:
    """`app.Worker` options for a broker: heartbeats and mingle where the broker carries broadcasts.

    Mingle lets a starting worker learn the ids its peers were told to revoke. Gossip stays off
    everywhere: each worker would consume every other worker's events (traffic growing with the
    square of the fleet) for features batchgen does not use (leader election, clock sync).
    """
    fleet = settings.kind != EMBEDDED
    return {"without_gossip": True, "without_mingle": not fleet, "without_heartbeat": not fleet}


@functools.lru_cache(maxsize=16)
def make_app(settings: BrokerSettings) -> Celery:
    """A Celery app for one broker and queue (cached per settings). A worker registers the shard task
    on it (jobs.shard_runner.register_shard_task); publishers send the task by name."""
    app = Celery("batchgen", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


def __getattr__(name: str) -> Celery:
    """`app` (and `celery`): the app for the broker in force, for `celery -A jobs.celery_app ...`."""
    if name not in ("app", "celery"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from jobs.store import DATA_DIR_ENV, DEFAULT_DATA_DIR

    settings = resolve_broker(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)
    if settings.kind == EMBEDDED:
        log.warning("%s is unset: the embedded broker carries no remote control or events, so celery "
                    "inspect/control and Flower see no workers; set it to the redis:// or amqp:// URL "
                    "the workers use", BROKER_ENV)
    return make_app(settings)
