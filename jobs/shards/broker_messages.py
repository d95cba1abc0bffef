"""A shard's messages: publishing one, their task ids, and which of them a broker still holds.

`publish_shard` sends a shard's task by name (jobs.celery_app). A shard message's task id names its
job and shard (`shard_task_id`, read back by `parse_shard_task_id`), so `celery inspect`, Flower and
a revoke show ids a person can read, and the broker's contents can be matched with the shards that
wait.

Which messages a broker holds is the other half of reconciling queued shards: a message can vanish
before any worker claims it (a flushed or failed-over Redis, a deleted embedded broker file); its
shard would then wait forever. `live_shard_messages` lists the (job, shard) pairs
a queue still holds, from each message's task id (`shard_task_id`): every ready
message, and every delivered-but-unacknowledged one delivered within `held_within_s`. A worker
claims a shard the moment it starts its message, so a message held longer than that with no claim
belongs to a consumer that died holding it (killed between the delivery and the claim): the broker
gives it back only after its visibility timeout (the shard timeout, 10 minutes or more), which is
no reason to wait. Redis and the embedded broker can be read
without consuming anything; RabbitMQ cannot (a queue shows only counts), so there the answer is
None: unknown, and jobs.shards.supervise does not re-publish on a guess.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
import uuid
from collections.abc import Iterable

from jobs.broker import EMBEDDED, BrokerSettings

# kombu's Redis transport: a queue's priority levels live in lists `queue`, `queue\x06\x16<p>`;
# delivered-but-unacknowledged messages in the hash `unacked` (tag -> [message, exchange, routing key])
# and their delivery times in the sorted set `unacked_index`
REDIS_PRIORITY_SEP = "\x06\x16"
REDIS_UNACKED = "unacked"
REDIS_UNACKED_INDEX = "unacked_index"  # tag -> delivery time (epoch seconds)


def live_shard_messages(settings: BrokerSettings, held_within_s: float = math.inf
                        ) -> set[tuple[str, int]] | None:
    """(job id, shard id) of every shard message on the settings' queue that is ready, or delivered
    less than `held_within_s` ago; None when the broker cannot tell (RabbitMQ)."""
    since = time.time() - held_within_s
    if settings.kind == EMBEDDED:
        return _shards_of(_embedded_messages(settings, since))
    if settings.kind == "redis":
        return _shards_of(_redis_messages(settings, since))
    return None


def _shards_of(messages: Iterable[dict]) -> set[tuple[str, int]]:
    found = set()
    for message in messages:
        parsed = parse_shard_task_id((message.get("headers") or {}).get("id", ""))
        if parsed is not None:
            found.add(parsed)
    return found


def publish_shard(settings: BrokerSettings, job_id: str, shard_id: int, *, countdown: float | None = None,
                  retries: int = 0) -> None:
    """Send one shard task: the job and shard ids only, never prompts or paths (the worker finds the
    shard in its own data dir, wherever that is mounted). `retries` carries over the retries a shard
    already used (a re-queued shard keeps its retry budget)."""
    from jobs.celery_app import TASK_NAME, make_app

    kwargs = {"job_id": job_id, "shard_id": shard_id}
    make_app(settings).send_task(TASK_NAME, kwargs=kwargs, queue=settings.queue, routing_key=settings.queue,
                                 countdown=countdown, retries=retries,
                                 task_id=shard_task_id(job_id, shard_id))


def shard_task_id(job_id: str, shard_id: int) -> str:
    """`<job>.shard<N>.<random>`: unique per publication, and readable in `celery inspect` and Flower."""
    return f"{job_id}.shard{shard_id}.{uuid.uuid4().hex[:12]}"


def parse_shard_task_id(task_id: str) -> tuple[str, int] | None:
    """(job id, shard id) of an id made by `shard_task_id`; None for any other id."""
    parts = str(task_id).rsplit(".", 2)
    if len(parts) != 3 or not parts[1].startswith("shard") or not parts[1][5:].isdigit() or not parts[0]:
        return None
    return parts[0], int(parts[1][5:])


def _embedded_messages(settings: BrokerSettings, delivered_since: float) -> list[dict]:
    from jobs.embedded_broker import URL_PREFIX

    path = "/" + settings.url[len(URL_PREFIX):].lstrip("/")
    if not os.path.exists(path):
        return []  # the broker file was deleted: it holds nothing
    con = sqlite3.connect(path, timeout=30.0)
    try:
        # a delivered message is invisible until its delivery time + the visibility timeout
        rows = con.execute(
            "SELECT payload FROM messages WHERE queue = ? AND (visible_at <= ? OR visible_at - ? >= ?)",
            (settings.queue, time.time(), settings.shard_timeout_s, delivered_since)).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []  # made again, empty, a moment ago
        raise
    finally:
        con.close()
    return [json.loads(payload) for (payload,) in rows]


def _redis_messages(settings: BrokerSettings, delivered_since: float) -> list[dict]:
    import redis

    client = redis.Redis.from_url(settings.url, socket_timeout=10)
    try:
        messages = []
        keys = [settings.queue] + [f"{settings.queue}{REDIS_PRIORITY_SEP}{p}" for p in range(1, 10)]
        for key in keys:
            messages += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
        delivered = dict(client.zrange(REDIS_UNACKED_INDEX, 0, -1, withscores=True))  # tag -> when
        for tag, raw in client.hgetall(REDIS_UNACKED).items():
            message, _exchange, routing_key = json.loads(raw)
            if routing_key == settings.queue and delivered.get(tag, math.inf) >= delivered_since:
                messages.append(message)
        return messages
    finally:
        client.close()
