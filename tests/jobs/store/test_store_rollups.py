"""Per-second rollups of the iterations (jobs.store.rollups): `_bg.iteration_seconds` answers what
`rollup_select` over the iterations scan answers, at every step of compaction and garbage collection,
with twins missing or orphaned; the job page's chart drawn from them equals the one drawn from the rows
on the same grid; a merge whose twin cannot be written changes nothing."""

from __future__ import annotations

import importlib
import json
import math
import os
import random

import duckdb
import pytest

from dashboard import queries as q
from dashboard.series import iteration_series
from engine.stats import IterationStats
from jobs.store import Store, StoreError, check_store, collect_garbage, connect, quarantine, rollups
from jobs.store.compact import compact_group
from jobs.store.listing import pin

catalog = importlib.import_module("jobs.store.catalog")
compact_mod = importlib.import_module("jobs.store.compact")  # the package exports a function `compact`

REFERENCE = f"SELECT * FROM ({rollups.rollup_select('_bg.scan_iterations')})"


@pytest.fixture
def no_delays(monkeypatch):
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)  # a compacted file counts at once
    monkeypatch.setattr(compact_mod, "LIVE_GRACE_S", 0.0)


def _write(store: Store, rng: random.Random, workers: int, steps: int, t0: float = 1000.0,
           part_rows: int = 7) -> None:
    for w in range(workers):
        buf = store.telemetry_buffer(f"w{w}", flush_interval_s=1e9)
        buf.max_rows = part_rows
        t = t0 + w * 0.3
        for i in range(steps):
            t += rng.random() * 0.7
            jobs = rng.choice([["a"], ["a"], ["a", "b"], ["b"], []])
            buf.append(IterationStats(f"w{w}", i, t, rng.random() * 0.2, rng.randint(0, 9), rng.randint(0, 3),
                                      3, 1, 2, rng.randint(0, 90), 4, 7, 64, 8, rng.randint(1, 99), 100,
                                      int(rng.random() < 0.1), 0, 0, jobs, rng.randint(0, 2), rng.random()))
        buf.close()


def _diff(con: duckdb.DuckDBPyConnection, pinned: bool = True) -> tuple[int, int]:
    """(rollup rows, rows where `_bg.iteration_seconds` and the reference differ, both ways)."""
    if pinned:
        pin(con)
    n = con.execute("SELECT count(*) FROM _bg.iteration_seconds").fetchone()[0]
    if pinned:
        pin(con)
    diff = con.execute(f"""
        SELECT count(*) FROM ((SELECT * FROM _bg.iteration_seconds EXCEPT ALL {REFERENCE})
                              UNION ALL ({REFERENCE} EXCEPT ALL SELECT * FROM _bg.iteration_seconds))""")
    return n, diff.fetchone()[0]


def _twins(store: Store) -> list[str]:
    return sorted(p.name for p in rollups.rollup_dir(store.layout).glob("*/*.parquet"))


def _all_compacted(tmp_path, seed: int, workers: int, steps: int) -> Store:
    """A store of `workers` workers' iterations, each worker's merged into one compacted file, the
    inputs collected."""
    store = Store(tmp_path, compact_as_written=False)
    _write(store, random.Random(seed), workers=workers, steps=steps)
    for w in range(workers):
        compact_group(store.layout, "iterations", f"w{w}", grace_s=0.0)
    collect_garbage(tmp_path, grace_s=0.0)
    return store


def _compacted(store: Store) -> list[str]:
    return sorted(p.name for p in store.layout.kind_dir("iterations").glob("compacted/*/*.parquet"))


