"""Request digests: each request-timing part's totals and sample (jobs.store.digests)."""

from __future__ import annotations

import random

import pytest

from engine.stats import RequestStats
from jobs.store import Store, StoreError, connect
from jobs.store import digests as dg
from jobs.store.schemas import JobRecord


def _stats(rng: random.Random, t0: float) -> RequestStats:
    arrival = t0 + rng.random() * 10
    scheduled = arrival + rng.random() if rng.random() > 0.1 else 0.0  # some never scheduled
    first = scheduled + rng.random() if scheduled and rng.random() > 0.1 else 0.0
    out = rng.randint(0, 40) if first else 0
    finished = (first or arrival) + rng.random() * 5
    preempted = rng.choice((0, 0, 0, 1, 3))
    return RequestStats(arrival, scheduled, first, finished, preempted, rng.randint(1, 50), out)


def _write_job(data_dir, rng: random.Random, job_id: str = "j") -> None:
    """Shards 0-2 committed (shard 1 after a killed first attempt), shard 3 running (two attempts
    begun, the latest counts), in several parts each."""
    store = Store(data_dir)
    store.record_job(JobRecord(job_id, "tiny", 400, 4, 1000.0))
    plan = [(0, 1, True), (1, 1, False), (1, 2, True), (2, 1, True), (3, 1, False), (3, 2, False)]
    for shard, attempt, commit in plan:
        att = store.begin_attempt(job_id, shard, attempt, "w", num_requests=100)
        for part in range(3):
            for i in range(rng.randint(1, 40)):
                att.add_request(f"{shard}-{part}-{i}", "stop", _stats(rng, 1000.0))
            att.flush()
        if commit:
            att.commit()


TOTALS = """
SELECT count(*) AS num_rows, sum(output_tokens) AS output_tokens, sum(num_preemptions) AS num_preemptions,
       count(*) FILTER (WHERE num_preemptions > 0) AS requests_preempted,
       sum(output_tokens) FILTER (WHERE first_token_ts > 0 AND output_tokens > 0) AS timed_output_tokens,
       count(ttft_s) FILTER (WHERE first_token_ts > 0) AS ttft_s_count,
       sum(tpot_s) FILTER (WHERE output_tokens > 1 AND first_token_ts > 0) AS itl_s_sum,
       min(e2e_s) FILTER (WHERE finished_ts > 0) AS e2e_s_min,
       max(queue_s) FILTER (WHERE scheduled_ts > 0) AS queue_s_max
FROM requests_live WHERE job_id = 'j'
"""
DIGEST_TOTALS = """
SELECT sum(num_rows), sum(output_tokens), sum(num_preemptions), sum(requests_preempted),
       sum(timed_output_tokens), sum(ttft_s_count), sum(itl_s_sum), min(e2e_s_min), max(queue_s_max)
FROM _bg.request_digests_live WHERE job_id = 'j'
"""


def test_the_digests_of_the_live_attempts_sum_to_the_live_request_rows(tmp_path):
    _write_job(tmp_path, random.Random(7))
    con = connect(tmp_path)
    want = con.execute(TOTALS).fetchone()
    got = con.execute(DIGEST_TOTALS).fetchone()
    assert got[:6] == want[:6] and got[7:] == pytest.approx(want[7:])
    assert got[6] == pytest.approx(want[6])
    # the running shard counts its latest attempt only, as requests_live does
    attempts = con.execute("SELECT DISTINCT shard_id, attempt, committed FROM _bg.request_digests_live "
                           "ORDER BY ALL").fetchall()
    assert attempts == [(0, 1, True), (1, 2, True), (2, 1, True), (3, 2, False)]


def test_a_digest_samples_exactly_the_rows_of_its_levels(tmp_path):
    _write_job(tmp_path, random.Random(8))
    con = connect(tmp_path)
    rows = con.execute("SELECT request_id, sample_index, arrival_ts, e2e_s FROM requests_live "
                       "WHERE job_id = 'j'").fetchall()
    ids = [r[0] for r in rows]
    level = dict(zip(ids, dg.levels(ids, [r[1] for r in rows]), strict=True))
    by_time = {(r[2], r[3]): r[0] for r in rows}
    for lv in dg.LEVELS:
        column = dg.sample_column(lv)
        sampled = con.execute(f"SELECT s.arrival_ts, s.e2e_s FROM (SELECT unnest({column}) AS s "
                              "FROM _bg.request_digests_live WHERE job_id = 'j')").fetchall()
        want = sorted((a, e) for (a, e), rid in by_time.items()
                      if (level[rid] >= lv if lv == dg.MAX_LEVEL else level[rid] == lv))
        assert sorted(sampled) == want
    at3 = con.execute(dg.sampled_rows_sql(3, "_bg.request_digests_live"), {"job_id": "j"}).fetchall()
    assert len(at3) == sum(lv >= 3 for lv in level.values()) > 0


