"""The Celery app as Celery's own tools load it (`celery -A jobs.celery_app`), its settings per broker,
shard task ids, and revoked task ids cancelling their jobs (jobs.revoke). No worker processes here: the
real brokers and workers are in test_fleet.py."""

from __future__ import annotations

import importlib
import logging

import pytest
from celery import Celery
from celery.app.utils import find_app

from jobs import celery_app
from jobs.broker import resolve_broker
from jobs.celery_app import TASK_NAME, celery_config, make_app, worker_options
from jobs.manifest import JobPaths
from jobs.revoke import RevokeWatcher
from jobs.shard_runner import register_shard_task
from jobs.shards.broker_messages import parse_shard_task_id, shard_task_id
from jobs.store.parts import Store
from jobs.submit import JobRequest, prepare_job, publish_job
from tests.jobs.helpers import MODEL, job_status, shards_of, write_prompts


def test_celery_finds_the_app_for_the_broker_in_force(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_BROKER_URL", "redis://127.0.0.1:6379/13")
    monkeypatch.setenv("BATCHGEN_QUEUE", "fleet-q")
    monkeypatch.setenv("BATCHGEN_DATA_DIR", str(tmp_path))
    app = find_app("jobs.celery_app")  # what `celery -A jobs.celery_app ...` does
    assert isinstance(app, Celery) and app is celery_app.app is celery_app.celery
    assert app.conf.broker_url == "redis://127.0.0.1:6379/13" and app.conf.task_default_queue == "fleet-q"
    assert TASK_NAME not in app.tasks  # the tools send and inspect it by name; a worker registers it
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        celery_app.nope  # noqa: B018


def test_a_workers_app_runs_the_shard_task_and_a_publishers_needs_none(tmp_path):
    settings = resolve_broker(str(tmp_path), queue="register-q", embedded=True)  # its own cached app
    app = make_app(settings)
    assert TASK_NAME not in app.tasks
    register_shard_task(app)
    register_shard_task(app)  # a second registration changes nothing
    task = app.tasks[TASK_NAME]
    assert task.acks_late and task.reject_on_worker_lost and task.ignore_result and task.max_retries is None


def test_embedded_app_warns_that_celery_tools_see_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("BATCHGEN_BROKER_URL", raising=False)
    monkeypatch.setenv("BATCHGEN_DATA_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="jobs.celery_app"):
        app = importlib.import_module("jobs.celery_app").app
    assert app.conf.broker_url.startswith("batchgen+sqlite://")
    assert "BATCHGEN_BROKER_URL is unset" in caplog.text and "Flower" in caplog.text


@pytest.mark.parametrize("url, fleet", [("redis://h:6379/0", True), ("amqp://u:p@h:5672//", True),
                                        (None, False)])
def test_remote_control_events_and_heartbeats_only_where_the_broker_carries_them(tmp_path, url, fleet):
    settings = resolve_broker(tmp_path, url=url, embedded=url is None)
    conf = celery_config(settings)
    assert (conf["worker_enable_remote_control"], conf["worker_send_task_events"],
            conf["task_send_sent_event"]) == (fleet, fleet, fleet)
    assert worker_options(settings) == {"without_gossip": True, "without_mingle": not fleet,
                                        "without_heartbeat": not fleet}


@pytest.mark.parametrize("job_id", ["job-20260101-000000-abc123", "a.b.shard9", "x"])
def test_shard_task_ids_name_their_job_and_shard(job_id):
    ids = {shard_task_id(job_id, 12) for _ in range(3)}
    assert len(ids) == 3, "unique per publication"
    assert {parse_shard_task_id(i) for i in ids} == {(job_id, 12)}


@pytest.mark.parametrize("task_id", ["d6c1a6a0-6f1c-4a7b-9b40-5f3c0e0f0a11", "job.shardX.abc", ".shard1.abc",
                                     "job.shard.abc", "", "job.s1.abc"])
def test_other_task_ids_are_not_shard_tasks(task_id):
    assert parse_shard_task_id(task_id) is None


@pytest.fixture
def job(tmp_path):
    data_dir = tmp_path / "data"
    src = tmp_path / "in.parquet"
    write_prompts(src, 4)
    req = JobRequest(str(src), str(data_dir), {"model": MODEL}, {"max_tokens": 4}, 2)
    broker = resolve_broker(data_dir, embedded=True)
    manifest = prepare_job(req, broker)
    publish_job(manifest, broker)  # to the embedded broker: recorded in the store, no worker takes it
    return manifest


def test_a_revoked_shard_task_cancels_its_job_once(job):
    revoked: list[str] = []
    watcher = RevokeWatcher(job.data_dir, lambda: revoked)
    assert watcher.check() == []
    task_id = shard_task_id(job.job_id, 1)
    revoked.append(task_id)
    assert watcher.check() == [job.job_id]
    assert JobPaths.of(job.data_dir, job.job_id).cancel_marker.exists()
    assert job_status(job.data_dir, job.job_id) == "cancelled"
    assert {s["status"] for s in shards_of(job.data_dir, job.job_id).values()} == {"cancelled"}
    assert watcher.check() == [], "an id is acted on once"
    revoked.append(shard_task_id(job.job_id, 0))
    assert watcher.check() == [], "a job is cancelled once"


def test_revoking_a_finished_shard_or_a_foreign_task_changes_nothing(job):
    attempt = Store(job.data_dir).begin_attempt(job.job_id, 0, 1, "w1", num_requests=2)
    attempt.add_outputs([{"request_id": str(i), "output_text": "x", "finish_reason": "stop",
                          "prompt_tokens": 1, "output_tokens": 1, "error": None} for i in range(2)])
    attempt.commit()
    revoked = [shard_task_id(job.job_id, 0), "b7e2c0de-0000-4000-8000-000000000000",
               shard_task_id("no-such-job", 0), shard_task_id("../escape", 0)]
    assert RevokeWatcher(job.data_dir, lambda: revoked).check() == []
    assert not JobPaths.of(job.data_dir, job.job_id).cancel_marker.exists()


def test_a_set_changing_while_copied_is_read_next_time(job):
    calls = []

    def revoked():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Set changed size during iteration")
        return [shard_task_id(job.job_id, 1)]

    watcher = RevokeWatcher(job.data_dir, revoked)
    assert watcher.check() == []
    assert watcher.check() == [job.job_id]