def test_rollups_equal_those_of_the_rows_through_compaction_and_collection(tmp_path, no_delays):
    store, rng = Store(tmp_path, compact_as_written=False), random.Random(5)
    _write(store, rng, workers=3, steps=60)
    con = connect(tmp_path)
    n, diff = _diff(con)
    assert n > 50 and diff == 0 and _twins(store) == []  # raw parts only: computed from their rows
    for step in range(3):
        for w in range(3):
            compact_group(store.layout, "iterations", f"w{w}", grace_s=0.0)
        assert _twins(store) and _twins(store) == _compacted(store)  # one twin per compacted file
        assert _diff(con) == (_diff(con)[0], 0)  # inputs and outputs both listed: the outputs count
        collect_garbage(tmp_path, grace_s=0.0)
        assert _twins(store) == _compacted(store)  # the merged inputs' twins went with them
        assert _diff(con)[1] == 0
        _write(store, rng, workers=3, steps=20, t0=1100.0 + 50 * step)  # more raw parts land
        assert _diff(con)[1] == 0
    assert _diff(con, pinned=False)[1] == 0  # without a pinned listing: computed from the scan


def _unnamed_outputs(store: Store) -> None:
    """Tombstones as a batchgen before they named their output writes them: the merged inputs stay
    listed beside the compacted file, and each part's rows are in two listed files."""
    for tomb in store.layout.gc.glob("*.json"):
        info = json.loads(tomb.read_text())
        info.pop("output")
        tomb.write_text(json.dumps(info))


@pytest.mark.parametrize("delay_s", [0.0, 3600.0])
def test_a_part_in_two_listed_files_counts_once(tmp_path, monkeypatch, delay_s):
    """From the compacted file once it counts (its twin), from the raw part until then (its rows)."""
    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", delay_s)
    store, rng = Store(tmp_path, compact_as_written=False), random.Random(2)
    _write(store, rng, workers=2, steps=30)
    con = connect(tmp_path)
    before = _diff(con)
    compact_group(store.layout, "iterations", "w0")
    _unnamed_outputs(store)
    pin(con)
    twins = con.execute(f"SELECT getvariable('{catalog.LISTING_VARIABLE}').iteration_twins").fetchone()[0]
    assert len(twins) == 2  # the schema file and the compacted file's twin
    assert _twins(store) and _diff(con) == before and before[1] == 0


def test_a_compacted_file_without_its_twin_is_rolled_up_from_its_rows(tmp_path, no_delays):
    """Written by a batchgen before the rollups, or renamed in after the listing read the twins."""
    store = _all_compacted(tmp_path, 3, workers=2, steps=40)
    con = connect(tmp_path)
    with_twins = _diff(con)
    (rollups.rollup_dir(store.layout) / "w1").rename(tmp_path / "w1-twins")
    assert len(_twins(store)) == 1 and _diff(con) == with_twins and with_twins[1] == 0
    pin(con)
    listed = con.execute(f"SELECT getvariable('{catalog.LISTING_VARIABLE}').iterations_untwinned")
    listed = listed.fetchone()[0]
    assert any("/compacted/w1/" in p for p in listed) and not any("/compacted/w0/" in p for p in listed)


def test_a_twin_is_what_the_views_read_for_its_file(tmp_path, no_delays):
    """The twin, not the compacted file's rows, answers for a twinned file (a changed twin shows)."""
    store, rng = Store(tmp_path, compact_as_written=False), random.Random(4)
    _write(store, rng, workers=1, steps=40)
    compact_group(store.layout, "iterations", "w0", grace_s=0.0)
    collect_garbage(tmp_path, grace_s=0.0)
    (twin,) = rollups.rollup_dir(store.layout).glob("w0/*.parquet")
    con = connect(tmp_path)
    assert _diff(con)[1] == 0
    duckdb.execute(f"COPY (SELECT * REPLACE (iterations + 1 AS iterations) FROM read_parquet('{twin}')) "
                   f"TO '{tmp_path / 'x.parquet'}' (FORMAT parquet)")
    os.replace(tmp_path / "x.parquet", twin)
    assert _diff(con)[1] > 0


