"""A lost broker message does not hang a job (issue 14, item 2): a shard that waited longer than
$BATCHGEN_REPUBLISH_AFTER_S with no claim while the broker holds no message for it is published again;
`status` and the dashboard warn while a job's shards wait and no live worker consumes its queue;
`retry` re-queues stuck shards. Duplicates are harmless: every row exactly once."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
from click.testing import CliRunner

from dashboard import create_app
from jobs.commands import retry, status
from jobs.shards.broker_messages import live_shard_messages, publish_shard
from jobs.shards.supervise import job_progress, requeue_dead_shards
from jobs.status import job_status as status_of
from tests.jobs.helpers import (
    broker_for,
    delete_queue,
    logs,
    outputs_of,
    shards_of,
    submit,
    unique_queue,
    wait_for,
    workers,
    write_prompts,
)

NUM_ROWS, SHARD_SIZE, MAX_TOKENS = 12, 3, 3
pytestmark = pytest.mark.slow


def _lose_messages(settings) -> None:
    """What a flushed (or failed-over) broker does to the queue: every message of it is gone."""
    if settings.kind == "embedded":
        path = "/" + settings.url.split("sqlite://", 1)[1].lstrip("/")
        with sqlite3.connect(path) as con:
            con.execute("DELETE FROM messages WHERE queue = ?", (settings.queue,))
        return
    import redis

    client = redis.Redis.from_url(settings.url)
    client.delete(settings.queue)
    for tag, raw in client.hgetall("unacked").items():
        if json.loads(raw)[2] == settings.queue:
            client.hdel("unacked", tag)
            client.zrem("unacked_index", tag)
    client.close()


def _assert_every_row_once(data_dir, m) -> None:
    rows = outputs_of(data_dir, m.job_id)
    assert [r["request_id"] for r in rows] == [str(i) for i in range(NUM_ROWS)]  # none lost, none twice
    assert {r["finish_reason"] for r in rows} == {"length"}
    assert [s["status"] for s in shards_of(data_dir, m.job_id).values()] == ["completed"] * 4


@pytest.mark.parametrize("kind", ["embedded", "redis"])
def test_lost_messages_are_republished_and_the_job_finishes(kind, tmp_path, monkeypatch):
    data_dir, src = tmp_path / "data", tmp_path / "in.parquet"
    write_prompts(src, NUM_ROWS)
    settings = broker_for(kind, data_dir, unique_queue("lost"))
    monkeypatch.setenv("BATCHGEN_REPUBLISH_AFTER_S", "1.5")
    try:
        m = submit(data_dir, src, settings, shard_size=SHARD_SIZE, max_tokens=MAX_TOKENS)
        assert live_shard_messages(settings) == {(m.job_id, s) for s in range(4)}
        # queued, and no worker: both status and the dashboard's data say so
        warning = status_of(m)["warning"]
        assert warning.startswith(f"4 shard(s) queued but no live worker consumes queue {settings.queue!r}")
        dashboard = create_app({"TESTING": True, "DATA_DIR": data_dir}).test_client()
        assert dashboard.get(f"/api/jobs/{m.job_id}").get_json()["warning"] == warning
        shown = warning.replace("'", "&#39;")  # as Jinja escapes it
        assert f'id="job-warning">{shown}</p>' in dashboard.get(f"/jobs/{m.job_id}").text
        time.sleep(2.0)
        assert requeue_dead_shards(data_dir, settings) == []  # waited long, but the messages are there
        _lose_messages(settings)
        assert live_shard_messages(settings) == set()
        # a worker starts after the flush: its janitor finds the four waiting shards with no message
        with workers(data_dir, settings, tmp_path, ["w1"], "--max-num-seqs", "4", "--concurrency", "2") as ws:
            wait_for(lambda: job_progress(m).finished, 180, f"job over {kind}", on_timeout=lambda: logs(ws))
            assert status_of(m)["warning"] is None
            assert dashboard.get(f"/api/jobs/{m.job_id}").get_json()["warning"] is None
            assert ws[0].stop() == 0, logs(ws)
        assert "no message in" in logs(ws) and "re-publishing it" in logs(ws)
        _assert_every_row_once(data_dir, m)
    finally:
        delete_queue(settings)


def test_retry_republishes_stuck_shards_and_duplicates_are_harmless(tmp_path, monkeypatch):
    """`batchgen retry` re-queues shards whose messages are lost at once (no waiting); a shard
    published three times is still generated once."""
    data_dir, src = tmp_path / "data", tmp_path / "in.parquet"
    write_prompts(src, NUM_ROWS)
    settings = broker_for("embedded", data_dir, unique_queue("stuck"))
    monkeypatch.setenv("BATCHGEN_DATA_DIR", str(data_dir))
    m = submit(data_dir, src, settings, shard_size=SHARD_SIZE, max_tokens=MAX_TOKENS)
    _lose_messages(settings)
    shown = CliRunner().invoke(status, [m.job_id, "--no-requeue"])
    assert shown.exit_code == 0, shown.output
    assert "warning: 4 shard(s) queued but no live worker" in shown.output, shown.output
    done = CliRunner().invoke(retry, [m.job_id])
    assert done.exit_code == 0, done.output
    assert f"job {m.job_id}: re-queued stuck shard(s) 0, 1, 2, 3" in done.output
    assert live_shard_messages(settings) == {(m.job_id, s) for s in range(4)}
    again = CliRunner().invoke(retry, [m.job_id])
    assert "no failed or stuck shards to retry" in again.output  # their messages are live now
    for _ in range(2):  # two more copies of shard 1's message
        publish_shard(settings, m.job_id, 1)
    with workers(data_dir, settings, tmp_path, ["w1"], "--max-num-seqs", "4", "--concurrency", "2") as ws:
        wait_for(lambda: job_progress(m).finished and not live_shard_messages(settings), 180, "the job",
                 on_timeout=lambda: logs(ws))
        assert ws[0].stop() == 0, logs(ws)
    _assert_every_row_once(data_dir, m)
    assert shards_of(data_dir, m.job_id)[1]["attempts"] == 1  # the copies were skipped, not run


def _deliver(settings, job_id: str, ages: dict[int, float]) -> None:
    """Mark shards' messages delivered `ages[shard]` seconds ago and unacknowledged, as a consumer
    that took them (and may have died since) leaves them."""
    if settings.kind == "embedded":
        path = "/" + settings.url.split("sqlite://", 1)[1].lstrip("/")
        with sqlite3.connect(path) as con:
            for shard, age in ages.items():
                con.execute("UPDATE messages SET visible_at = ? WHERE payload LIKE ?",
                            (time.time() - age + settings.shard_timeout_s, f'%"{job_id}.shard{shard}.%'))
        return
    import redis

    client = redis.Redis.from_url(settings.url)
    for raw in client.lrange(settings.queue, 0, -1):
        message = json.loads(raw)
        shard = int(message["headers"]["id"].rsplit(".", 2)[1][5:])
        if shard in ages:
            tag = f"test-{settings.queue}-{shard}"
            client.lrem(settings.queue, 1, raw)
            client.hset("unacked", tag, json.dumps([message, settings.queue, settings.queue]))
            client.zadd("unacked_index", {tag: time.time() - ages[shard]})
    client.close()


@pytest.mark.parametrize("kind", ["embedded", "redis"])
def test_a_message_held_by_a_dead_consumer_is_not_live(kind, tmp_path):
    """A message delivered long ago and never claimed belongs to a consumer that died holding it: the
    broker would give it back only after the shard timeout (10 minutes or more), so it does not count."""
    data_dir, src = tmp_path / "data", tmp_path / "in.parquet"
    write_prompts(src, NUM_ROWS)
    settings = broker_for(kind, data_dir, unique_queue("held"))
    try:
        m = submit(data_dir, src, settings, shard_size=SHARD_SIZE, max_tokens=MAX_TOKENS)
        _deliver(settings, m.job_id, {0: 100.0, 1: 5.0})  # shard 0's consumer died long ago
        everything = {(m.job_id, s) for s in range(4)}
        assert live_shard_messages(settings) == everything
        assert live_shard_messages(settings, held_within_s=30.0) == everything - {(m.job_id, 0)}
    finally:
        _lose_messages(settings)
        delete_queue(settings)
