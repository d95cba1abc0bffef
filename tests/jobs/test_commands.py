"""The job commands: exit codes and messages for bad input, `batchgen run` end to end, cancel, status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from engine import LLM, SamplingParams
from jobs.cli import cli
from jobs.manifest import JobPaths, load_manifest, write_manifest
from tests.jobs.helpers import LEASE_TTL_S, MODEL, job_status, one_torch_thread, prompts, shards_of


def _invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def _write(path, **columns) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


@pytest.mark.parametrize("columns, message", [
    ({"text": ["a"]}, "needs a 'prompt' (string) or 'messages'"),
    ({"prompt": [1]}, "column 'prompt' must be a string"),
    ({"prompt": ["a", "b"], "id": ["x", "x"]}, "duplicate id 'x'"),
])
@pytest.mark.parametrize("command", ["submit", "run"])
def test_bad_input_is_a_usage_error(tmp_path, command, columns, message):
    src = _write(tmp_path / "bad.parquet", **columns)
    result = _invoke(command, src, "--model", MODEL, "--data-dir", str(tmp_path / "data"))
    assert result.exit_code == 2, result.output
    assert message in result.output and "bad.parquet" in result.output


@pytest.mark.parametrize("args, message", [
    (["--shard-size", "0"], "--shard-size must be >= 1"),
    (["--temperature", "-1"], "temperature must be a finite number in [0, inf)"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
    (["--broker", "bogus://x"], "use redis://... or amqp://..."),
])
def test_bad_flags_are_usage_errors(tmp_path, args, message):
    src = _write(tmp_path / "ok.parquet", prompt=["a"])
    result = _invoke("submit", src, "--model", MODEL, "--data-dir", str(tmp_path / "data"), *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_bad_engine_flags_are_usage_errors(tmp_path):
    src = _write(tmp_path / "ok.parquet", prompt=["a"])
    data = str(tmp_path / "data")
    result = _invoke("run", src, "--model", MODEL, "--data-dir", data, "--max-num-seqs", "0")
    assert result.exit_code == 2, result.output
    assert "max_num_seqs must be an integer in [1, 65536]" in result.output


def test_submit_refuses_engine_settings_they_belong_to_the_worker(tmp_path):
    data = tmp_path / "data"
    src = _write(tmp_path / "ok.parquet", prompt=["a"])
    result = _invoke("submit", src, "--model", MODEL, "--data-dir", str(data), "--max-num-seqs", "2",
                     "--dtype", "bfloat16", "--kv-cache-memory", "1")
    assert result.exit_code == 2, result.output
    assert "--max-num-seqs, --kv-cache-memory, --dtype: engine settings belong to `batchgen worker`" \
        in " ".join(result.output.split()), result.output
    assert not (data / "jobs").exists() or not any((data / "jobs").iterdir()), "nothing was queued"


def test_worker_job_takes_the_recorded_engine_config(tmp_path, monkeypatch):
    import jobs.worker_main

    data = tmp_path / "data"
    src = _write(tmp_path / "ok.parquet", prompt=["a"])
    sub = _invoke("submit", src, "--model", MODEL, "--data-dir", str(data), "--queue", "q.w")
    job_id = sub.output.strip().splitlines()[-1]
    manifest = load_manifest(data, job_id)
    assert manifest.engine == {"model": MODEL}, "a submitted job records its model only, never engine limits"
    # a job `run` started records the whole config its workers take
    write_manifest(replace(manifest, engine={"model": MODEL, "max_num_seqs": 3, "dtype": "float32"}),
                   JobPaths.of(data, job_id))
    seen = []
    monkeypatch.setattr(jobs.worker_main, "run_worker", lambda config, *a: seen.append(config) or 0)
    result = _invoke("worker", "--job", job_id, "--data-dir", str(data), "--queue", "q.w",
                     "--max-num-batched-tokens", "64")
    assert result.exit_code == 0, result.output
    assert (seen[0].model, seen[0].max_num_seqs, seen[0].max_num_batched_tokens) == (MODEL, 3, 64)
    missing = _invoke("worker", "--job", "job-nope", "--data-dir", str(data))
    assert missing.exit_code == 2 and "no job 'job-nope'" in missing.output, missing.output


def test_unreadable_or_missing_input(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"nope")
    missing = tmp_path / "missing.parquet"
    for src, message in ((junk, "not a readable Parquet file"), (missing, "does not exist")):
        result = _invoke("submit", str(src), "--data-dir", str(tmp_path / "data"))
        assert result.exit_code == 2 and message in result.output, result.output


def test_unknown_job_is_a_usage_error(tmp_path):
    data = tmp_path / "data"
    src = _write(tmp_path / "ok.parquet", prompt=["a"])
    assert _invoke("submit", src, "--data-dir", str(data), "--queue", "q.unknown").exit_code == 0
    for cmd in ("status", "cancel", "retry"):
        result = _invoke(cmd, "job-nope", "--data-dir", str(data))
        assert result.exit_code == 2 and "no job 'job-nope'" in result.output, (cmd, result.output)


def test_cancel_a_queued_job_and_status(tmp_path):
    data = tmp_path / "data"
    src = _write(tmp_path / "ok.parquet", prompt=["a", "b", "c"])
    sub = _invoke("submit", src, "--model", MODEL, "--data-dir", str(data), "--shard-size", "2",
                  "--queue", "q.c")
    assert sub.exit_code == 0, sub.output
    job_id = sub.output.strip().splitlines()[-1]
    listing = json.loads(_invoke("status", "--data-dir", str(data), "--format", "json").output)
    summary = [(j["job_id"], j["status"], j["request_counts"]["total"]) for j in listing]
    assert summary == [(job_id, "queued", 3)]
    result = _invoke("cancel", job_id, "--data-dir", str(data))
    assert result.exit_code == 0, result.output
    assert job_status(data, job_id) == "cancelled"
    assert {s["status"] for s in shards_of(data, job_id).values()} == {"cancelled"}
    shown = _invoke("status", job_id, "--data-dir", str(data))
    assert shown.exit_code == 0 and f"job {job_id}: cancelled" in shown.output
    again = _invoke("retry", job_id, "--data-dir", str(data))
    assert again.exit_code == 2 and "was cancelled" in again.output


@pytest.mark.slow
def test_run_end_to_end_writes_every_row_once_in_input_order(tmp_path):
    texts = prompts(7)
    max_tokens = [None, 0, None, None, 5, None, None]  # row 1 cannot run (max_tokens < 1)
    texts[3] = ""  # empty prompt: an error row
    texts[5] = "x" * 80  # longer than --max-model-len 64: an error row from the engine
    src = _write(tmp_path / "in.parquet", prompt=texts, id=[f"r{i}" for i in range(7)], max_tokens=max_tokens,
                 note=[f"n{i}" for i in range(7)])
    out = tmp_path / "out.parquet"
    env = dict(os.environ, BATCHGEN_LEASE_TTL_S=LEASE_TTL_S, OMP_NUM_THREADS="1")
    env.pop("BATCHGEN_BROKER_URL", None)
    cmd = [sys.executable, "-m", "jobs.cli", "run", src, "--model", MODEL,
           "--data-dir", str(tmp_path / "data"), "--max-model-len", "64", "--max-tokens", "12",
           "--temperature", "0", "--shard-size", "3", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rows: 4 ok, 3 error, 0 cancelled" in proc.stdout and f"output: {out}" in proc.stdout
    assert "row" in proc.stderr and "tok/s" in proc.stderr, "progress bar on stderr"
    table = pq.read_table(out).to_pylist()
    assert [r["request_id"] for r in table] == [f"r{i}" for i in range(7)]
    assert [r["note"] for r in table] == [f"n{i}" for i in range(7)]
    assert [r["finish_reason"] == "error" for r in table] == [False, True, False, True, False, True, False]
    assert "max_tokens must be an integer >= 1" in table[1]["error"] and table[3]["error"] == "empty prompt"
    assert "max_model_len is 64" in table[5]["error"]
    ok = [0, 2, 4, 6]
    with one_torch_thread():  # --apply-chat-template auto: the model has a template, a prompt is a user turn
        params = [SamplingParams(max_tokens=5 if i == 4 else 12, temperature=0.0) for i in ok]
        ref = LLM(MODEL, max_model_len=64).chat([[{"role": "user", "content": texts[i]}] for i in ok], params)
    assert [table[i]["output_text"] for i in ok] == [o.text for o in ref]
    # the finished job was compacted: one file per kind instead of a part per flush
    compacted = list((tmp_path / "data" / "store" / "tables").glob("outputs/compacted/*/*.parquet"))
    assert len(compacted) == 1


def test_status_counts_shards_by_state_and_lists_only_running_and_failed(tmp_path):
    from jobs.store.parts import Store
    from jobs.store.schemas import ShardEvent

    data = tmp_path / "data"
    src = _write(tmp_path / "ok.parquet", prompt=[f"p{i}" for i in range(5)])
    sub = _invoke("submit", src, "--model", MODEL, "--data-dir", str(data), "--shard-size", "1",
                  "--queue", "q.s")
    job_id = sub.output.strip().splitlines()[-1]
    shown = _invoke("status", job_id, "--data-dir", str(data), "--no-requeue")
    assert "shards: 5 total, 0 completed, 0 running, 5 queued, 0 failed, 0 cancelled" in shown.output
    assert "(none running or failed; --shards lists all)" in shown.output and "SHARD" not in shown.output
    Store(str(data)).record_shard_events([ShardEvent(job_id, 3, "failed", 1.0, attempt=1, error="boom")])
    shown = _invoke("status", job_id, "--data-dir", str(data), "--no-requeue")
    table = _shard_lines(shown.output)
    assert len(table) == 1 and table[0].split()[:2] == ["3", "failed"] and "boom" in table[0], shown.output
    assert "(running and failed shards only; --shards lists all)" in shown.output
    everything = _invoke("status", job_id, "--data-dir", str(data), "--no-requeue", "--shards")
    assert [line.split()[0] for line in _shard_lines(everything.output)] == ["0", "1", "2", "3", "4"]
    info = json.loads(_invoke("status", job_id, "--data-dir", str(data), "--format", "json").output)
    assert info["shard_counts"] == {"completed": 0, "running": 0, "queued": 4, "failed": 1, "cancelled": 0,
                                    "total": 5}
    assert [s["shard_id"] for s in info["shards"]] == [3]


def test_status_of_running_and_failed_shards_matches_the_full_list(tmp_path):
    """Without --shards only the listed shards and the counts come out of DuckDB: the same as the full
    list narrowed, with every state present."""
    from jobs.manifest import load_manifest
    from jobs.status import job_status
    from jobs.store.parts import Store
    from jobs.store.schemas import ShardEvent

    data = tmp_path / "data"
    src = _write(tmp_path / "ok.parquet", prompt=[f"p{i}" for i in range(9)])
    sub = _invoke("submit", src, "--model", MODEL, "--data-dir", str(data), "--shard-size", "1",
                  "--queue", "q.l")
    job_id = sub.output.strip().splitlines()[-1]
    store = Store(str(data))
    for shard in (1, 4, 6):
        store.begin_attempt(job_id, shard, 1, "w1", num_requests=1)  # running
    store.begin_attempt(job_id, 2, 1, "w2").commit()
    store.begin_attempt(job_id, 7, 1, "w2").commit()
    store.record_shard_events([ShardEvent(job_id, 3, "failed", 1.0, attempt=1, error="boom"),
                               ShardEvent(job_id, 8, "failed", 2.0, attempt=1, error="bang")])
    m = load_manifest(str(data), job_id)
    full, listed = job_status(m, all_shards=True), job_status(m, all_shards=False)
    assert listed["shard_counts"] == full["shard_counts"] == {
        "completed": 2, "running": 3, "queued": 2, "failed": 2, "cancelled": 0, "total": 9}
    assert [s["shard_id"] for s in listed["shards"]] == [1, 3, 4, 6, 8]
    assert listed["shards"] == [s for s in full["shards"] if s["status"] in ("running", "failed")]
    assert len(full["shards"]) == 9 and set(listed) == set(full)


def _shard_lines(output: str) -> list[str]:
    """The rows of the shard table `status JOB` prints."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("SHARD"))
    return [line for line in lines[start + 1:] if line.strip() and not line.startswith("(")]


