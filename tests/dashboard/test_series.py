"""Chart series of a 100k-iteration job from two workers: bucketed on the server, and still exact."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dashboard import create_app
from tests.dashboard.conftest import JOB_ID as SMALL
from tests.dashboard.conftest import as_json, sql, sql_one
from tests.dashboard.synthetic import JOB_ID, SWEEP_ID, WORKERS

MAX_POINTS = 2000


@pytest.fixture
def big(big_data_dir):
    return create_app({"TESTING": True, "DATA_DIR": big_data_dir, "MAX_POINTS": MAX_POINTS}).test_client()


def test_iterations_are_bucketed_and_add_up(big, big_data_dir):
    start = time.perf_counter()
    body = as_json(big.get(f"/api/jobs/{JOB_ID}/iterations"))
    elapsed = time.perf_counter() - start
    s = body["series"]
    want = sql_one(big_data_dir, f"""
        SELECT count(*) AS n, sum(num_preempted) AS preempted, min(ts) AS t0
        FROM iterations WHERE list_contains(job_ids, '{JOB_ID}')""")
    assert body["num_iterations"] == want["n"] == 100_000
    assert body["num_workers"] == len(WORKERS) and body["downsampled"] is True
    assert len(s["ts"]) <= MAX_POINTS and s["ts"] == sorted(s["ts"])
    assert sum(s["iterations"]) == want["n"]
    assert sum(s["num_preempted"]) == want["preempted"]
    assert s["ts"][0] == pytest.approx(want["t0"])
    assert elapsed < 10, f"iterations endpoint took {elapsed:.1f} s"


def test_a_bucket_is_each_workers_mean_summed(big, big_data_dir):
    body = as_json(big.get(f"/api/jobs/{JOB_ID}/iterations"))
    s, width = body["series"], body["bucket_s"]
    i = len(s["ts"]) // 2
    lo = s["ts"][i]
    want = sql_one(big_data_dir, f"""
        SELECT sum(running) AS running, sum(kv) AS kv, sum(n) AS n, sum(constrained) AS constrained,
               sum(mask) AS mask FROM (
            SELECT worker_id, avg(num_running) AS running, avg(kv_blocks_used) AS kv, count(*) AS n,
                   avg(num_constrained_seqs) AS constrained, avg(mask_fill_s) AS mask
            FROM iterations WHERE list_contains(job_ids, '{JOB_ID}') AND ts >= {lo!r} AND ts < {lo + width!r}
            GROUP BY worker_id)""")
    assert s["iterations"][i] == want["n"]
    assert s["num_running"][i] == pytest.approx(want["running"])
    assert s["kv_blocks_used"][i] == pytest.approx(want["kv"])
    assert s["num_constrained_seqs"][i] == pytest.approx(want["constrained"]) and want["constrained"] > 0
    assert s["mask_fill_s"][i] == pytest.approx(want["mask"]) and want["mask"] > 0
    # fleet totals: two workers' budgets and KV caches
    assert s["token_budget"][i] == pytest.approx(2 * 2048)
    pairs = zip(s["scheduled_tokens"], s["token_budget"], strict=True)
    assert all(scheduled <= budget + 1e-9 for scheduled, budget in pairs)


def test_small_max_points_buckets_the_small_job_too(job_data_dir):
    client = create_app({"TESTING": True, "DATA_DIR": job_data_dir, "MAX_POINTS": 10}).test_client()
    body = as_json(client.get(f"/api/jobs/{SMALL}/iterations"))
    want = sql_one(job_data_dir, f"SELECT count(*) AS n, sum(decode_tokens) AS d FROM iterations "
                                 f"WHERE list_contains(job_ids, '{SMALL}')")
    assert body["downsampled"] is True and len(body["series"]["ts"]) <= 10
    assert sum(body["series"]["iterations"]) == want["n"]
    # with one worker a bucket holds its mean: mean * iterations adds back up to the total
    pairs = zip(body["series"]["decode_tokens"], body["series"]["iterations"], strict=True)
    total = sum(mean * n for mean, n in pairs)
    assert total == pytest.approx(want["d"])


def test_throughput_of_the_big_job(big, big_data_dir):
    want = sql_one(big_data_dir, f"SELECT sum(output_tokens) AS n FROM requests WHERE job_id = '{JOB_ID}'")
    body = as_json(big.get(f"/api/jobs/{JOB_ID}/throughput"))
    assert len(body["series"]["ts"]) == 120
    assert sum(body["series"]["output_tokens_per_s"]) * body["bucket_s"] == pytest.approx(want["n"], rel=1e-6)


def test_latency_of_the_big_job(big, big_data_dir):
    body = as_json(big.get(f"/api/jobs/{JOB_ID}/latency"))
    want = sql_one(big_data_dir, f"""
        SELECT count(*) AS n, quantile_cont(e2e_s, 0.9) AS p90, max(e2e_s) AS hi
        FROM requests WHERE job_id = '{JOB_ID}' AND finished_ts > 0""")
    e2e = body["e2e_s"]
    assert e2e["count"] == want["n"] == 2000
    assert e2e["p90"] == pytest.approx(want["p90"]) and e2e["max"] == pytest.approx(want["hi"])
    assert sum(e2e["histogram"]["count"]) == want["n"] and len(e2e["histogram"]["count"]) == 30
    assert e2e["histogram"]["count"][-1] >= 1  # the maximum lands in the last bin


def test_sweeps_average_repeats(big, big_data_dir):
    want = sql(big_data_dir, f"""
        SELECT max_num_seqs, count(*) AS repeats, avg(output_tokens_per_s) AS tput, avg(ttft_p99_s) AS ttft
        FROM sweeps WHERE sweep_id = '{SWEEP_ID}' GROUP BY max_num_seqs ORDER BY tput""")
    got = as_json(big.get("/api/sweeps"))["sweeps"][SWEEP_ID]
    assert [(c["max_num_seqs"], c["repeats"]) for c in got] == \
        [(w["max_num_seqs"], w["repeats"]) for w in want]
    for c, w in zip(got, want, strict=True):
        assert c["output_tokens_per_s"] == pytest.approx(w["tput"])
        assert c["ttft_p99_s"] == pytest.approx(w["ttft"])
    page = big.get("/sweeps").get_data(as_text=True)
    assert f'data-sweep-id="{SWEEP_ID}"' in page and "sweep-ttft" in page


def test_workers_of_the_big_job(big):
    workers = {w["worker_id"]: w for w in as_json(big.get("/api/workers"))["workers"]}
    assert set(workers) == set(WORKERS)
    for w in workers.values():
        assert w["iterations"] == 50_000 and w["alive"] is False  # the synthetic run ended an hour ago
        assert w["max_num_seqs"] == 64 and w["token_budget"] == 2048 and w["kv_blocks_total"] == 4096
        assert w["recent_decode_tokens_per_s"] == 0


@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 20), st.booleans()), max_size=40),
       st.lists(st.integers(0, 22), max_size=12))
@settings(max_examples=60, deadline=None)
def test_outstanding_requests_at_each_point_are_those_arrived_and_not_finished(requests, points):
    """JOB_OUTSTANDING_AT against a count request by request, ties at the points' times included; a
    request not finished (finished_ts 0) stays outstanding, another job's never counts."""
    import duckdb

    from dashboard import queries

    con = duckdb.connect()
    con.execute("CREATE TABLE requests_live (job_id VARCHAR, arrival_ts DOUBLE, finished_ts DOUBLE)")
    rows = [("j", float(a), float(a + d) if done else 0.0) for a, d, done in requests] + [("other", 1.0, 0.0)]
    con.executemany("INSERT INTO requests_live VALUES (?, ?, ?)", rows)
    points_ = [float(p) for p in points]
    got = con.execute(queries.JOB_OUTSTANDING_AT, {"job_id": "j", "points": points_}).fetchall()
    want = [(float(t), sum(1 for job, a, f in rows if job == "j" and a <= t and (f == 0 or f > t)))
            for t in points]
    assert got == want
