"""A job's queries run over a listing of that job's parts only, with the same answers."""

from __future__ import annotations

import re
import time

import pytest

from dashboard import create_app, queries
from engine.stats import IterationStats, RequestStats
from jobs.store import Store, catalog, collect_garbage, connect, run_query
from jobs.store import listing as store_listing
from jobs.store.compact import compact_live_job
from jobs.store.schemas import JOB_KINDS, JobRecord, ShardEvent
from tests.dashboard.conftest import JOB_ID


def _job(store: Store, job_id: str, t0: float) -> None:
    """Three shards: one committed, one running (an uncommitted attempt's rows), one queued."""
    store.record_job(JobRecord(job_id, "tiny", 9, 3, t0))
    store.record_shard_events([ShardEvent(job_id, s, "queued", t0, num_requests=3) for s in range(3)])
    for shard, commit in ((0, True), (1, False)):
        store.record_shard_events([ShardEvent(job_id, shard, "running", t0 + 1, worker_id="w", attempt=1)])
        att = store.begin_attempt(job_id, shard, 1, "w", num_requests=3)
        for i in range(3):
            rid = f"{shard}-{i}"
            att.add_outputs([{"request_id": rid, "output_text": "o", "finish_reason": "stop",
                              "prompt_tokens": 2, "output_tokens": i + 1, "error": None}])
            stats = RequestStats(t0 + i, t0 + i + 0.1, t0 + i + 0.5, t0 + i + 2, 0, 2, i + 1)
            att.add_request(rid, "stop", stats)
        att.flush()
        if commit:
            att.commit()
    buf = store.telemetry_buffer(f"w-{job_id}")
    for step in range(4):  # as benchmarks.store_live writes them
        buf.append(IterationStats(f"w-{job_id}", step, t0 + step, 0.05, 3, 1, 3, 0, 3, 0, 3, 3, 2048, 64, 10,
                                  4096, 0, 0, 0, [job_id]))
    buf.close()


PARAMS = {"limit": 20, "status": None, "offset": 0, "max_points": 50, "n": 10, "bins": 5, "lo": 0, "hi": 2,
          "t0": 0, "t_end": 1e12}


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """Two running jobs; job-a's parts merged and the inputs deleted (its rows only in compacted files).
    The tests only read it."""
    data_dir = tmp_path_factory.mktemp("two-jobs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)  # so garbage collection may run at once
        store = Store(data_dir)
        t0 = time.time() - 100
        _job(store, "job-a", t0)
        _job(store, "job-b", t0 + 0.5)
        assert compact_live_job(data_dir, "job-a", min_age_s=0, min_parts=2).groups > 0
        assert collect_garbage(data_dir, grace_s=0) > 0
    return data_dir


# the sampled forms of one query differ only in the sample columns they read: one level of each here
# (every level's run in test_request_sample)
_OTHER_LEVELS = {sql for sampled in (queries.JOB_LATENCY_SAMPLED, queries.JOB_OUTPUT_RATE_SAMPLED,
                                     queries.JOB_OUTSTANDING_AT_SAMPLED)
                 for level, sql in sampled.items() if level != min(sampled)}


@pytest.mark.parametrize("sql", sorted(queries.JOB_SCOPED - _OTHER_LEVELS),
                         ids=lambda s: " ".join(s.split())[:60])
def test_a_job_scoped_query_answers_the_same_over_its_jobs_parts_only(two_jobs, sql):
    t0 = time.time() - 100
    given = {**PARAMS, "job_id": "job-a", "points": [t0 + i for i in range(6)]}
    params = {k: v for k, v in given.items() if re.search(rf"\${k}\b", sql)}
    con = connect(two_jobs)
    everything = run_query(con.cursor(), sql, params).rows
    scoped = run_query(con.cursor(), sql, params, job_id="job-a").rows
    assert sorted(scoped, key=repr) == sorted(everything, key=repr)  # (job_latency's rows come in any order)
    assert everything, "the query has something to show for job-a"


def test_a_scoped_listing_holds_none_of_the_other_jobs_files(two_jobs):
    layout = Store(two_jobs).layout
    whole = store_listing.list_files(layout)
    scoped = store_listing.list_files(layout, "job-a")
    assert all(any("job-b" in p for p in whole.files[kind]) for kind in JOB_KINDS if kind != "job_events")
    assert not any("job-b" in p for kind in JOB_KINDS for p in scoped.files[kind])
    assert scoped.files["iterations"] == whole.files["iterations"]  # not a job kind
    assert scoped.files["outputs"] == [p for p in whole.files["outputs"] if "job-b" not in p]
    bad = store_listing.list_files(layout, "../job-a")  # never a path outside the store
    assert bad.files["outputs"] == [str(layout.kind_dir("outputs") / "_schema.parquet")]


def test_a_job_page_lists_only_its_jobs_parts(job_data_dir, monkeypatch):
    scopes = []
    real = store_listing.list_files
    monkeypatch.setattr(store_listing, "list_files", lambda layout, job_id=None: scopes.append(job_id)
                        or real(layout, job_id))
    client = create_app({"TESTING": True, "DATA_DIR": job_data_dir, "PAGE_CACHE_ENTRIES": 0}).test_client()
    assert client.get(f"/jobs/{JOB_ID}").status_code == 200
    assert JOB_ID in scopes
    scopes.clear()
    assert client.get("/").status_code == 200  # every job: nothing scoped
    assert scopes and set(scopes) == {None}