def test_orphaned_twins_are_collected_and_others_kept(tmp_path, no_delays, monkeypatch):
    store = _all_compacted(tmp_path, 6, workers=2, steps=30)
    (gone,) = store.layout.compacted_dir("iterations", "w1").glob("*.parquet")
    gone.unlink()  # as a compactor of an older batchgen leaves it: the file merged, its twin not deleted
    assert len(_twins(store)) == 2
    collect_garbage(tmp_path, grace_s=0.0)
    assert len(_twins(store)) == 2  # younger than ORPHAN_MAX_AGE_S: a compactor may be between renames
    monkeypatch.setattr(rollups, "ORPHAN_MAX_AGE_S", -1.0)
    collect_garbage(tmp_path, grace_s=0.0)
    assert _twins(store) == _compacted(store) and len(_twins(store)) == 1


def test_a_merge_whose_twin_cannot_be_written_changes_nothing(tmp_path, no_delays, monkeypatch):
    store, rng = Store(tmp_path, compact_as_written=False), random.Random(8)
    _write(store, rng, workers=1, steps=30)
    raw = sorted(store.layout.raw_dir("iterations", "w0").glob("*.parquet"))
    monkeypatch.setattr(rollups, "rollup_select", lambda source, keep=(): "SELECT nothing FROM range(1)")
    with pytest.raises((duckdb.Error, StoreError)):
        compact_group(store.layout, "iterations", "w0")
    assert sorted(store.layout.raw_dir("iterations", "w0").glob("*.parquet")) == raw
    assert _compacted(store) == [] and _twins(store) == [] and list(store.layout.tmp.iterdir()) == []
    assert list(store.layout.gc.iterdir()) == []


# ---------------------------------------------------------------- the job page's chart


def _columns(con):
    def run(sql: str, params: dict) -> dict[str, list]:
        pin(con)
        result = con.execute(sql, params)
        names, rows = [d[0] for d in result.description], result.fetchall()
        return {name: [row[i] for row in rows] for i, name in enumerate(names)}
    return run


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or math.isclose(x, y, rel_tol=1e-9)
                                    for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("max_points", [7, 40])
def test_the_chart_from_rollups_equals_the_rows_on_the_same_grid(tmp_path, no_delays, max_points):
    store, rng = Store(tmp_path, compact_as_written=False), random.Random(max_points)
    _write(store, rng, workers=3, steps=150)
    compact_group(store.layout, "iterations", "w1", grace_s=0.0)  # twins and raw parts together
    con = connect(tmp_path)
    run = _columns(con)
    for job in ("a", "b"):
        rolled = run(q.JOB_ITERATIONS_ROLLED, {"job_id": job, "max_points": max_points})
        assert rolled["rolled"][0] and rolled["downsampled"][0]
        bucket_s = rolled["bucket_s"][0]
        assert bucket_s == int(bucket_s) >= 1 and len(rolled["ts"]) <= max_points
        rows = run("""
            WITH it AS (SELECT * FROM iterations WHERE list_contains(job_ids, $job_id)),
            pw AS (SELECT floor((ts - $b0) / $bucket_s)::BIGINT AS bucket, worker_id, count(*) AS iterations,
                          avg(num_running) AS num_running, avg(kv_blocks_used) AS kv_blocks_used,
                          avg(mask_fill_s) AS mask_fill_s, sum(num_preempted) AS num_preempted
                   FROM it GROUP BY ALL)
            SELECT $b0 + bucket * $bucket_s AS ts, sum(iterations) AS iterations,
                   sum(num_running) AS num_running,
                   sum(kv_blocks_used) AS kv_blocks_used, sum(mask_fill_s) AS mask_fill_s,
                   sum(num_preempted) AS num_preempted, count(DISTINCT worker_id) AS w
            FROM pw GROUP BY bucket ORDER BY bucket""",
                   {"job_id": job, "b0": math.floor(rolled["t0"][0]), "bucket_s": bucket_s})
        assert rolled["iterations"] == rows["iterations"] and rolled["num_preempted"] == rows["num_preempted"]
        for col in ("ts", "num_running", "kv_blocks_used", "mask_fill_s"):
            assert _close(rolled[col], rows[col]), col
        assert rolled["num_iterations"][0] == sum(rows["iterations"])
        assert iteration_series(run, job, max_points)["iterations"] == rolled["iterations"]


