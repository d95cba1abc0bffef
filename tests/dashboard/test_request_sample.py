"""A large job's request figures come from its digests' sample (jobs.store.digests), a small one's from
its rows; both agree where the digests are exact, and the sample stays close where it is not."""

from __future__ import annotations

import random
import shutil

import pytest

from dashboard import create_app, data, queries, series
from engine.stats import RequestStats
from jobs.store import Store
from jobs.store import digests as dg
from jobs.store.schemas import JobRecord, ShardEvent

JOB = "big"
SHARDS, PER_SHARD = 8, 500


def _requests(rng: random.Random, shard: int, t0: float):
    for i in range(PER_SHARD):
        arrival = t0 + shard * 20 + rng.random() * 20
        scheduled = arrival + rng.expovariate(2.0)
        first = scheduled + rng.expovariate(4.0)
        out = rng.randint(1, 60)
        yield f"{shard}-{i}", RequestStats(arrival, scheduled, first, first + out * 0.02 * (1 + rng.random()),
                                           rng.choice((0,) * 9 + (2,)), 10, out)


def _write_job(data_dir, without_digests: tuple[int, ...] = ()) -> None:
    """A job of 4,000 requests: shards 0-6 committed, shard 7 running (its rows are live only); the
    shards in `without_digests` written as a batchgen before digests wrote them."""
    store = Store(data_dir)
    rng = random.Random(3)
    t0 = 1_000_000.0
    store.record_job(JobRecord(JOB, "tiny", SHARDS * PER_SHARD, SHARDS, t0))
    store.record_shard_events([ShardEvent(JOB, s, "queued", t0, num_requests=PER_SHARD)
                               for s in range(SHARDS)])
    for shard in range(SHARDS):
        att = store.begin_attempt(JOB, shard, 1, "w", num_requests=PER_SHARD)
        if shard in without_digests:
            att._write_digest = lambda table, part: None
        for rid, stats in _requests(rng, shard, t0):
            att.add_request(rid, "stop", stats)
            if rid.endswith("99"):
                att.flush()
        att.flush()
        if shard < SHARDS - 1:
            att.commit()


