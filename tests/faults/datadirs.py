"""Data dirs holding real jobs, made the way `batchgen run` makes them, for the data-integrity tests
(issue 35): the job is created exactly as `batchgen run ARGS` would create it (so that command, run
again, resumes it), and the shards asked for are run by an in-process worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.cli_options import engine_config
from jobs.broker import resolve_broker
from jobs.commands import _job_request
from jobs.commands import run as run_command
from jobs.manifest import JobManifest, new_job_id
from jobs.shard_runner import ShardTask, process_shard
from jobs.shards.resume import run_fingerprint
from jobs.submit import prepare_job, publish_job
from tests.jobs.helpers import LEASE_TTL_S, MODEL

RUN_FLAGS = ("--model", MODEL, "--max-tokens", "4", "--temperature", "0", "--apply-chat-template", "never",
             "--shard-size", "2", "--max-num-seqs", "8", "--no-progress")


def write_input(path: Path, rows: int) -> Path:
    pq.write_table(pa.table({"prompt": [f"row {i} of {path.stem}" for i in range(rows)],
                             "id": [f"r{i}" for i in range(rows)]}), path)
    return path


def run_args(src: Path, data_dir: Path, *extra: str) -> list[str]:
    """The `batchgen run` command line of a job over `src` in `data_dir`."""
    return ["run", str(src), *RUN_FLAGS, "--data-dir", str(data_dir), *extra]


def run_job(runtime, src: Path, data_dir: Path, shards: Iterable[int] | None = None) -> JobManifest:
    """The job `batchgen run <run_args(src, data_dir)>` creates, with `shards` (default: all of them)
    run and committed by `runtime`, the others queued."""
    ctx = run_command.make_context("run", run_args(src, data_dir)[1:])
    with ctx:
        opts = dict(ctx.params)
        prompts, output = opts.pop("prompts"), opts.pop("output")
        for name in ("data_dir", "workers", "concurrency", "progress"):
            opts.pop(name)
        config = engine_config(opts)
        request = _job_request(prompts, str(data_dir.resolve()), config, opts, output, local=True)
    request.fingerprint = run_fingerprint(request)
    request.job_id = new_job_id(time.time())
    broker = resolve_broker(data_dir, queue=f"run.{request.job_id}", embedded=True)
    manifest = prepare_job(request, broker)
    publish_job(manifest, broker)
    todo = range(len(manifest.shards)) if shards is None else shards
    outcomes = [process_shard(ShardTask(manifest.job_id, s, manifest.data_dir), runtime) for s in todo]
    assert [o.result for o in outcomes] == ["committed"] * len(outcomes), outcomes
    return manifest


def cli_env() -> dict:
    """Dead workers noticed within seconds; compacted files count at once (as the tests set in-process)."""
    env = dict(os.environ, BATCHGEN_LEASE_TTL_S=LEASE_TTL_S, OMP_NUM_THREADS="1",
               BATCHGEN_STORE_ACTIVATION_DELAY_S="0")
    env.pop("BATCHGEN_BROKER_URL", None)
    return env


def batchgen(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`batchgen ARGS` as a user runs it (a subprocess through the real entry point)."""
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True,
                          env=cli_env(), timeout=timeout)
