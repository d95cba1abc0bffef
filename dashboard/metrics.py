"""GET /metrics: the store's view of jobs, shards and workers for Prometheus.

Computed from the views on every scrape (no state in the dashboard process), under the names the
workers' metrics use (`batchgen:` prefix, jobs.metrics):

    batchgen:jobs{status}                  jobs by status (queued, running, completed, failed, cancelled)
    batchgen:shards{status}                shards by status, over every job
    batchgen:rows_committed                rows of committed shards, over every job
    batchgen:workers{state}                workers running, idle or gone (their heartbeat records)
    batchgen:job_rows{job,model}           rows of the job
    batchgen:job_rows_done{job,model}      rows finished so far (committed, or finished by a running attempt)
    batchgen:job_output_tokens{job,model}  tokens generated for those rows
    batchgen:job_error_rows{job,model}     rows that ended in an error
    batchgen:job_status{job,status}        1 for the job's status, 0 for the others
    batchgen:job_shards{job,status}        the job's shards by status

Per-job series are kept to a bounded set: every live (queued or running) job and then the newest
finished ones, METRICS_MAX_JOBS in all, so label cardinality does not grow with the data dir's history.
"""

from __future__ import annotations

from flask import Blueprint, Response, current_app
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily

from dashboard import data, queries
from dashboard.db import fetch_dicts

bp = Blueprint("metrics", __name__)

PREFIX = "batchgen:"
# Always the classic text format: prometheus_client's OpenMetrics writer turns the ':' of sample names
# into '_' (and not in HELP/TYPE), so a Prometheus asking for OpenMetrics would store batchgen_jobs.
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB_STATUSES = ("queued", "running", "completed", "failed", "cancelled")
WORKER_STATES = ("running", "idle", "gone")


class _Families:
    """What `generate_latest` needs: an object whose collect() yields metric families."""

    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


@bp.get("/metrics")
def metrics():
    jobs = _exported_jobs(current_app.config["METRICS_MAX_JOBS"])
    families = [*_fleet_families(), *_job_families(jobs)]
    return Response(generate_latest(_Families(families)), content_type=TEXT_CONTENT_TYPE)


def _exported_jobs(limit: int) -> list[data.JobSummary]:
    """Live jobs first, then the newest finished ones; `limit` in all."""
    summaries = data.job_summaries()
    live = [j for j in summaries if j.live]
    return (live + [j for j in summaries if not j.live])[:limit]


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def _fleet_families() -> list[GaugeMetricFamily]:
    jobs = _gauge("jobs", "Jobs in the data dir by status.", ["status"])
    _by_status(jobs, queries.JOB_STATUS_COUNTS)
    shards = _gauge("shards", "Shards of every job by status.", ["status"])
    _by_status(shards, queries.SHARD_STATUS_COUNTS)
    committed = fetch_dicts(queries.ROWS_COMMITTED)
    rows = GaugeMetricFamily(PREFIX + "rows_committed", "Rows of committed shards, over every job.",
                             value=committed[0]["n"] if committed else 0)
    workers = _gauge("workers", "Workers by state (gone: stopped, or heartbeat older than its TTL).",
                     ["state"])
    states = [w.state for w in data.worker_summaries()]
    for state in WORKER_STATES:
        workers.add_metric([state], states.count(state))
    return [jobs, shards, rows, workers]


def _by_status(family: GaugeMetricFamily, sql: str) -> None:
    counts = {r["status"]: r["n"] for r in fetch_dicts(sql)}
    for status in JOB_STATUSES:
        family.add_metric([status], counts.get(status, 0))


def _job_families(jobs: list[data.JobSummary]) -> list[GaugeMetricFamily]:
    per_job = {
        "job_rows": ("Rows of the job.", lambda j: j.num_requests),
        "job_rows_done": ("Rows finished so far (committed, or finished by a running attempt).",
                          lambda j: j.rows_done),
        "job_output_tokens": ("Tokens generated for the finished rows.", lambda j: j.output_tokens),
        "job_error_rows": ("Rows that ended in an error.", lambda j: j.error_rows),
    }
    families = []
    for name, (doc, value) in per_job.items():
        family = _gauge(name, doc, ["job", "model"])
        for job in jobs:
            family.add_metric([job.job_id, job.model or ""], value(job) or 0)
        families.append(family)
    status = _gauge("job_status", "1 for the job's status, 0 for the others.", ["job", "status"])
    for job in jobs:
        for s in JOB_STATUSES:
            status.add_metric([job.job_id, s], 1 if job.status == s else 0)
    return [*families, status, _job_shards(jobs)]


def _job_shards(jobs: list[data.JobSummary]) -> GaugeMetricFamily:
    family = _gauge("job_shards", "The job's shards by status.", ["job", "status"])
    ids = [j.job_id for j in jobs]
    counts = {(r["job_id"], r["status"]): r["n"]
              for r in fetch_dicts(queries.JOB_SHARD_STATUS_COUNTS, {"job_ids": ids})} if ids else {}
    for job_id in ids:
        for s in JOB_STATUSES:
            family.add_metric([job_id, s], counts.get((job_id, s), 0))
    return family
