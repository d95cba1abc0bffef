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
