"""A bad row costs only itself (issue 14, item 1): one NaN / inf / out-of-range sampling value among 20
rows is one error row with the reason, the 19 others are generated, no shard fails or retries; a row
that breaks an engine step is isolated the same way; over a real worker an innocent job that shares
the engine with the bad row spends no retries."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.broker import resolve_broker
from jobs.shard_runner import ShardTask, process_shard
from jobs.shards.supervise import job_progress
from jobs.submit import JobRequest, prepare_job, publish_job
from tests.jobs.helpers import (
    MODEL,
    broker_for,
    delete_queue,
    job_status,
    logs,
    outputs_of,
    shards_of,
    unique_queue,
    wait_for,
    worker_runtime,
    workers,
)

NUM_ROWS, BAD_ROW, SHARD_SIZE, MAX_TOKENS = 20, 7, 5, 4


def _input(path, column: str | None = None, value=None, prompt_of_bad: str | None = None):
    """20 rows; row BAD_ROW gets `column` = `value` (the others null: the job default) or its own prompt."""
    prompts = [f"row {i} says hi" for i in range(NUM_ROWS)]
    if prompt_of_bad is not None:
        prompts[BAD_ROW] = prompt_of_bad
    columns = {"prompt": prompts}
    if column is not None:
        kind = pa.int64() if isinstance(value, int) else pa.float64()
        columns[column] = pa.array([value if i == BAD_ROW else None for i in range(NUM_ROWS)], kind)
    pq.write_table(pa.table(columns), path)
    return path


def _job(data_dir, src, broker=None, max_retries=3):
    broker = broker or resolve_broker(data_dir, embedded=True)
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    req = JobRequest(str(src), str(data_dir), {"model": MODEL}, sampling, SHARD_SIZE, max_retries=max_retries,
                     retry_backoff_s=0.05, apply_chat_template="never")
    return prepare_job(req, broker)


def _assert_one_error_row(data_dir, job_id, reason: str) -> None:
    rows = outputs_of(data_dir, job_id)
    assert len(rows) == NUM_ROWS and [r["request_id"] for r in rows] == [str(i) for i in range(NUM_ROWS)]
    errors = [r for r in rows if r["finish_reason"] == "error"]
    assert [r["request_id"] for r in errors] == [str(BAD_ROW)] and reason in errors[0]["error"], errors
    good = [r for r in rows if r["finish_reason"] != "error"]
    assert len(good) == NUM_ROWS - 1 and all(r["output_tokens"] == MAX_TOKENS for r in good)
    shards = shards_of(data_dir, job_id)
    assert [(s["status"], s["attempts"]) for s in shards.values()] == [("completed", 1)] * 4


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("rows") / "data"
    with worker_runtime(data_dir, "w-rows", max_num_seqs=8) as rt:
        yield rt


@pytest.mark.parametrize(("column", "value", "reason"), [
    ("temperature", math.nan, "temperature must be a finite number"),
    ("top_p", math.inf, "top_p must be a finite number"),
    ("temperature", -0.5, "temperature must be a finite number in [0, inf), got -0.5"),
    ("top_k", -7, "top_k"),
])
def test_one_bad_sampling_value_is_one_error_row(runtime, tmp_path, column, value, reason):
    m = _job(runtime.data_dir, _input(tmp_path / "in.parquet", column, value))
    outcomes = [process_shard(ShardTask(m.job_id, s, m.data_dir), runtime) for s in range(4)]
    assert [o.result for o in outcomes] == ["committed"] * 4
    assert sum(o.rows for o in outcomes) == NUM_ROWS
    _assert_one_error_row(runtime.data_dir, m.job_id, reason)


def test_a_row_that_breaks_the_engine_step_fails_alone(runtime, tmp_path):
    """A row whose forward pass raises (a stand-in for a kernel fault) is isolated by the engine: the
    other rows of its shard, in the same running set, are generated and the shard commits at once."""
    poison = ord("~")  # the byte tokenizer: one character, one token id
    model = runtime.loop.engine.runner.model
    real = model.forward

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == poison).any()):
            raise RuntimeError("kernel refused token 126")
        return real(input_ids, *args, **kwargs)

    m = _job(runtime.data_dir, _input(tmp_path / "in.parquet", prompt_of_bad="row 7 ~ breaks kernels"))
    model.forward = forward
    try:
        outcomes = [process_shard(ShardTask(m.job_id, s, m.data_dir), runtime)
                    for s in range(4)]
    finally:
        model.forward = real
    assert [o.result for o in outcomes] == ["committed"] * 4
    _assert_one_error_row(runtime.data_dir, m.job_id, "kernel refused token 126")


@pytest.mark.slow
def test_over_celery_an_innocent_job_spends_no_retries(tmp_path):
    """Two jobs on one worker's engine (embedded broker, a real `batchgen worker`): the one with a NaN
    row gets that row as an error row; neither job's shards retry."""
    data_dir = tmp_path / "data"
    settings = broker_for("embedded", data_dir, unique_queue("rows"))
    bad = _job(data_dir, _input(tmp_path / "bad.parquet", "temperature", math.nan), settings)
    innocent = _job(data_dir, _input(tmp_path / "ok.parquet"), settings)
    try:
        with workers(data_dir, settings, tmp_path, ["w1"], "--max-num-seqs", "8", "--concurrency", "4") as ws:
            publish_job(bad, settings)
            publish_job(innocent, settings)
            for m in (bad, innocent):
                wait_for(lambda m=m: job_progress(m).finished, 180, f"job {m.job_id}",
                         on_timeout=lambda: logs(ws))
        _assert_one_error_row(data_dir, bad.job_id, "temperature must be a finite number")
        rows = outputs_of(data_dir, innocent.job_id)
        assert len(rows) == NUM_ROWS and {r["finish_reason"] for r in rows} == {"length"}
        assert [(s["status"], s["attempts"]) for s in shards_of(data_dir, innocent.job_id).values()] == \
            [("completed", 1)] * 4
        assert job_status(data_dir, innocent.job_id) == job_status(data_dir, bad.job_id) == "completed"
    finally:
        delete_queue(settings)
