"""Which broker, which queue, and the broker timeouts a shard needs.

`BATCHGEN_BROKER_URL` picks Redis (`redis://`) or RabbitMQ (`amqp://`) for several machines; unset,
the embedded broker under DATA_DIR/broker/ serves one machine with no server (jobs.embedded_broker).

Timeouts come from the expected time of one shard, not broker defaults: a message is held,
unacknowledged, for as long as its shard runs (acks_late). Redis and the embedded broker re-deliver
a message held longer than their visibility timeout; RabbitMQ closes a channel whose consumer holds
one longer than its consumer timeout (30 min by default, set per consumer here, RabbitMQ >= 3.12;
older servers ignore the argument and keep their configured `consumer_timeout`). Both are set to
`shard_timeout_s`, a generous multiple of the expected shard time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kombu.utils.url import maybe_sanitize_url

BROKER_ENV = "BATCHGEN_BROKER_URL"
QUEUE_ENV = "BATCHGEN_QUEUE"
DEFAULT_QUEUE = "batchgen"
EMBEDDED = "embedded"

DEFAULT_SHARD_SIZE = 256  # rows per shard: minutes of work on a GPU or a few CPU cores, not hours
DEFAULT_MAX_TOKENS = 256  # the job default when --max-tokens is not given
MIN_TOKENS_PER_S = 20.0  # a pessimistic engine throughput (small CPU) for the expected shard time
PROMPT_TOKENS_GUESS = 256  # prompt tokens per row assumed when sizing timeouts
TIMEOUT_SAFETY = 3.0  # shard_timeout = this * expected shard time ...
MIN_SHARD_TIMEOUT_S = 600.0  # ... but at least 10 minutes
MAX_SHARD_TIMEOUT_S = 24 * 3600.0  # ... and at most a day


def expected_shard_seconds(shard_size: int, max_tokens: int) -> float:
    """Time one shard takes at the pessimistic throughput (prompt tokens count a tenth of output)."""
    tokens = shard_size * (max_tokens + PROMPT_TOKENS_GUESS / 10)
    return tokens / MIN_TOKENS_PER_S


def shard_timeout_s(shard_size: int, max_tokens: int) -> float:
    """The broker visibility / consumer timeout for shards of this size."""
    expected = TIMEOUT_SAFETY * expected_shard_seconds(shard_size, max_tokens)
    return min(max(expected, MIN_SHARD_TIMEOUT_S), MAX_SHARD_TIMEOUT_S)


@dataclass(frozen=True)
class BrokerSettings:
    """Where shard messages go and how long a consumer may hold one."""

    url: str  # kombu URL (embedded: batchgen+sqlite:///DATA_DIR/broker/broker.sqlite)
    kind: str  # embedded | redis | amqp
    queue: str  # the queue shard tasks are published to and consumed from
    shard_timeout_s: float  # visibility timeout (Redis, embedded) / consumer timeout (RabbitMQ)

    @property
    def display_url(self) -> str:
        """The URL without its password (it goes into manifests and logs)."""
        return EMBEDDED if self.kind == EMBEDDED else maybe_sanitize_url(self.url)


def resolve_broker(data_dir: str | os.PathLike, *, queue: str | None = None, url: str | None = None,
                   embedded: bool = False, timeout_s: float | None = None) -> BrokerSettings:
    """The broker in force: `url`, else $BATCHGEN_BROKER_URL, else the embedded one (always when
    `embedded` or when the URL is the word "embedded"). `queue` defaults to $BATCHGEN_QUEUE, else
    "batchgen"."""
    queue = queue or os.environ.get(QUEUE_ENV) or DEFAULT_QUEUE
    _check_queue(queue)
    timeout_s = timeout_s or shard_timeout_s(DEFAULT_SHARD_SIZE, DEFAULT_MAX_TOKENS)
    url = None if embedded else (url or os.environ.get(BROKER_ENV) or None)
    if url is None or url == EMBEDDED:
        return BrokerSettings(embedded_url(data_dir), EMBEDDED, queue, timeout_s)
    kind = _kind_of(url)
    return BrokerSettings(url, kind, queue, timeout_s)


def embedded_url(data_dir: str | os.PathLike) -> str:
    from jobs.embedded_broker import broker_url

    directory = Path(data_dir).expanduser().resolve() / "broker"
    directory.mkdir(parents=True, exist_ok=True)
    return broker_url(str(directory / "broker.sqlite"))


def _kind_of(url: str) -> str:
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis", "rediss"):
        return "redis"
    if scheme in ("amqp", "amqps", "pyamqp"):
        return "amqp"
    raise ValueError(f"{BROKER_ENV}={maybe_sanitize_url(url)!r}: use redis://... or amqp://... "
                     "(or leave it unset for the embedded broker)")


def _check_queue(queue: str) -> None:
    if not queue or len(queue) > 200 or not all(c.isalnum() or c in "._-:" for c in queue):
        raise ValueError(f"queue name {queue!r} must be 1-200 of [A-Za-z0-9._-:]")
