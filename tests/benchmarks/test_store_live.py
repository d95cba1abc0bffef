"""`python -m benchmarks.store_live` on a tiny job, with finished jobs in the data dir before it."""

from __future__ import annotations

import json

from benchmarks import store_live
from jobs.status import jobs_status


def test_the_store_live_benchmark_times_every_query_over_a_data_dir_with_finished_jobs(tmp_path):
    data_dir, out = tmp_path / "data", tmp_path / "out.json"
    store_live.main(["--requests", "1024", "--shard-size", "256", "--finished-jobs", "2",
                     "--finished-requests", "512", "--max-s", "3", "--final-rounds", "1",
                     "--data-dir", str(data_dir), "--json", str(out)])
    report = json.loads(out.read_text())
    asked = {*store_live.dashboard_queries(), "job_request_digests", "status_all_jobs", "status_one_job"}
    assert set(report["queries"]) == asked
    assert all(row["timeouts"] == 0 for row in report["queries"].values())
    jobs = {j["job_id"]: j for j in jobs_status(str(data_dir))}
    assert {j: jobs[j]["status"] for j in ("finished-00", "finished-01")} == {"finished-00": "completed",
                                                                            "finished-01": "completed"}
    assert jobs["finished-00"]["rows_done"] == 512 and store_live.JOB_ID in jobs


def test_start_at_prefills_and_compacts_the_job_and_the_cache_starts_the_next_run_from_it(tmp_path, capsys,
                                                                                        monkeypatch):
    from jobs.store import catalog

    monkeypatch.setattr(catalog, "ACTIVATION_DELAY_S", 0.0)  # the prefill's wait before collecting
    cache, out = tmp_path / "cache", tmp_path / "out.json"
    args = ["--requests", "2048", "--shard-size", "256", "--start-at", "1.0", "--final-rounds", "1",
            "--prefill-cache", str(cache), "--json", str(out)]
    store_live.main([*args, "--data-dir", str(tmp_path / "one")])
    assert "prefilled 2,048 requests (8 shards)" in capsys.readouterr().out
    assert json.loads(out.read_text())["requests_written"] == 2048
    job = {j["job_id"]: j for j in jobs_status(str(tmp_path / "one"))}[store_live.JOB_ID]
    assert job["rows_done"] == 2048 and job["status"] == "completed"
    raw = tmp_path / "one" / "store" / "tables" / "outputs" / "raw" / store_live.JOB_ID
    assert not list(raw.glob("*.parquet"))  # merged, and the inputs collected
    kept, = cache.iterdir()
    store_live.main([*args, "--data-dir", str(tmp_path / "two")])
    assert f"data dir copied from {kept}" in capsys.readouterr().out
    job = {j["job_id"]: j for j in jobs_status(str(tmp_path / "two"))}[store_live.JOB_ID]
    assert job["rows_done"] == 2048


def test_start_at_outside_zero_to_one_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        store_live.main(["--start-at", "1.5"])
    assert "--start-at 1.5: a fraction of the job, from 0 to 1" in capsys.readouterr().err
