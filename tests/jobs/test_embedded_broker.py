"""The embedded SQLite transport: at-least-once delivery with a visibility timeout (kombu level)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from kombu import Connection, Exchange, Queue

from jobs.embedded_broker import broker_url

QUEUE = Queue("q", Exchange("q"), "q")


def _conn(path, visibility_timeout=60.0) -> Connection:
    return Connection(broker_url(str(path)), transport_options={"visibility_timeout": visibility_timeout,
                                                                "polling_interval": 0.02})


def _publish(conn, *bodies) -> None:
    producer = conn.Producer()
    for body in bodies:
        producer.publish(body, exchange=QUEUE.exchange, routing_key="q", declare=[QUEUE], serializer="json")


def _receive(conn, n=1, ack=True, timeout=3.0) -> list:
    got = []

    def on_message(body, message):
        got.append(body)
        if ack:
            message.ack()

    with conn.Consumer(QUEUE, callbacks=[on_message], accept=["json"]) as consumer:
        consumer.qos(prefetch_count=n)
        end = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < end:
            try:
                conn.drain_events(timeout=0.1)
            except TimeoutError:
                pass
    return got


def test_fifo_and_ack_deletes(tmp_path):
    db = tmp_path / "b.sqlite"
    with _conn(db) as conn:
        _publish(conn, {"n": 1}, {"n": 2}, {"n": 3})
        assert conn.default_channel._size("q") == 3
        assert _receive(conn, 3) == [{"n": 1}, {"n": 2}, {"n": 3}]
    with _conn(db) as conn:
        assert _receive(conn, 1, timeout=0.3) == []


def test_unacked_message_returns_on_clean_close_and_after_visibility_timeout(tmp_path):
    db = tmp_path / "b.sqlite"
    with _conn(db) as conn:
        _publish(conn, {"n": 1})
        assert _receive(conn, 1, ack=False) == [{"n": 1}]
    # the consumer closed without acking: kombu restores its unacked messages
    with _conn(db, visibility_timeout=0.5) as conn:
        assert _receive(conn, 1, ack=False) == [{"n": 1}]
        conn.default_channel.qos._delivered.clear()  # forget it, as a killed process would
        assert _receive(conn, 1, timeout=0.2) == [], "invisible during the visibility timeout"
        time.sleep(0.6)
        assert _receive(conn, 1) == [{"n": 1}], "visible again after it"
    with _conn(db) as conn:
        assert _receive(conn, 1, timeout=0.3) == []


def test_message_held_by_a_killed_consumer_is_redelivered(tmp_path):
    """kombu's own sqla+sqlite:// and filesystem:// lose this message; this transport must not."""
    db = tmp_path / "b.sqlite"
    with _conn(db) as conn:
        _publish(conn, {"n": 42})
    consumer = textwrap.dedent(f"""
        import os, time
        from tests.jobs.test_embedded_broker import _conn, _receive
        with _conn({str(db)!r}, visibility_timeout=1.0) as conn:
            got = _receive(conn, 1, ack=False)
            print(got, flush=True)
            os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", consumer], capture_output=True, text=True, timeout=60)
    assert out.returncode == -9 and "{'n': 42}" in out.stdout, out.stderr
    with _conn(db, visibility_timeout=1.0) as conn:
        assert _receive(conn, 1, timeout=3.0) == [{"n": 42}]


def test_reject_requeue_and_drop(tmp_path):
    with _conn(tmp_path / "b.sqlite") as conn:
        _publish(conn, {"n": 1})
        chan = conn.default_channel
        msg = chan.basic_get("q")
        chan.basic_reject(msg.delivery_tag, requeue=True)
        msg = chan.basic_get("q")
        assert msg is not None and msg.delivery_info.get("redelivered") is True
        chan.basic_reject(msg.delivery_tag, requeue=False)
        assert chan.basic_get("q") is None


def test_url_must_be_absolute(tmp_path):
    with pytest.raises(ValueError, match="ABSOLUTE"):
        with Connection("batchgen+sqlite://relative/path") as conn:
            conn.default_channel.basic_get("q")
