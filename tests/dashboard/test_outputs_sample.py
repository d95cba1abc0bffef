"""The job page's sample of outputs reads only the first committed shards' rows (`_bg.outputs_of_shards`)."""

from __future__ import annotations

import pytest

from dashboard import create_app, data
from jobs.store import Store, UserSqlError, connect
from jobs.store.schemas import JobRecord

JOB = "sampled-outputs"


def _job(data_dir, committed: set[int], shards: int = 5, per_shard: int = 10) -> None:
    store = Store(data_dir)
    store.record_job(JobRecord(JOB, "tiny", shards * per_shard, shards, 1000.0))
    for shard in range(shards):
        att = store.begin_attempt(JOB, shard, 1, "w", num_requests=per_shard)
        att.add_outputs([{"request_id": str(shard * per_shard + i), "output_text": f"out {shard}-{i}",
                          "finish_reason": "stop", "prompt_tokens": 1, "output_tokens": 2, "error": None}
                         for i in range(per_shard)])
        att.flush()
        if shard in committed:
            att.commit()


def _sample(data_dir, limit: int) -> list[dict]:
    app = create_app({"TESTING": True, "DATA_DIR": data_dir, "PAGE_CACHE_ENTRIES": 0})
    with app.app_context():
        return data.job_outputs_sample(JOB, limit)


@pytest.mark.parametrize("limit", [1, 15, 25, 100])
def test_the_sample_is_the_first_committed_rows_as_the_whole_view_orders_them(tmp_path, limit):
    _job(tmp_path, committed={1, 2, 4})  # shards 0 and 3 still running: their rows are not outputs
    want = connect(tmp_path).execute(
        "SELECT request_id, output_text FROM outputs WHERE job_id = ? "
        "ORDER BY TRY_CAST(request_id AS BIGINT), request_id LIMIT ?", [JOB, limit]).fetchall()
    got = [(row["request_id"], row["output_text"]) for row in _sample(tmp_path, limit)]
    assert got == want and len(got) == min(limit, 30)


def test_no_committed_shard_no_sample(tmp_path):
    _job(tmp_path, committed=set())
    assert _sample(tmp_path, 20) == []


def test_the_sample_over_unreadable_outputs_names_the_file(tmp_path):
    _job(tmp_path, committed={0, 1})
    part = sorted((tmp_path / "store" / "tables" / "outputs").rglob(f"{JOB}~s000001~*.parquet"))[0]
    part.write_bytes(b"not parquet")
    with pytest.raises(UserSqlError, match=part.name):
        _sample(tmp_path, 20)


def test_outputs_of_shards_holds_those_shards_committed_rows_only(tmp_path):
    _job(tmp_path, committed={0, 1, 2, 4})
    con = connect(tmp_path)
    rows = con.execute("SELECT request_id FROM _bg.outputs_of_shards(?, 1, 3) ORDER BY request_id::INT",
                       [JOB]).fetchall()
    assert [int(r[0]) for r in rows] == list(range(10, 30))  # shards 1 and 2; shard 3 is not committed
    view = con.execute("SELECT * FROM outputs WHERE job_id = ? AND request_id::INT BETWEEN 10 AND 29 "
                       "ORDER BY request_id::INT", [JOB]).fetchall()
    assert con.execute("SELECT * FROM _bg.outputs_of_shards(?, 1, 3) ORDER BY request_id::INT",
                       [JOB]).fetchall() == view
    assert con.execute("SELECT count(*) FROM _bg.outputs_of_shards('other-job', 0, 9)").fetchone() == (0,)
