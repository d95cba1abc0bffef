"""Writers, readers and the compactor at the same time, in separate processes (a few seconds each)."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import time
from pathlib import Path

from jobs.store import catalog
from jobs.store.catalog import connect
from jobs.store.compact import collect_garbage, compact, compact_job, compact_telemetry
from jobs.store.parts import ShardAttempt, Store
from jobs.store.usersql import run_query
from tests.jobs.store import store_workers as sw

SPAWN = multiprocessing.get_context("spawn")
compact_mod = importlib.import_module("jobs.store.compact")  # the package exports a function `compact`


def _answers(data_dir: Path) -> dict:
    con = connect(data_dir)
    try:
        return {name: run_query(con, sql).rows[0][0] for name, sql in sw.CHECKS.items()}
    finally:
        con.close()


def _start_reader(data_dir: Path, tmp: Path, compare: Path | None = None):
    stop, result = tmp / "stop", tmp / "reader.json"
    proc = SPAWN.Process(target=sw.read_loop, args=(str(data_dir), str(stop), str(result),
                                                     str(compare) if compare else None))
    proc.start()
    ready = Path(str(stop) + ".ready")
    while not ready.exists():
        assert proc.is_alive(), "reader process died on start"
        time.sleep(0.05)
    return proc, stop, result


def _stop_reader(proc, stop: Path, result: Path) -> dict:
    stop.touch()
    proc.join(120)
    assert proc.exitcode == 0, f"reader process exited with {proc.exitcode}"
    return json.loads(result.read_text())


def test_four_writers_and_a_reader(tmp_path):
    data_dir = tmp_path / "data"
    Store(data_dir)
    reader, stop, result = _start_reader(data_dir, tmp_path)
    deadline = time.time() + 5.0  # the writers' imports take about a second of it
    writers = []
    for w in range(4):
        args = (str(data_dir), f"job-{w}", f"worker-{w}", deadline, str(tmp_path / f"writer{w}.json"))
        writers.append(SPAWN.Process(target=sw.write_job, args=args))
    for p in writers:
        p.start()
    for p in writers:
        p.join(120)
        assert p.exitcode == 0
    seen = _stop_reader(reader, stop, result)

    assert seen["n_errors"] == 0, seen["errors"]
    assert seen["passes"] >= 3, "the reader should have raced the writers several times"
    written = [json.loads((tmp_path / f"writer{w}.json").read_text()) for w in range(4)]
    shards = sum(w["shards"] for w in written)
    assert shards >= 4, "every writer committed a shard"
    final = _answers(data_dir)
    assert final == {"partial_shards": 0, "duplicate_outputs": 0, "outputs": shards * sw.ROWS_PER_SHARD,
                     "iterations": sum(w["iterations"] for w in written)}
    assert seen["last"] == final  # the reader's last pass (after the writers ended) saw exactly that


def test_attempt_killed_before_commit_leaves_nothing_and_retry_counts_once(tmp_path):
    data_dir = tmp_path / "data"
    store = Store(data_dir)
    proc = SPAWN.Process(target=sw.kill_mid_attempt, args=(str(data_dir), "job-k", 0))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -9  # SIGKILL
    assert len(list((store.layout.kind_dir("outputs") / "raw" / "job-k").glob("*.parquet"))) == 2

    con = connect(data_dir)
    count = lambda sql: con.execute(sql).fetchall()[0][0]
    assert count("SELECT count(*) FROM outputs") == 0
    assert count("SELECT count(*) FROM requests") == 0
    assert con.execute("SELECT status, attempts, worker_id FROM shards").fetchall() == [("running", 1,
                                                                                          "doomed-worker")]
    assert store.committed("job-k", 0) is None

    sw.write_attempt(store, "job-k", 0, 2, "rescuer", commit=True)
    assert count("SELECT count(*) FROM outputs") == sw.ROWS_PER_SHARD
    assert count("SELECT count(DISTINCT request_id) FROM outputs") == sw.ROWS_PER_SHARD
    assert count("SELECT count(*) FROM requests") == sw.ROWS_PER_SHARD
    assert con.execute("SELECT DISTINCT worker_id, attempt FROM requests").fetchall() == [("rescuer", 2)]
    assert con.execute("SELECT status, attempts, worker_id FROM shards").fetchall() == [("completed", 2,
                                                                                          "rescuer")]
    assert store.committed("job-k", 0).attempt == 2
    con.close()


def _fill_finished_jobs(data_dir: Path, jobs: int = 3, shards: int = 6) -> None:
    store = Store(data_dir)
    from jobs.store.schemas import JobRecord

    for j in range(jobs):
        job_id = f"done-{j}"
        store.record_job(JobRecord(job_id, "tiny", shards * sw.ROWS_PER_SHARD, shards, time.time()))
        for s in range(shards):
            if s == 2:
                sw.write_attempt(store, job_id, s, 1, f"w{j}", commit=False)
            sw.write_attempt(store, job_id, s, 1 + (s == 2), f"w{j}", commit=True)
        with store.telemetry_buffer(f"w{j}", flush_interval_s=0) as buf:
            for i in range(30):
                buf.append({"iteration": i, "ts": time.time(), "scheduled_tokens": 5, "token_budget": 64,
                            "job_ids": [job_id]})


def test_compaction_racing_with_readers_keeps_every_answer(tmp_path, monkeypatch):
    # compacted files count 1 s after their rename (5 s by default), in the readers and here
    monkeypatch.setenv("BATCHGEN_STORE_ACTIVATION_DELAY_S", "1.0")
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 1.0)
    # telemetry's inputs too are kept while the readers run (on a loaded machine this test outlasts
    # LIVE_GRACE_S; deleting them early is the writers' test, test_store_writer_compact)
    monkeypatch.setattr(compact_mod, "LIVE_GRACE_S", 600.0)
    data_dir = tmp_path / "data"
    _fill_finished_jobs(data_dir)
    before = _answers(data_dir)
    assert before["outputs"] == 3 * 6 * sw.ROWS_PER_SHARD and before["iterations"] == 90
    con = connect(data_dir)
    full_before = {v: sorted(con.execute(f"SELECT * FROM {v}").fetchall(), key=repr)
                   for v in ("jobs", "shards", "outputs", "requests", "iterations")}
    con.close()
    compare = tmp_path / "expected.json"
    compare.write_text(json.dumps(before))

    reader, stop, result = _start_reader(data_dir, tmp_path, compare)
    time.sleep(0.5)
    for j in range(3):  # one job at a time (6 kinds: no job_events), then the telemetry
        assert compact_job(data_dir, f"done-{j}").groups == 6
        time.sleep(0.2)
    compact_telemetry(data_dir, min_age_s=0)
    # a zombie attempt writes late (uncommitted) parts; the second round merges them into the
    # earlier compacted files, with the grace period keeping every input while readers may hold it
    zombie = ShardAttempt(Store(data_dir), "done-0", 0, 9, "zombie")
    zombie.add_outputs(sw.output_rows("done-0", 0, 0, 4))
    zombie.flush()
    report = compact(data_dir, min_age_s=0)
    assert report.groups == 1 and report.files_in == 2 and report.deleted == 0
    time.sleep(1.5)  # the readers go on while the compacted files start to count
    seen = _stop_reader(reader, stop, result)
    assert seen["n_errors"] == 0, seen["errors"]
    assert seen["passes"] >= 2

    assert collect_garbage(data_dir, grace_s=0) > 0  # the compacted files count: inputs can go
    raw_left = [p for p in (data_dir / "store" / "tables").rglob("raw/*/*.parquet")]
    assert raw_left == []
    assert _answers(data_dir) == before
    con = connect(data_dir)
    full_after = {v: sorted(con.execute(f"SELECT * FROM {v}").fetchall(), key=repr) for v in full_before}
    con.close()
    assert full_after == full_before