def test_levels_are_deterministic_and_geometric():
    ids = [str(i) for i in range(40_000)]
    levels = dg.levels(ids, [0] * len(ids))
    assert levels == dg.levels(ids, [0] * len(ids))
    for k in (1, 3, 5):
        share = sum(lv >= k for lv in levels) / len(levels)
        assert share == pytest.approx(2 ** -k, rel=0.15)
    assert dg.levels(["a"], [0]) != dg.levels(["a"], [1]) or dg.levels(["b"], [0]) != dg.levels(["b"], [1])


def test_the_sample_level_keeps_about_sample_rows():
    assert dg.sample_level(10) == dg.MIN_LEVEL
    assert dg.sample_level(dg.SAMPLE_ROWS * 8) == 3
    assert dg.sample_level(dg.SAMPLE_ROWS * 8 + 1) == 4
    assert dg.sample_level(10_000_000) == 8  # 10M / 2**8 = 39,062 rows
    assert dg.sample_level(10 ** 12) == dg.MAX_LEVEL
    with pytest.raises(ValueError, match="outside 3..12"):
        dg.sampled_rows_sql(2)


def test_an_attempt_that_cannot_write_a_digest_fails_and_commits_nothing(tmp_path, monkeypatch):
    store = Store(tmp_path)
    store.record_job(JobRecord("j", "tiny", 1, 1, 1000.0))
    att = store.begin_attempt("j", 0, 1, "w", num_requests=1)
    att.add_request("0", "stop", RequestStats(1.0, 2.0, 3.0, 4.0, 0, 1, 2))

    def broken(table):
        raise StoreError("disk full")

    monkeypatch.setattr(dg, "digest", broken)
    with pytest.raises(StoreError, match="disk full"):
        att.commit()
    assert connect(tmp_path).execute("SELECT count(*) FROM _bg.winners").fetchone() == (0,)


def test_the_job_summaries_live_rows_and_tokens_are_those_of_requests_live(tmp_path):
    """The summaries take a committed shard's rows and tokens from its winning commit and read only the
    uncommitted shards' digests (`UNCOMMITTED_DIGESTS`): the totals of `requests_live` all the same,
    through a killed attempt, a revoked commit, a shard committed twice and shards still running."""
    from dashboard import queries

    rng = random.Random(11)
    store = Store(tmp_path)
    store.record_job(JobRecord("j", "tiny", 800, 8, 1000.0))
    # (shard, attempt, commit): 1's first attempt killed; 4's commit revoked, then its retry running;
    # 5 committed by two attempts (the first commit wins); 6 and 7 running, 7 in two attempts
    plan = [(0, 1, True), (1, 1, False), (1, 2, True), (2, 1, True), (3, 1, True), (4, 1, True),
            (4, 2, False), (5, 1, True), (5, 2, True), (6, 1, False), (7, 1, False), (7, 2, False)]
    for shard, attempt, commit in plan:
        att = store.begin_attempt("j", shard, attempt, "w", num_requests=100)
        for part in range(2):
            for i in range(rng.randint(0, 30)):
                stats = _stats(rng, 1000.0)
                rid = f"{shard}-{part}-{i}"
                att.add_outputs([{"request_id": rid, "output_text": "x", "finish_reason": "stop",
                                  "prompt_tokens": stats.prompt_tokens, "output_tokens": stats.output_tokens,
                                  "error": None}])
                att.add_request(rid, "stop", stats)
            att.flush()
        if commit:
            record = att.commit()
            if shard == 4:
                store.revoke_commit(record, "lost a part")
    con = connect(tmp_path)
    try:
        live = con.execute("SELECT count(*), coalesce(sum(output_tokens), 0) FROM requests_live "
                           "WHERE job_id = 'j'").fetchone()
        committed = con.execute("SELECT rows_done, output_tokens FROM jobs WHERE job_id = 'j'").fetchone()
        assert live[0] > committed[0] and live[1] > committed[1]  # the running shards add to both
        for sql, params in ((queries.JOBS_SUMMARY, {"limit": 10}),
                            (queries.JOB_SUMMARY, {"job_id": "j", "limit": 1})):
            row = dict(zip([d[0] for d in con.execute(sql, params).description], con.fetchone(), strict=True))
            assert (row["rows_done"], row["output_tokens"]) == live
    finally:
        con.close()
