"""Fleet operations against real brokers and real `batchgen worker` processes: Celery's own CLI
(`celery -A jobs.celery_app inspect ...`, `control revoke`) on Redis and RabbitMQ, Flower's API and pages,
a worker's Prometheus /metrics over HTTP against the views, JSON log lines, and the worker record of a
killed worker going stale. Redis tests use $BATCHGEN_TEST_REDIS_URL, RabbitMQ $BATCHGEN_TEST_AMQP_URL."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs.celery_app import TASK_NAME, make_app
from jobs.shards.broker_messages import parse_shard_task_id, shard_task_id
from jobs.shards.supervise import job_progress
from jobs.store.workers import read_worker_records
from tests.dashboard import test_browser
from tests.dashboard.test_browser import Page
from tests.jobs.helpers import (
    Worker,
    broker_for,
    delete_queue,
    job_status,
    logs,
    outputs_of,
    query,
    shards_of,
    submit,
    unique_queue,
    wait_for,
    write_prompts,
)

pytestmark = pytest.mark.slow

browser = test_browser.browser  # the dashboard tests' chromium fixture, for Flower's pages

WORKER_ARGS = ("--concurrency", "2", "--metrics-port", "0", "--metrics-host", "127.0.0.1",
               "--log-format", "json")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broker_env(settings, data_dir: Path) -> dict:
    return {**os.environ, "BATCHGEN_BROKER_URL": settings.url, "BATCHGEN_QUEUE": settings.queue,
            "BATCHGEN_DATA_DIR": str(data_dir)}


def celery(settings, data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`celery -A jobs.celery_app ARGS` as a user runs it, with the broker in the environment."""
    cmd = [sys.executable, "-m", "celery", "-A", "jobs.celery_app", *args]
    env = broker_env(settings, data_dir)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def inspect_json(settings, data_dir: Path, method: str, worker_id: str) -> dict:
    done = celery(settings, data_dir, "inspect", method, "--json", "-t", "10", "-d", worker_id)
    assert done.returncode == 0, f"celery inspect {method} failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=15) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def flower(settings, data_dir: Path, log_dir: Path):
    """Flower on a free loopback port (its API open, as FLOWER_UNAUTHENTICATED_API allows); yields its URL."""
    port = free_port()
    log_path = log_dir / "flower.log"
    env = {**broker_env(settings, data_dir), "FLOWER_UNAUTHENTICATED_API": "true"}
    cmd = [sys.executable, "-m", "celery", "-A", "jobs.celery_app", "flower", f"--port={port}",
           "--address=127.0.0.1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, f"flower exited:\n{log_path.read_text()}"
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(base + "/healthcheck", timeout=2) as response:
                return response.status == 200
        return False

    try:
        wait_for(up, 60, "flower to answer", on_timeout=log_path.read_text)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def redis_fleet(tmp_path_factory):
    """Flower and one worker (metrics on, JSON logs) on Redis; one small job run to its end."""
    root = tmp_path_factory.mktemp("fleet")
    data_dir = root / "data"
    settings = broker_for("redis", data_dir, unique_queue("fleet"))
    worker = None
    try:
        with flower(settings, data_dir, root) as flower_url:
            name = f"fleet-{settings.queue.rsplit('.', 1)[-1]}"  # own name: Celery's pidbox queue is per name
            worker = Worker(data_dir, settings, name, root, *WORKER_ARGS)
            worker.wait_ready()
            # Flower hears the worker's heartbeat events: it shows online from events, not only from inspect
            wait_for(lambda: [w for w in get_json(flower_url + "/workers?json=1")["data"]
                              if w.get("hostname") == worker.worker_id and w.get("status")], 60,
                     "flower to see the worker's heartbeats", on_timeout=lambda: logs([worker]))
            src = root / "in.parquet"
            write_prompts(src, 8)
            manifest = submit(data_dir, src, settings, shard_size=2, max_tokens=16)
            wait_for(lambda: job_progress(manifest).finished, 120, "the job",
                     on_timeout=lambda: logs([worker]))
            yield {"settings": settings, "data_dir": data_dir, "worker": worker, "flower": flower_url,
                   "manifest": manifest, "root": root}
    finally:
        if worker is not None:
            worker.stop()
        delete_queue(settings)


def _record(data_dir: Path, worker_id: str):
    return next((r for r in read_worker_records(data_dir) if r.worker_id == worker_id), None)


def test_worker_metrics_over_http_match_the_views(redis_fleet):
    data_dir, worker = redis_fleet["data_dir"], redis_fleet["worker"]
    record = _record(data_dir, worker.worker_id)  # written before the worker said it was ready
    url = record.metrics_url

    def scraped() -> dict:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.labels.get("worker") == worker.worker_id and "le" not in s.labels}

    def iterations_match():  # the view catches up with the engine once the worker flushes
        m = scraped()
        its = query(data_dir, "SELECT count(*) AS n, sum(scheduled_tokens) AS t FROM iterations "
                              "WHERE worker_id = ?", [worker.worker_id])[0]
        idle = m["batchgen:num_requests_running"] == m["batchgen:num_requests_waiting"] == 0
        return m if idle and (its["n"], its["t"]) == (m["batchgen:iteration_tokens_total_count"],
                                                      m["batchgen:iteration_tokens_total_sum"]) else None

    m = wait_for(iterations_match, 60, "iterations in the view to match the worker's counters")
    req = query(data_dir, "SELECT count(*) AS n, sum(prompt_tokens) AS p, sum(output_tokens) AS o "
                          "FROM requests WHERE worker_id = ?", [worker.worker_id])[0]
    assert req["n"] == 8
    assert (m["batchgen:prompt_tokens_total"], m["batchgen:generation_tokens_total"]) == (req["p"], req["o"])
    assert m["batchgen:e2e_request_latency_seconds_count"] == 8


