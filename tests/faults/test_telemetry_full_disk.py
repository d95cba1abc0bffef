"""A full disk while a worker writes telemetry (make soak's disk-full phase killed every worker: "the
engine loop died") costs neither the shard nor the worker: the iteration rows are kept and written
once there is room again."""

from __future__ import annotations

import errno

from jobs.broker import resolve_broker
from jobs.shard_runner import ShardTask, process_shard
from jobs.store import Store
from jobs.store.parts import HELD_ROWS_FACTOR
from tests.jobs.helpers import query, submit, worker_runtime, write_prompts


def test_telemetry_that_cannot_be_written_waits_and_the_shard_commits(tmp_path, monkeypatch):
    data = tmp_path / "data"
    write_prompts(tmp_path / "in.parquet", 4)
    with worker_runtime(data, "w-full", max_num_seqs=4) as runtime:
        broker = resolve_broker(data, embedded=True)
        m = submit(data, tmp_path / "in.parquet", broker, shard_size=4, max_tokens=3)
        writer = runtime.telemetry._writer
        real = writer.write

        def disk_full(table):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(writer, "write", disk_full)
        runtime.telemetry.flush_interval_s = 0.0  # every step tries to write
        outcome = process_shard(ShardTask(m.job_id, 0, m.data_dir), runtime)
        assert outcome.result == "committed", outcome
        assert runtime.loop.alive
        held = runtime.iterations
        assert held > 0 and query(data, "SELECT count(*) AS n FROM iterations")[0]["n"] == 0
        monkeypatch.setattr(writer, "write", real)  # room again
        # through the runtime's lock: the engine's thread may still be moving its last rows into the
        # buffer (its idle flush); a flush of the buffer alone raced with it and lost those rows
        runtime.flush_telemetry()
    assert query(data, "SELECT count(*) AS n FROM iterations")[0]["n"] >= held


def test_a_buffer_whose_writes_keep_failing_keeps_only_the_newest_rows(tmp_path, monkeypatch):
    buffer = Store(tmp_path).telemetry_buffer("w", flush_interval_s=3600.0)
    buffer.max_rows = 10

    def disk_full(table):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(buffer._writer, "write", disk_full)
    for i in range(100):
        try:
            buffer.append({"iteration": i, "ts": float(i)})
        except OSError:
            pass
    assert buffer.rows_dropped > 0 and len(buffer._rows) < HELD_ROWS_FACTOR * 10
    assert buffer._rows[-1]["iteration"] == 99


def test_a_batch_of_rows_whose_write_fails_is_kept_whole(tmp_path, monkeypatch):
    """The runtime hands the buffer a second's steps at once: a write due after the first of them
    that fails (a full disk) kept only the rows before it, and the rest of the batch was lost."""
    buffer = Store(tmp_path).telemetry_buffer("w", flush_interval_s=0.0)
    real = buffer._writer.write

    def disk_full(table):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(buffer._writer, "write", disk_full)
    for batch in (range(0, 5), range(5, 8)):
        try:
            buffer.extend({"iteration": i, "ts": float(i)} for i in batch)
        except OSError:
            pass
        else:
            raise AssertionError("the write did not fail")
    assert [r["iteration"] for r in buffer._rows] == list(range(8)) and buffer.rows_dropped == 0
    monkeypatch.setattr(buffer._writer, "write", real)
    buffer.flush()
    assert buffer.rows_written == 8 and query(tmp_path, "SELECT count(*) AS n FROM iterations")[0]["n"] == 8
