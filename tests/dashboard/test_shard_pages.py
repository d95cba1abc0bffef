"""A job's shards a page at a time: the failed and running ones first, counts by status, and a job
page whose size does not grow with the job's shard count."""

from __future__ import annotations

import re
import time

import pytest

from dashboard import create_app
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent
from tests.dashboard.conftest import as_json

JOB = "many-shards"
FAILED, RUNNING, COMPLETED = (7, 250, 260), (3, 120), (0, 1, 2)


def _job(data_dir, num_shards: int) -> None:
    """A job of `num_shards` shards: a few failed, running and completed, the rest queued."""
    store = Store(data_dir)
    t0 = time.time() - 60
    store.record_job(JobRecord(JOB, "smollm2-135m", num_shards * 10, num_shards, t0, "{}"))
    store.record_shard_events([ShardEvent(JOB, s, "queued", t0, num_requests=10) for s in range(num_shards)])
    for shard in FAILED + RUNNING + COMPLETED:
        attempt = store.begin_attempt(JOB, shard, 1, f"worker-{shard % 2}", num_requests=10)
        if shard in FAILED:
            attempt.fail(f"shard {shard} broke")
        elif shard in COMPLETED:
            attempt.commit()


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("many-shards") / "data"
    _job(data_dir, 350)
    return create_app({"TESTING": True, "DATA_DIR": data_dir}).test_client()


def test_the_job_api_lists_the_first_page_failed_and_running_first(many):
    body = as_json(many.get(f"/api/jobs/{JOB}"))
    assert body["shard_counts"] == {"failed": 3, "running": 2, "completed": 3, "queued": 342}
    ids = [s["shard_id"] for s in body["shards"]]
    assert len(ids) == 100
    assert ids[:5] == [7, 250, 260, 3, 120]  # failed, then running, each by id
    assert ids[5:] == sorted(set(range(350)) - set(FAILED + RUNNING))[:95]
    assert body["shards_page"] == {"status": None, "page": 1, "per_page": 100, "total": 350, "pages": 4}


def test_pages_cover_every_shard_once(many):
    seen = []
    for page in range(1, 5):
        body = as_json(many.get(f"/api/jobs/{JOB}/shards?page={page}"))
        assert body["page"] == page and body["pages"] == 4
        seen += [s["shard_id"] for s in body["shards"]]
    assert sorted(seen) == list(range(350)) and len(seen) == 350
    assert as_json(many.get(f"/api/jobs/{JOB}/shards?page=5"))["shards"] == []


def test_a_status_narrows_the_list(many):
    body = as_json(many.get(f"/api/jobs/{JOB}/shards?status=failed&per_page=2"))
    assert [s["shard_id"] for s in body["shards"]] == [7, 250]
    assert (body["total"], body["pages"]) == (3, 2)
    assert [s["error"] for s in body["shards"]] == ["shard 7 broke", "shard 250 broke"]


@pytest.mark.parametrize("query, names", [
    ("page=0", "page"), ("page=x", "page"), ("per_page=1001", "per_page"), ("per_page=-1", "per_page"),
    ("status=lost", "status"),
])
def test_a_bad_page_parameter_is_a_400_naming_it(many, query, names):
    response = many.get(f"/api/jobs/{JOB}/shards?{query}")
    assert response.status_code == 400
    assert response.get_json()["error"].startswith(names + " must be")
    page = many.get(f"/jobs/{JOB}?shards_{query}")
    assert page.status_code == 400 and f"shards_{names} must be" in page.get_data(as_text=True)


def test_the_job_page_shows_counts_one_page_and_a_pager(many):
    html = many.get(f"/jobs/{JOB}").get_data(as_text=True)
    assert len(re.findall(r'<tr data-shard-id="', html)) == 100
    assert 'data-status="failed"' in html and "queued 342" in html
    assert 'rel="next"' in html and "page 1 of 4" in html
    last = many.get(f"/jobs/{JOB}?shards_page=4").get_data(as_text=True)
    assert len(re.findall(r'<tr data-shard-id="', last)) == 50 and 'rel="prev"' in last
    failed = many.get(f"/jobs/{JOB}?shards_status=failed").get_data(as_text=True)
    assert re.findall(r'<tr data-shard-id="(\d+)"', failed) == ["7", "250", "260"]


def test_page_and_api_sizes_do_not_grow_with_the_shard_count(tmp_path):
    sizes = {}
    for n in (400, 4000):
        data_dir = tmp_path / f"d{n}"
        _job(data_dir, n)
        client = create_app({"TESTING": True, "DATA_DIR": data_dir}).test_client()
        sizes[n] = (len(client.get(f"/jobs/{JOB}").data), len(client.get(f"/api/jobs/{JOB}").data))
    # ten times the shards: the same rows on the page, only a few digits more in counts and totals
    assert abs(sizes[4000][0] - sizes[400][0]) < 200, sizes
    assert abs(sizes[4000][1] - sizes[400][1]) < 200, sizes