def test_worker_logs_are_json_lines(redis_fleet):
    lines = [line for line in redis_fleet["worker"].log().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line: one JSON object
    messages = [e["message"] for e in entries]
    assert any("Prometheus metrics on http://127.0.0.1:" in m for m in messages)
    assert any(e["logger"].startswith("celery") for e in entries), "Celery's own records too"
    assert {"ts", "level", "logger", "message", "pid"} <= set(entries[0])


def test_flower_lists_the_worker_and_its_shard_tasks(redis_fleet):
    flower_url, worker, manifest = redis_fleet["flower"], redis_fleet["worker"], redis_fleet["manifest"]
    workers = get_json(flower_url + "/api/workers?refresh=1")
    assert worker.worker_id in workers
    assert redis_fleet["settings"].queue in [q["name"] for q in workers[worker.worker_id]["active_queues"]]
    assert TASK_NAME in workers[worker.worker_id]["registered"]

    def job_tasks() -> list[dict]:
        tasks = get_json(flower_url + "/api/tasks").values()
        return [t for t in tasks if (parse_shard_task_id(t["uuid"]) or ("",))[0] == manifest.job_id]

    tasks = wait_for(lambda: (lambda ts: ts if len(ts) == 4 and all(t["state"] == "SUCCESS" for t in ts)
                              else None)(job_tasks()), 60, "flower to list the job's 4 shard tasks as done")
    assert {t["name"] for t in tasks} == {TASK_NAME} and {t["worker"] for t in tasks} == {worker.worker_id}
    assert sorted(parse_shard_task_id(t["uuid"])[1] for t in tasks) == [0, 1, 2, 3]
    for t in tasks:
        assert f"'job_id': '{manifest.job_id}'" in t["kwargs"] and "'shard_id': " in t["kwargs"]
        assert t["sent"] is not None, "the publisher's task-sent event reached flower"


@pytest.mark.browser
def test_flower_pages_render_the_worker_and_tasks(redis_fleet, browser, tmp_path):
    flower_url, worker, manifest = redis_fleet["flower"], redis_fleet["worker"], redis_fleet["manifest"]
    page = Page(browser)
    try:
        page.open(flower_url + "/workers")
        row = page.tab.locator("#workers-table tbody tr", has_text=worker.worker_id)
        row.wait_for(timeout=20_000)
        assert "Online" in row.inner_text()
        page.screenshot(tmp_path / "flower-workers.png")
        page.open(flower_url + "/tasks")
        shard3 = page.tab.locator("#tasks-table tbody tr", has_text=f"{manifest.job_id}.shard3")
        shard3.wait_for(timeout=20_000)
        assert TASK_NAME in page.tab.inner_text("#tasks-table")
        page.screenshot(tmp_path / "flower-tasks.png")
    finally:
        page.context.close()
    # leaving the workers page aborts its auto-refresh request: that is navigation, not an error
    assert [p for p in page.problems if "net::ERR_ABORTED" not in p] == []


@pytest.fixture(params=["redis", "amqp"])
def fleet_worker(request, tmp_path):
    """A worker on each server broker: the Redis one of `redis_fleet`, a fresh one on RabbitMQ."""
    if request.param == "redis":
        fleet = request.getfixturevalue("redis_fleet")
        yield fleet["settings"], fleet["data_dir"], fleet["worker"]
        return
    data_dir = tmp_path / "data"
    settings = broker_for("amqp", data_dir, unique_queue("fleet"))
    # a name of its own: Celery declares an exclusive pidbox queue per worker name on the shared server
    name = f"fleet-amqp-{settings.queue.rsplit('.', 1)[-1]}"
    worker = Worker(data_dir, settings, name, tmp_path, *WORKER_ARGS)
    try:
        worker.wait_ready()
        yield settings, data_dir, worker
    finally:
        worker.stop()
        delete_queue(settings)


def test_celery_inspect_answers_and_revoke_cancels_the_job(fleet_worker, tmp_path):
    settings, data_dir, worker = fleet_worker
    wid = worker.worker_id
    assert inspect_json(settings, data_dir, "ping", wid) == {wid: {"ok": "pong"}}
    stats = inspect_json(settings, data_dir, "stats", wid)[wid]
    assert stats["pool"]["max-concurrency"] == 2 and "thread" in stats["pool"]["implementation"].lower()
    queues = inspect_json(settings, data_dir, "active_queues", wid)[wid]
    assert [q["name"] for q in queues] == [settings.queue]
    foreign = celery(settings, data_dir, "control", "revoke", "6e1f3c2a-0000-4000-8000-000000000000")
    assert foreign.returncode == 0 and "flagged as revoked" in foreign.stdout, foreign.stderr

    src = tmp_path / "slow.parquet"
    write_prompts(src, 48)  # 48 one-row shards of 2000 tokens: the job outlasts the look-up and the revoke
    m = submit(data_dir, src, settings, shard_size=1, max_tokens=2000, engine={"model": "tiny-random"})
    manifest_shards = {s.shard_id for s in m.shards}

    def active_shards() -> list[dict]:
        found = inspect_json(settings, data_dir, "active", wid).get(wid, [])
        return [t for t in found if t["kwargs"].get("job_id") == m.job_id]

    active = wait_for(active_shards, 120, "`celery inspect active` to list a running shard task",
                      on_timeout=lambda: logs([worker]))
    assert active[0]["name"] == TASK_NAME and active[0]["kwargs"]["shard_id"] in manifest_shards
    assert job_status(data_dir, m.job_id) == "running", "the foreign revoke cancelled nothing"

    # what `celery -A jobs.celery_app control revoke ID` sends, from here. The task revoked is one the
    # worker holds but has not started (prefetched: Celery skips it, so it never commits), or, where the
    # transport prefetches nothing beyond the pool's threads (RabbitMQ), the id the job's last shard's task
    # has (it is still queued). A running shard of 2000 tokens may commit (about 1 s here) before the next
    # housekeeping tick sees the revoke, and revoking a finished task changes nothing (test_celery_app).
    app = make_app(settings)
    held = [t for t in (app.control.inspect(destination=[wid], timeout=10).reserved() or {}).get(wid, [])
            if t["kwargs"]["job_id"] == m.job_id]
    task_id = held[0]["id"] if held else shard_task_id(m.job_id, max(manifest_shards))
    app.control.revoke(task_id)
    wait_for(lambda: job_status(data_dir, m.job_id) == "cancelled" and job_progress(m).finished, 60,
             "the revoke to cancel the job", on_timeout=lambda: logs([worker]))
    job = query(data_dir, "SELECT * FROM jobs WHERE job_id = ?", [m.job_id])[0]
    assert task_id in job["error"] and "revoked" in job["error"]
    statuses = [s["status"] for s in shards_of(data_dir, m.job_id).values()]
    assert "cancelled" in statuses and "running" not in statuses and "queued" not in statuses
    done = [s for s, v in shards_of(data_dir, m.job_id).items() if v["status"] == "completed"]
    assert len(outputs_of(data_dir, m.job_id)) >= len(done), "finished rows stay"
    assert f"job {m.job_id} cancelled: task {task_id}" in worker.log()


def test_a_killed_workers_record_goes_stale_and_a_stopped_one_says_stopped(tmp_path):
    data_dir = tmp_path / "data"
    settings = broker_for("embedded", data_dir, unique_queue("gone"))
    killed = Worker(data_dir, settings, "killed", tmp_path)
    stopped = Worker(data_dir, settings, "stopped", tmp_path)
    try:
        for w in (killed, stopped):
            w.wait_ready()
        killed.kill9()
        assert stopped.stop() == 0
        record = wait_for(lambda: (lambda r: r if r and r.state(time.time()) == "lost" else None)(
            _record(data_dir, killed.worker_id)), 30, "the killed worker's record to go stale")
        assert record.gone_since(time.time()) == record.heartbeat_ts and record.stopped_ts == 0
        gone = _record(data_dir, stopped.worker_id)
        assert gone.state(time.time()) == "stopped" and gone.stopped_ts >= gone.started_ts
    finally:
        killed.stop()
        stopped.stop()