@pytest.mark.slow
def test_run_whose_engine_cannot_start_fails_with_exit_1(tmp_path):
    """Bad model files are refused at submission (tests/jobs/test_model_checks.py), a device this host
    does not have before anything starts (tests/jobs/test_placement.py); an engine that still cannot
    start (here: a KV cache budget too small for one block) fails the run with exit 1."""
    src = _write(tmp_path / "in.parquet", prompt=["a"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "jobs.cli", "run", src, "--model", "tiny-random", "--kv-cache-memory",
           "0.0000001", "--data-dir", str(tmp_path / "data"), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "worker 0 exited with code 1" in proc.stderr and "cannot start its engine" in proc.stderr


@pytest.mark.slow
def test_run_with_json_logs_writes_only_json_to_stderr_and_its_workers_too(tmp_path):
    src = _write(tmp_path / "in.parquet", prompt=prompts(4))
    env = dict(os.environ, BATCHGEN_LEASE_TTL_S=LEASE_TTL_S, OMP_NUM_THREADS="1")
    env.pop("BATCHGEN_BROKER_URL", None)
    cmd = [sys.executable, "-m", "jobs.cli", "run", src, "--model", MODEL, "--data-dir",
           str(tmp_path / "data"), "--max-tokens", "4", "--shard-size", "2", "--job-id", "json-job",
           "--log-format", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entries = [json.loads(line) for line in proc.stderr.splitlines() if line.strip()]  # no progress bar
    final = [e for e in entries if e["logger"] == "jobs.local_run"][-1]
    assert (final["job_id"], final["rows_done"], final["num_requests"], final["shards_committed"]) == \
        ("json-job", 4, 4, 2)
    assert "rows: 4 ok" in proc.stdout, "the summary is the command's output, not a log"
    worker_log = tmp_path / "data" / "jobs" / "json-job" / "logs" / "worker-0.log"
    lines = [line for line in worker_log.read_text().splitlines() if line.strip()]
    assert lines and all(json.loads(line)["pid"] for line in lines)
