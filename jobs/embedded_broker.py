"""The embedded broker: a kombu transport over one SQLite file under DATA_DIR, no server needed.

Why not kombu's own `sqla+sqlite://` or `filesystem://`? Both hand a message out by hiding or
deleting it at once and keep the unacknowledged copy only in the consumer's memory: a worker killed
with -9 while holding a shard takes the message with it (measured with kombu 5.7: the message never
comes back). This transport gives the at-least-once delivery Redis gives instead:

- a delivered message stays in the table, invisible until `visible_at` = delivery time + the
  visibility timeout; an ack deletes it; a reject or a clean shutdown makes it visible again;
- so a message whose consumer died becomes deliverable again after the visibility timeout.

URL: `batchgen+sqlite:///ABSOLUTE/PATH/broker.sqlite` (the `batchgen` transport is registered
with kombu when this module is imported). Transport options: `visibility_timeout` (seconds) and
`polling_interval` (seconds between polls of an empty queue). One machine only: SQLite's locking
is not safe on network filesystems; use Redis or RabbitMQ across machines.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from queue import Empty

from kombu.transport import TRANSPORT_ALIASES, virtual

TRANSPORT_NAME = "batchgen"
URL_PREFIX = f"{TRANSPORT_NAME}+sqlite://"
DEFAULT_VISIBILITY_TIMEOUT_S = 3600.0
DEFAULT_POLLING_INTERVAL_S = 0.1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    tag TEXT NOT NULL UNIQUE,          -- kombu delivery tag (assigned once, at publish)
    payload TEXT NOT NULL,             -- the kombu message as JSON
    visible_at REAL NOT NULL,          -- deliverable when visible_at <= now
    deliveries INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS messages_ready ON messages (queue, visible_at, id);
"""


def broker_url(path: str) -> str:
    """The URL of the embedded broker stored in the SQLite file at absolute `path`."""
    return f"{URL_PREFIX}/{path.lstrip('/')}" if path.startswith("/") else f"{URL_PREFIX}/{path}"


class _Database:
    """One SQLite connection per transport, shared by its threads under a lock."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.conn = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
        with self.lock:
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.executescript(_SCHEMA)

    def put(self, queue: str, tag: str, payload: str) -> None:
        with self.lock:
            self.conn.execute(
                "INSERT INTO messages (queue, tag, payload, visible_at) VALUES (?, ?, ?, 0) "
                "ON CONFLICT(tag) DO UPDATE SET visible_at = 0, payload = excluded.payload",
                (queue, tag, payload))

    def claim(self, queue: str, visibility_timeout: float) -> tuple[str, int] | None:
        """The oldest ready message of `queue`, made invisible for `visibility_timeout`, and how many
        times it has been delivered (this time included)."""
        now = time.time()
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                row = self.conn.execute(
                    "SELECT id, payload, deliveries FROM messages WHERE queue = ? AND visible_at <= ? "
                    "ORDER BY id LIMIT 1", (queue, now)).fetchone()
                if row is not None:
                    self.conn.execute("UPDATE messages SET visible_at = ?, deliveries = deliveries + 1 "
                                      "WHERE id = ?", (now + visibility_timeout, row[0]))
            finally:
                self.conn.execute("COMMIT")
        return None if row is None else (row[1], row[2] + 1)

    def delete(self, tag: str) -> None:
        with self.lock:
            self.conn.execute("DELETE FROM messages WHERE tag = ?", (tag,))

    def make_visible(self, tag: str) -> None:
        with self.lock:
            self.conn.execute("UPDATE messages SET visible_at = 0 WHERE tag = ?", (tag,))

    def size(self, queue: str) -> int:
        with self.lock:
            return self.conn.execute("SELECT count(*) FROM messages WHERE queue = ? AND visible_at <= ?",
                                     (queue, time.time())).fetchone()[0]

    def purge(self, queue: str) -> int:
        with self.lock:
            return self.conn.execute("DELETE FROM messages WHERE queue = ?", (queue,)).rowcount

    def close(self) -> None:
        with self.lock:
            self.conn.close()


class QoS(virtual.QoS):
    """Acks delete the stored message; rejects and restores make it visible again."""

    def ack(self, delivery_tag):
        self.channel.db.delete(delivery_tag)
        super().ack(delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        if requeue:
            self.channel.db.make_visible(delivery_tag)
        else:
            self.channel.db.delete(delivery_tag)
        self._quick_ack(delivery_tag)

    def restore_unacked(self):
        """Make every message this channel holds unacknowledged visible again (clean shutdown)."""
        self._flush()
        errors = []
        while self._delivered:
            tag, message = self._delivered.popitem()
            try:
                self.channel.db.make_visible(tag)
            except Exception as exc:  # noqa: BLE001 - reported to kombu, which logs them
                errors.append((exc, message))
        return errors


class Channel(virtual.Channel):
    QoS = QoS

    def __init__(self, connection, **kwargs):
        super().__init__(connection, **kwargs)
        opts = connection.client.transport_options
        self.visibility_timeout = float(opts.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT_S))
        self.db = connection.database()

    def _new_queue(self, queue, **kwargs):
        pass  # queues exist as soon as a message names them

    def _has_queue(self, queue, **kwargs):
        return True

    def _put(self, queue, message, **kwargs):
        tag = message["properties"]["delivery_tag"]
        self.db.put(queue, tag, json.dumps(message))

    def _get(self, queue, timeout=None):
        claimed = self.db.claim(queue, self.visibility_timeout)
        if claimed is None:
            raise Empty()
        payload, deliveries = claimed
        message = json.loads(payload)
        if deliveries > 1:
            message["redelivered"] = True
            message["properties"].setdefault("delivery_info", {})["redelivered"] = True
        return message

    def _restore(self, message):
        """Redeliver `message`: it is still stored (unacked), so only its visibility changes."""
        self.db.make_visible(message.delivery_tag)

    def _size(self, queue):
        return self.db.size(queue)

    def _purge(self, queue):
        return self.db.purge(queue)


class Transport(virtual.Transport):
    Channel = Channel
    polling_interval = DEFAULT_POLLING_INTERVAL_S
    driver_type = "sqlite"
    driver_name = "sqlite3"
    can_parse_url = True
    connection_errors = virtual.Transport.connection_errors + (sqlite3.OperationalError,)
    channel_errors = virtual.Transport.channel_errors + (sqlite3.OperationalError,)

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        self._db: _Database | None = None
        self._db_lock = threading.Lock()

    def database(self) -> _Database:
        with self._db_lock:
            if self._db is None:
                self._db = _Database(self._path())
            return self._db

    def _path(self) -> str:
        hostname = self.client.hostname or ""
        if not hostname.startswith("sqlite:///"):
            raise ValueError(f"embedded broker URL must be {URL_PREFIX}/ABSOLUTE/PATH, got {hostname!r}")
        return "/" + hostname[len("sqlite:///"):].lstrip("/")

    def driver_version(self):
        return sqlite3.sqlite_version

    def close_connection(self, connection):
        super().close_connection(connection)
        with self._db_lock:
            if self._db is not None:
                self._db.close()
                self._db = None


TRANSPORT_ALIASES.setdefault(TRANSPORT_NAME, f"{__name__}:Transport")
