"""Shared pieces of the jobs tests: prompt files, submission, view queries, worker subprocesses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.broker import BrokerSettings, resolve_broker
from jobs.manifest import JobManifest
from jobs.store.catalog import connect
from jobs.submit import JobRequest, prepare_job, publish_job

MODEL = "tiny-random"
LEASE_TTL_S = "3"  # worker subprocesses: dead workers are noticed within seconds
REDIS_ENV, AMQP_ENV = "BATCHGEN_TEST_REDIS_URL", "BATCHGEN_TEST_AMQP_URL"
DEFAULT_REDIS, DEFAULT_AMQP = "redis://127.0.0.1:6379/15", "amqp://guest:guest@127.0.0.1:5672//"


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """In-process engines use one thread: on a shared 2-core machine two threads thrash (30x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def worker_runtime(data_dir: Path, worker_id: str, **config) -> Iterator:
    """An in-process WorkerRuntime over the tiny model on one torch thread, stopped at the end."""
    from engine import EngineConfig
    from jobs.worker_runtime import WorkerRuntime

    with one_torch_thread():
        runtime = WorkerRuntime(EngineConfig(model=MODEL, **config), worker_id, data_dir).start()
        try:
            yield runtime
        finally:
            runtime.stop()


def prompts(n: int, offset: int = 0) -> list[str]:
    """Distinct prompts of varied length (byte tokenizer: a character is a token)."""
    return [f"prompt {offset + i}: " + "abcdefgh"[: (i * 3) % 8 + 1] * ((i % 4) + 1) for i in range(n)]


def write_prompts(path: Path, n: int, **extra) -> list[str]:
    texts = prompts(n)
    pq.write_table(pa.table({"prompt": texts, "row_tag": [f"tag{i}" for i in range(n)], **extra}), path)
    return texts


def unique_queue(name: str) -> str:
    return f"test.{name}.{uuid.uuid4().hex[:10]}"


def submit(data_dir: Path, source: Path, broker: BrokerSettings, *, shard_size: int, max_tokens: int,
           max_retries: int = 3, retry_backoff_s: float = 0.2, engine: dict | None = None,
           apply_chat_template: str = "never") -> JobManifest:
    """Submit and publish a job; prompts go in raw by default, so outputs match `LLM.generate`."""
    req = JobRequest(str(source), str(data_dir), engine or {"model": MODEL},
                     {"max_tokens": max_tokens, "temperature": 0.0}, shard_size, max_retries=max_retries,
                     retry_backoff_s=retry_backoff_s, apply_chat_template=apply_chat_template)
    manifest = prepare_job(req, broker)
    publish_job(manifest, broker)
    return manifest


def query(data_dir: Path | str, sql: str, params: list | None = None) -> list[dict]:
    con = connect(data_dir)
    try:
        cur = con.execute(sql, params or [])
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    finally:
        con.close()


def job_status(data_dir: Path, job_id: str) -> str:
    return query(data_dir, "SELECT status FROM jobs WHERE job_id = ?", [job_id])[0]["status"]


def shards_of(data_dir: Path, job_id: str) -> dict[int, dict]:
    return {s["shard_id"]: s for s in query(data_dir, "SELECT * FROM shards WHERE job_id = ?", [job_id])}


def outputs_of(data_dir: Path, job_id: str) -> list[dict]:
    """The job's output rows in request id (= row number) order."""
    sql = "SELECT * FROM outputs WHERE job_id = ? ORDER BY CAST(request_id AS INT)"
    return query(data_dir, sql, [job_id])


def wait_for(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.25,
             on_timeout: Callable[[], str] = lambda: ""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{on_timeout()}")


def reachable_broker(kind: str) -> str:
    """The test broker URL of `kind`; skip (or, with $CI set, fail) when it cannot be reached."""
    env, default = (REDIS_ENV, DEFAULT_REDIS) if kind == "redis" else (AMQP_ENV, DEFAULT_AMQP)
    url = os.environ.get(env, default)
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1, timeout=3)
    except Exception as exc:  # noqa: BLE001 - any failure means unreachable
        why = f"{kind} broker {url} unreachable ({exc}); set {env}"
        if os.environ.get("CI"):
            pytest.fail(why + " (CI is set: broker tests must run)")
        pytest.skip(why)
    return url


def delete_queue(settings: BrokerSettings) -> None:
    """Drop a test queue from a server broker (tests never see each other's messages anyway)."""
    if settings.kind == "embedded":
        return
    from kombu import Connection, Exchange, Queue

    with contextlib.suppress(Exception), Connection(settings.url, connect_timeout=3) as conn:
        exchange = Exchange(settings.queue, channel=conn.default_channel)
        Queue(settings.queue, exchange, settings.queue, channel=conn.default_channel).delete()
        exchange.delete()


def broker_for(kind: str, data_dir: Path, queue: str) -> BrokerSettings:
    url = None if kind == "embedded" else reachable_broker(kind)
    return resolve_broker(data_dir, queue=queue, url=url, embedded=kind == "embedded")


class Worker:
    """A `batchgen worker` subprocess (killed, whatever happens, when the test ends)."""

    def __init__(self, data_dir: Path, settings: BrokerSettings, name: str, log_dir: Path,
                 *args: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        broker = "embedded" if settings.kind == "embedded" else settings.url
        cmd = [sys.executable, "-m", "jobs.cli", "worker", "--model", MODEL, "--data-dir", str(data_dir),
               "--broker", broker, "--queue", settings.queue, "--worker-id", f"{name}@testhost",
               "--loglevel", "INFO", *args]
        env = dict(os.environ, BATCHGEN_LEASE_TTL_S=LEASE_TTL_S, OMP_NUM_THREADS="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def worker_id(self) -> str:
        return f"{self.name}@testhost"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0) -> None:
        wait_for(lambda: " ready." in self.log() or self.proc.poll() is not None, timeout,
                 f"worker {self.name} to start", on_timeout=self.log)
        assert self.proc.poll() is None, f"worker {self.name} exited:\n{self.log()}"

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def workers(data_dir: Path, settings: BrokerSettings, log_dir: Path, names: list[str],
            *args: str) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    try:
        for name in names:
            started.append(Worker(data_dir, settings, name, log_dir, *args))
        yield started
    finally:
        for w in started:
            w.stop()


def logs(ws: list[Worker]) -> str:
    return "\n".join(f"----- {w.name} -----\n{w.log()[-6000:]}" for w in ws)