def test_a_short_job_is_drawn_from_its_rows_as_before(tmp_path, no_delays):
    """Buckets under a second (a span shorter than max_points seconds): the rows answer, and reading
    only the rollups' time window changes nothing."""
    store, rng = Store(tmp_path, compact_as_written=False), random.Random(1)
    _write(store, rng, workers=2, steps=80)
    compact_group(store.layout, "iterations", "w0", grace_s=0.0)
    con = connect(tmp_path)
    run = _columns(con)
    series = iteration_series(run, "a", 600)
    assert not run(q.JOB_ITERATIONS_ROLLED, {"job_id": "a", "max_points": 600})["rolled"][0]
    whole = run(q.JOB_ITERATIONS, {"job_id": "a", "max_points": 600, "t0": 0, "t_end": 1e12})
    assert series == whole and series["downsampled"][0] and len(series["ts"]) > 50
    assert iteration_series(run, "nobody", 600) == {}


def test_a_corrupt_twin_is_named_and_moved_aside_by_the_check(tmp_path, no_delays):
    store = _all_compacted(tmp_path, 9, workers=2, steps=30)
    (twin,) = rollups.rollup_dir(store.layout).glob("w1/*.parquet")
    twin.write_bytes(twin.read_bytes()[:40])
    con = connect(tmp_path)
    pin(con)
    with pytest.raises(duckdb.Error, match=twin.name):
        con.execute("SELECT count(*) FROM _bg.iteration_seconds").fetchall()
    report = check_store(tmp_path)
    (bad,) = report.bad
    assert bad.path == twin and bad.fate == "re-derivable" and "rollups" in bad.detail
    quarantine(tmp_path, report.bad)
    assert not twin.exists() and check_store(tmp_path).healthy
    assert _diff(connect(tmp_path))[1] == 0  # the compacted file's rollups computed from its rows


def test_the_workers_from_rollups_equal_the_rows(tmp_path, no_delays):
    """Each worker's totals, its latest limits and load, and its decode rate over the whole seconds of
    the recent window, as the iteration rows give them."""
    store, rng = Store(tmp_path, compact_as_written=False), random.Random(10)
    _write(store, rng, workers=3, steps=120)
    compact_group(store.layout, "iterations", "w2", grace_s=0.0)
    con = connect(tmp_path)
    run = _columns(con)
    now, window = 1030.25, 10.0
    got = run(q.WORKERS, {"now": now, "window_s": window})
    want = run("""
        SELECT worker_id, count(*) AS iterations, max(ts + duration_s) AS last_seen_ts,
               min(ts) AS first_seen_ts,
               arg_max(max_num_seqs, ts) AS max_num_seqs, arg_max(token_budget, ts) AS token_budget,
               arg_max(kv_blocks_total, ts) AS kv_blocks_total, arg_max(kv_blocks_used, ts) AS kv_blocks_used,
               arg_max(num_running, ts) AS num_running, arg_max(num_waiting, ts) AS num_waiting,
               coalesce(sum(decode_tokens) FILTER (WHERE ts >= 1020), 0) / 10.25
                   AS recent_decode_tokens_per_s,
               coalesce(sum(scheduled_tokens) FILTER (WHERE ts >= 1020), 0) / 10.25
                   AS recent_scheduled_tokens_per_s,
               sum(decode_tokens) / (max(ts + duration_s) - min(ts)) AS lifetime_decode_tokens_per_s,
               sum(num_preempted) AS preemptions
        FROM iterations GROUP BY worker_id ORDER BY last_seen_ts DESC""", {})
    assert list(got) == list(want) and got["worker_id"] == want["worker_id"] and len(got["worker_id"]) == 3
    for col in got:
        if col != "worker_id":
            assert _close(got[col], want[col]), col
    assert 0 < min(got["recent_decode_tokens_per_s"])  # the window holds iterations of every worker
