"""Real Celery workers (`batchgen worker` subprocesses) over real brokers: the embedded one, Redis and
RabbitMQ. No eager mode. Each test uses its own data dir and queue, and kills its workers at the end."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine import LLM, SamplingParams
from jobs.cli import cli
from jobs.manifest import JobPaths
from jobs.shards.leases import ShardLeases
from jobs.shards.supervise import every_shard_progress, job_progress
from jobs.submit import JobRequest, prepare_job, publish_job
from tests.jobs.helpers import (
    MODEL,
    Worker,
    broker_for,
    delete_queue,
    job_status,
    logs,
    one_torch_thread,
    outputs_of,
    prompts,
    query,
    shards_of,
    submit,
    unique_queue,
    wait_for,
    workers,
    write_prompts,
)

pytestmark = pytest.mark.slow

# Long enough that a shard outlasts a broker fetch (tiny-random steps take about a millisecond): the
# boundary check below is about the engine, not about a 30 ms shard racing a 100 ms poll.
MAX_TOKENS = 300
NUM_ROWS = 10


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """The same prompts through LLM.generate, greedy: what every job must produce."""
    with one_torch_thread():
        outs = LLM(MODEL).generate(prompts(NUM_ROWS), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [o.text for o in outs]


def _assert_each_row_once(data_dir: Path, job_id: str, n: int) -> list[dict]:
    rows = outputs_of(data_dir, job_id)
    assert [r["request_id"] for r in rows] == [str(i) for i in range(n)], "every input row exactly once"
    return rows


def _assert_no_drain_between_shards(data_dir: Path, job_id: str, worker_id: str) -> None:
    """When a shard's last request finished and more shards were queued, the engine still had running
    requests (the next shard's): num_running > 0 in the very next iteration, with no idle gap."""
    reqs = query(data_dir, "SELECT shard_id, min(arrival_ts) AS t0, max(finished_ts) AS t1 FROM requests "
                 "WHERE job_id = ? AND worker_id = ? GROUP BY shard_id ORDER BY t1", [job_id, worker_id])
    its = query(data_dir, "SELECT ts, num_running FROM iterations WHERE worker_id = ? ORDER BY ts",
                [worker_id])
    assert len(reqs) >= 3 and its, (reqs, len(its))
    # the shards that finished in the worker's last step (several can end together) had nothing behind
    # them; an iteration's ts is taken before the requests it finishes are stamped
    checked = [r for r in reqs if r["t1"] < its[-1]["ts"]]
    assert checked, (reqs, its[-3:])
    for shard in checked:
        t = shard["t1"]
        # another shard was in the engine at this one's end (it may end in that same step: two shards
        # can finish together, and then the gap check below is what holds)
        others = [o["shard_id"] for o in reqs if o is not shard and o["t0"] < t <= o["t1"]]
        assert others, f"shard {shard['shard_id']} drained alone: no other shard in the engine then: {reqs}"
        nxt = next(i for i in its if i["ts"] >= t)
        assert nxt["num_running"] > 0 and nxt["ts"] - t < 1.0, (shard, nxt)


@pytest.mark.parametrize("kind", ["embedded", "redis", "amqp"])
def test_job_over_broker_matches_llm_generate(kind, tmp_path, reference):
    data_dir = tmp_path / "data"
    src = tmp_path / "in.parquet"
    write_prompts(src, NUM_ROWS)
    settings = broker_for(kind, data_dir, unique_queue(kind))
    try:
        # --concurrency 3, what `batchgen run` picks for 4 sequences in shards of 3 (ceil(4/3) + 1): at
        # any shard's end two more are held, so the check below does not hang on how fast the broker
        # hands out the next message (with 2, one busy step loop holding the GIL could starve the
        # consumer thread past the other shard's last tokens on a loaded 2-core machine)
        with workers(data_dir, settings, tmp_path, ["w1"], "--max-num-seqs", "4", "--concurrency", "3") as ws:
            m = submit(data_dir, src, settings, shard_size=3, max_tokens=MAX_TOKENS)
            wait_for(lambda: job_progress(m).finished, 180, f"job over {kind}", on_timeout=lambda: logs(ws))
            assert ws[0].stop() == 0, logs(ws)
        rows = _assert_each_row_once(data_dir, m.job_id, NUM_ROWS)
        assert [r["output_text"] for r in rows] == reference
        assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
        assert [r["row_tag"] for r in rows] == [f"tag{i}" for i in range(NUM_ROWS)]
        shards = shards_of(data_dir, m.job_id)
        assert [(s["status"], s["attempts"], s["worker_id"]) for s in shards.values()] == \
            [("completed", 1, "w1@testhost")] * 4
        assert job_status(data_dir, m.job_id) == "completed"
        _assert_no_drain_between_shards(data_dir, m.job_id, "w1@testhost")
    finally:
        delete_queue(settings)


def test_worker_killed_mid_shard_is_replaced_and_nothing_is_lost(tmp_path):
    data_dir = tmp_path / "data"
    rows = 16  # 8 shards of 1500 tokens a row: the native kernels make each shard quick, so the job
    # needs enough of them to still be in the middle when w1 is killed
    src = tmp_path / "in.parquet"
    write_prompts(src, rows)
    settings = broker_for("embedded", data_dir, unique_queue("kill"))
    with workers(data_dir, settings, tmp_path, ["w1"], "--max-num-seqs", "2", "--concurrency", "2") as ws:
        ws[0].wait_ready()
        m = submit(data_dir, src, settings, shard_size=2, max_tokens=1500)
        leases = ShardLeases(JobPaths.of(data_dir, m.job_id).leases)

        def running_on_w1() -> list[int]:
            states = {s: leases.view(s, a[-1]).state for s, a in leases.claimed_attempts().items()}
            # running on w1, with a heartbeat since the claim: the shard is in w1's engine
            return [s for s, st in states.items() if st and st.state == "running"
                    and st.worker_id == "w1@testhost" and st.heartbeat_ts > st.started_ts]

        held = wait_for(running_on_w1, 90, "w1 to be running a shard", poll=0.05, on_timeout=lambda: logs(ws))
        held = running_on_w1() or held
        ws[0].kill9()
        assert job_progress(m).rows_done < m.num_requests, "killed in the middle of the job"
        ws.append(Worker(data_dir, settings, "w2", tmp_path, "--max-num-seqs", "2", "--concurrency", "2"))
        wait_for(lambda: job_progress(m).finished, 180, "the job on w2", on_timeout=lambda: logs(ws))
    _assert_each_row_once(data_dir, m.job_id, rows)
    shards = shards_of(data_dir, m.job_id)
    assert all(s["status"] == "completed" for s in shards.values())
    for shard_id in held:
        shard = shards[shard_id]
        assert (shard["attempts"], shard["worker_id"]) == (2, "w2@testhost"), shard
    assert query(data_dir, "SELECT count(*) AS n FROM requests WHERE job_id = ?", [m.job_id])[0]["n"] == rows


def test_two_workers_share_a_job_and_a_corrupt_shard_fails_until_retried(tmp_path):
    data_dir = tmp_path / "data"
    src = tmp_path / "in.parquet"
    write_prompts(src, 12)
    settings = broker_for("embedded", data_dir, unique_queue("two"))
    runner = CliRunner()
    sampling = {"max_tokens": 300, "temperature": 0.0}
    with workers(data_dir, settings, tmp_path, ["w1", "w2"], "--max-num-seqs", "2") as ws:
        for w in ws:
            w.wait_ready()
        req = JobRequest(str(src), str(data_dir), {"model": MODEL}, sampling, 2, max_retries=1,
                         retry_backoff_s=0.2)
        m = prepare_job(req, settings)
        shard_file = Path(m.shard(3).path)
        good = shard_file.read_bytes()
        shard_file.write_bytes(b"PAR1 corrupted on purpose")
        publish_job(m, settings)
        wait_for(lambda: job_progress(m).finished, 180, "all shards to end", on_timeout=lambda: logs(ws))
        shards = shards_of(data_dir, m.job_id)
        assert shards[3]["status"] == "failed" and shards[3]["attempts"] == 2
        assert "unreadable" in shards[3]["error"] and "gave up after 2 tries" in shards[3]["error"]
        done = [s for i, s in shards.items() if i != 3]
        assert all(s["status"] == "completed" for s in done)
        assert {s["worker_id"] for s in done} == {"w1@testhost", "w2@testhost"}, "both workers took shards"
        assert job_status(data_dir, m.job_id) == "failed"

        status = runner.invoke(cli, ["status", m.job_id, "--data-dir", str(data_dir)])
        assert status.exit_code == 0, status.output
        assert "failed" in status.output and "unreadable" in status.output

        shard_file.write_bytes(good)
        retried = runner.invoke(cli, ["retry", m.job_id, "--data-dir", str(data_dir)])
        assert retried.exit_code == 0 and "re-queued failed shard(s) 3" in retried.output, retried.output
        wait_for(lambda: job_status(data_dir, m.job_id) == "completed", 120, "the retried shard",
                 on_timeout=lambda: logs(ws))
    _assert_each_row_once(data_dir, m.job_id, 12)
    again = runner.invoke(cli, ["retry", m.job_id, "--data-dir", str(data_dir)])
    assert again.exit_code == 0 and "no failed or stuck shards" in again.output


def test_sigterm_finishes_the_shards_in_flight_and_hands_back_the_rest(tmp_path):
    data_dir = tmp_path / "data"
    src = tmp_path / "in.parquet"
    write_prompts(src, 8)
    settings = broker_for("embedded", data_dir, unique_queue("term"))
    with workers(data_dir, settings, tmp_path, ["w1"], "--max-num-seqs", "2", "--concurrency", "2") as ws:
        ws[0].wait_ready()
        m = submit(data_dir, src, settings, shard_size=2, max_tokens=600)
        wait_for(lambda: job_progress(m).count("running") == 2, 60, "two shards in w1's engine",
                 poll=0.05, on_timeout=lambda: logs(ws))
        signalled = time.time()
        assert ws[0].stop(timeout=120) == 0, logs(ws)
        assert "Warm shutdown" in ws[0].log()
        progress, shards = job_progress(m), every_shard_progress(m)
        started = [s for s in shards if s.state != "queued"]
        assert len(started) >= 2 and all(s.state == "committed" for s in started), shards
        leases = ShardLeases(JobPaths.of(data_dir, m.job_id).leases)
        starts = [leases.latest(s.shard_id).state.started_ts for s in started]
        assert max(starts) < signalled, "no shard began after the signal"
        assert progress.count("queued") >= 1, "the rest stay queued (handed back or never delivered)"
        ws.append(Worker(data_dir, settings, "w2", tmp_path, "--max-num-seqs", "2"))
        wait_for(lambda: job_progress(m).finished, 180, "the rest on w2", on_timeout=lambda: logs(ws))
    _assert_each_row_once(data_dir, m.job_id, 8)
    assert {s["attempts"] for s in shards_of(data_dir, m.job_id).values()} == {1}
