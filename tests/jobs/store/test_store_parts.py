"""The part writer: names, temporary files, schemas, buffering, and clear errors on bad rows."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.stats import IterationStats, RequestStats
from jobs.store.catalog import connect
from jobs.store.layout import StoreError
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent, SweepRecord


def _output(i: int, **extra) -> dict:
    return {"request_id": i, "output_text": f"out {i}", "finish_reason": "stop", "prompt_tokens": 4,
            "output_tokens": 2, "error": None, **extra}


def _rows(con, sql: str) -> list[tuple]:
    return con.execute(sql).fetchall()


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "data")


def test_part_names_carry_job_shard_attempt_kind_sequence(store):
    att = store.begin_attempt("job-a", 3, 2, "w1")
    att.add_outputs([_output(1)])
    att.flush()
    att.add_outputs([_output(2)])
    att.commit()
    names = sorted(p.name for p in (store.layout.kind_dir("outputs") / "raw" / "job-a").iterdir())
    assert len(names) == 2
    for seq, name in enumerate(names):
        job, shard, attempt, uid, kind, tail = name.split("~")
        expected = ("job-a", "s000003", "a002", "outputs", f"{seq:06d}.parquet")
        assert (job, shard, attempt, kind, tail) == expected
    # nothing is left under a temporary name, and temporary names live outside every glob
    assert list(store.layout.tmp.iterdir()) == []
    assert not store.layout.tmp.is_relative_to(store.layout.store / "tables")


def test_extra_input_columns_are_carried_through_to_outputs(store):
    att = store.begin_attempt("job-x", 0, 1, "w1")
    att.add_outputs([_output(1, topic="math", score=0.5, tags=["a", "b"]),
                     _output(2, topic="chat", score=None)])
    att.commit()
    other = store.begin_attempt("job-y", 0, 1, "w1")  # another job, other extra columns
    other.add_outputs([_output(9, source="web")])
    other.commit()
    con = connect(store.data_dir)
    rows = _rows(con, "SELECT request_id, topic, score, tags, source FROM outputs "
                      "ORDER BY job_id, request_id")
    assert rows == [("1", "math", 0.5, ["a", "b"], None), ("2", "chat", None, None, None),
                    ("9", None, None, None, "web")]
    cols = [d[0] for d in con.execute("SELECT * FROM outputs").description]
    assert cols[:9] == ["job_id", "request_id", "sample_index", "output_text", "finish_reason",
                        "prompt_tokens", "output_tokens", "error", "model"]
    assert not [c for c in cols if c.startswith("_bg_")]


def test_extra_schema_fixes_extra_column_types(store):
    att = store.begin_attempt("job-t", 0, 1, "w1", extra_schema=pa.schema([("n", pa.int32())]))
    att.add_outputs([_output(1, n=None), _output(2, n=7)])
    att.commit()
    [part] = (store.layout.kind_dir("outputs") / "raw" / "job-t").iterdir()
    assert pq.read_schema(part).field("n").type == pa.int32()


@pytest.mark.parametrize(("row", "message"), [
    (_output(1, prompt_tokens="many"),
     "outputs column 'prompt_tokens' must be int64: row 1 \\(request_id='1'\\) holds 'many'"),
    (_output(1, finish_reason="exploded"), "outputs column 'finish_reason' row 1 is 'exploded'"),
    (_output(1, finish_reason=None), "outputs column 'finish_reason' is null in row 1"),
])
def test_bad_output_rows_are_clear_errors(store, row, message):
    att = store.begin_attempt("job-e", 0, 1, "w1")
    att.add_outputs([_output(0), row])
    with pytest.raises(StoreError, match=message):
        att.flush()


@pytest.mark.parametrize(("row", "message"), [
    (_output(1, _bg_part="x"), r"\['_bg_part'\] use the reserved prefix"),
    (_output(1, job_id="another-job"), "job_id='another-job' but the attempt is for job_id='job-e'"),
    (["not", "a", "dict"], "outputs row is a list"),
])
def test_rows_a_caller_may_not_give(store, row, message):
    att = store.begin_attempt("job-e", 0, 1, "w1")
    with pytest.raises(StoreError, match=message):
        att.add_outputs([row])


def test_bad_ids_and_records_are_clear_errors(store):
    with pytest.raises(StoreError, match="job_id '../etc' is not a valid id"):
        store.begin_attempt("../etc", 0, 1, "w1")
    with pytest.raises(StoreError, match="attempt must be an integer >= 1"):
        store.begin_attempt("job", 0, 0, "w1")
    with pytest.raises(StoreError, match="shard event 'exploded' is not one of"):
        store.record_shard_events([ShardEvent("job", 0, "exploded", time.time())])
    with pytest.raises(StoreError, match="requests rows have unknown column"):
        store.begin_attempt("job", 0, 1, "w1").add_requests([{"request_id": "1", "finish_reason": "stop",
                                                               "bogus": 1}])


def test_attempt_is_closed_after_commit(store):
    att = store.begin_attempt("job-c", 0, 1, "w1")
    att.add_outputs([_output(1)])
    record = att.commit()
    assert (record.num_outputs, record.prompt_tokens, record.output_tokens) == (1, 4, 2)
    assert len(record.parts) == 1
    with pytest.raises(StoreError, match="already committed"):
        att.add_outputs([_output(2)])


def test_attempt_buffers_flush_when_due(store):
    att = store.begin_attempt("job-f", 0, 1, "w1", flush_interval_s=0.2)
    raw = store.layout.kind_dir("outputs") / "raw" / "job-f"
    att.add_outputs([_output(1)])
    assert not raw.exists() or not list(raw.iterdir())  # buffered
    time.sleep(0.25)
    att.add_outputs([_output(2)])  # due: both rows written as one part
    assert len(list(raw.iterdir())) == 1
    att.max_buffered_rows = 3
    att.add_outputs([_output(i) for i in range(3, 6)])  # full: written at once
    assert len(list(raw.iterdir())) == 2


def test_request_rows_from_request_stats(store):
    att = store.begin_attempt("job-r", 4, 1, "w9")
    att.add_request("17", "length", RequestStats(10.0, 10.5, 11.0, 13.0, 1, 5, 5))
    att.commit()
    con = connect(store.data_dir)
    rows = _rows(con, "SELECT job_id, shard_id, request_id, worker_id, finish_reason, queue_s, ttft_s, "
                      "e2e_s, tpot_s, num_preemptions, prompt_tokens, output_tokens FROM requests")
    assert rows == [("job-r", 4, "17", "w9", "length", 0.5, 1.0, 3.0, 0.5, 1, 5, 5)]


def test_telemetry_buffer_flushes_on_interval_size_and_close(store):
    iterations = store.layout.kind_dir("iterations") / "raw" / "celery_w1_host"
    buf = store.telemetry_buffer("celery@w1/host", flush_interval_s=0.2)
    buf.append(IterationStats(iteration=0, ts=time.time(), job_ids=["a", "b"]))
    assert not iterations.exists() or not list(iterations.iterdir())
    time.sleep(0.25)
    buf.append(IterationStats(iteration=1, ts=time.time()))
    assert len(list(iterations.iterdir())) == 1
    buf.max_rows = 2
    buf.append(IterationStats(iteration=2))
    buf.append(IterationStats(iteration=3))
    assert len(list(iterations.iterdir())) == 2 and buf._rows == []
    buf.append(IterationStats(iteration=4))
    buf.close()
    assert buf.rows_written == 5
    con = connect(store.data_dir)
    assert _rows(con, "SELECT iteration, worker_id, job_ids FROM iterations ORDER BY iteration")[:2] == [
        (0, "celery@w1/host", ["a", "b"]), (1, "celery@w1/host", [])]


def test_committed_picks_the_first_commit(store):
    assert store.committed("job-w", 0) is None
    first = store.begin_attempt("job-w", 0, 2, "w1")
    second = store.begin_attempt("job-w", 0, 1, "w2")
    first.add_outputs([_output(1)])
    second.add_outputs([_output(1)])
    first.commit()
    second.commit()
    winner = store.committed("job-w", 0)
    assert (winner.attempt, winner.worker_id, winner.attempt_id) == (2, "w1", first.attempt_id)


def test_job_and_sweep_records(store):
    store.record_job(JobRecord("job-j", "tiny", 10, 2, 1000.0, '{"max_tokens": 8}', "/out/x.parquet"))
    store.record_sweep([SweepRecord("sw1", 1.0, "tiny", "max_num_seqs", n, 256, 0, 32, 100.0 * n, 200.0,
                                    0.1, 0.2, 0.01, 0.02, 1.0, 2.0, n * 0.9, 0.7, 0, '{"seed": 0}')
                        for n in (4, 8)])
    con = connect(store.data_dir)
    assert _rows(con, "SELECT job_id, model, num_requests, num_shards, status, config, output_path "
                      "FROM jobs") == [
        ("job-j", "tiny", 10, 2, "queued", '{"max_tokens": 8}', "/out/x.parquet")]
    assert _rows(con, "SELECT max_num_seqs, output_tokens_per_s, workload FROM sweeps ORDER BY 1") == [
        (4, 400.0, '{"seed": 0}'), (8, 800.0, '{"seed": 0}')]