@pytest.fixture(scope="module")
def big_job(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("sampled") / "data"
    _write_job(data_dir)
    return data_dir


def _figures(data_dir, monkeypatch, *, sampled: bool) -> dict:
    if sampled:  # as if the job were past EXACT_MAX_ROWS: the sample at level 3 (1 in 8)
        monkeypatch.setattr(dg, "EXACT_MAX_ROWS", 0)
        monkeypatch.setattr(dg, "sample_level", lambda rows: 3)
    app = create_app({"TESTING": True, "DATA_DIR": data_dir, "PAGE_CACHE_ENTRIES": 0})
    with app.app_context():
        points = [1_000_000.0 + t for t in range(0, 200, 10)]
        return {"source": series.request_source(JOB), "latency": series.job_latency(JOB),
                "rate": series.job_output_rate(JOB), "outstanding": series.outstanding_at(JOB, points),
                "preemptions": data.job_preemptions(JOB), "summary": data.job_summary(JOB)[0]}


def test_the_sample_agrees_with_the_rows(big_job, monkeypatch):
    exact = _figures(big_job, monkeypatch, sampled=False)
    sampled = _figures(big_job, monkeypatch, sampled=True)
    assert exact["source"].level is None and exact["latency"]["sample"] is None
    assert sampled["source"].level == 3 and sampled["latency"]["sample"]["rate"] == 1 / 8
    assert exact["source"].request_rows == sampled["source"].request_rows == SHARDS * PER_SHARD
    for metric in queries.LATENCY_METRICS:
        e, s = exact["latency"][metric], sampled["latency"][metric]
        assert e["count"] > 1000 and s["count"] == e["count"]  # the digests' totals: exact
        assert (s["mean"], s["min"], s["max"]) == pytest.approx((e["mean"], e["min"], e["max"]))
        assert e["sampled_count"] is None and 0.08 * e["count"] < s["sampled_count"] < 0.17 * e["count"]
        for q in ("p50", "p90", "p99"):  # the sample's, within a sampling error
            assert s[q] == pytest.approx(e[q], rel=0.25, abs=0.02), (metric, q)
        assert sum(s["histogram"]["count"]) == pytest.approx(e["count"], rel=0.02)
    rate_e, rate_s = exact["rate"], sampled["rate"]
    assert rate_s["output_tokens"] == rate_e["output_tokens"] > 0
    assert rate_s["bucket_s"] == pytest.approx(rate_e["bucket_s"])
    integral = sum(rate_s["series"]["output_tokens_per_s"]) * rate_s["bucket_s"]
    assert integral == pytest.approx(rate_s["output_tokens"], rel=1e-6)
    # request concurrency: each sampled request stands for 8, so the estimate is noisy point by point
    # (about 5 sampled requests in flight here) but unbiased: over the job, within a sampling error
    e_out, s_out = exact["outstanding"], sampled["outstanding"]
    assert all(n % 8 == 0 for n in s_out) and sum(s_out) == pytest.approx(sum(e_out), rel=0.15)
    assert sampled["preemptions"] == exact["preemptions"] and exact["preemptions"]["requests_preempted"] > 0
    assert sampled["summary"].rows_done == exact["summary"].rows_done == SHARDS * PER_SHARD


def test_the_sampled_figures_read_no_request_rows(big_job, tmp_path, monkeypatch):
    """With the requests' files gone, the sampled queries still answer: they read the digests only."""
    copy = tmp_path / "data"
    shutil.copytree(big_job, copy)
    for path in (copy / "store" / "tables" / "requests").rglob("*.parquet"):
        if path.name != "_schema.parquet":
            path.unlink()
    assert _figures(copy, monkeypatch, sampled=False)["latency"]["ttft_s"]["count"] == 0
    sampled = _figures(copy, monkeypatch, sampled=True)
    assert sampled["latency"]["ttft_s"]["count"] == SHARDS * PER_SHARD
    assert sampled["latency"]["ttft_s"]["p50"] is not None
    assert sampled["rate"]["output_tokens"] > 0 and max(sampled["outstanding"]) > 0


def test_a_job_whose_commits_have_no_digests_is_read_row_by_row(big_job, tmp_path, monkeypatch):
    """Commits written by a batchgen without digests: the rows, however many (digest sums would be short)."""
    old_data = tmp_path / "data"
    _write_job(old_data, without_digests=(0,))
    exact = _figures(big_job, monkeypatch, sampled=False)
    old = _figures(old_data, monkeypatch, sampled=True)
    assert old["source"].level is None and not old["source"].digested
    assert old["latency"]["e2e_s"]["count"] == exact["latency"]["e2e_s"]["count"]
    assert old["preemptions"] == exact["preemptions"]


def test_every_levels_queries_run(big_job):
    """The sampled queries of every level bind and answer (a high level's sample may be empty)."""
    from jobs.store import connect, run_query

    con = connect(big_job)
    job = {"job_id": JOB}
    points = {**job, "points": [1_000_000.0, 1_000_050.0]}
    for level in dg.LEVELS:
        latency = run_query(con.cursor(), queries.JOB_LATENCY_SAMPLED[level], {**job, "bins": 5}).rows
        assert len(latency) == len(queries.LATENCY_METRICS)
        rate = run_query(con.cursor(), queries.JOB_OUTPUT_RATE_SAMPLED[level], {**job, "n": 10}).rows
        assert len(rate) == 10
        assert len(run_query(con.cursor(), queries.JOB_OUTSTANDING_AT_SAMPLED[level], points).rows) == 2


def test_a_jobs_source_is_kept_a_few_seconds_then_asked_again(big_job, tmp_path, monkeypatch):
    copy = tmp_path / "data"
    shutil.copytree(big_job, copy)
    app = create_app({"TESTING": True, "DATA_DIR": copy, "PAGE_CACHE_ENTRIES": 0})
    with app.app_context():
        first = series.request_source(JOB)
        att = Store(copy).begin_attempt(JOB, SHARDS - 1, 2, "w", num_requests=1)  # a newer attempt: 1 row
        att.add_request("late", "stop", RequestStats(1.0, 2.0, 3.0, 4.0, 0, 1, 2))
        att.flush()
        assert series.request_source(JOB) == first  # kept
        monkeypatch.setattr(series, "SOURCE_TTL_S", 0.0)
        again = series.request_source(JOB)
    assert again.request_rows == first.request_rows - PER_SHARD + 1  # the running shard's newest attempt
