"""Jobs pages: the list of jobs and one job's detail, with their JSON endpoints and the outputs download.

    GET /                                   jobs page (refreshes itself while a job is live)
    GET /jobs/<job_id>                      job page
    GET /jobs/<job_id>/outputs.parquet      the job's `outputs` rows as one Parquet file
    GET /api/jobs                           {"jobs": [JobSummary, ...]}
    GET /api/jobs/<job_id>                  {"job": JobSummary, "config", "shards" (the first page),
                                             "shard_counts", "shards_page", "latency", "preemptions"}
    GET /api/jobs/<job_id>/shards           ?page=&per_page=&status=: a page of shards, counts by status
    GET /api/jobs/<job_id>/iterations       engine iterations that served the job (columnar)
    GET /api/jobs/<job_id>/throughput       the job's output tokens/s over time (columnar)
    GET /api/jobs/<job_id>/latency          TTFT / ITL / e2e / queue percentiles and histograms
    GET /api/jobs/<job_id>/outputs          a sample of output rows

A job id in a URL must look like a job id (`jobs.store.layout.check_id`); anything else is a 404
before any query runs, and every query takes it as a parameter. Shards come a page at a time (the
failed and running ones first, `data.ShardPage`), so a job page's size does not grow with its shards.
"""

from __future__ import annotations

import tempfile

import duckdb
import pyarrow.parquet as pq
from flask import Blueprint, abort, current_app, jsonify, render_template, request, send_file

from dashboard import data, series
from dashboard.db import get_db
from dashboard.queries import JOB_OUTPUTS_ALL
from jobs.store import StoreError, UserSqlError, check_id, unreadable_part_message

bp = Blueprint("jobs", __name__)


def valid_job_id(job_id: str) -> str:
    try:
        return check_id("job_id", job_id)
    except StoreError as exc:
        abort(404, description=str(exc))


def existing_job(job_id: str) -> tuple[data.JobSummary, dict]:
    found = data.job_summary(valid_job_id(job_id))
    if found is None:
        abort(404, description=f"no job {job_id!r} in {current_app.config['DATA_DIR']}")
    return found


# ---------------------------------------------------------------- pages


@bp.get("/")
def index():
    jobs = data.job_summaries()
    return render_template("jobs.html", jobs=jobs, has_data_dir=get_db() is not None)


def shard_page_args(prefix: str = "") -> tuple[int, int, str | None]:
    """(page, per_page, status) from the query string (`page`, `per_page`, `status`, each after
    `prefix`); a bad value is a 400 naming the parameter and what it takes."""
    def int_arg(name: str, default: int, top: int) -> int:
        raw = request.args.get(prefix + name)
        if raw is None:
            return default
        if not raw.isdigit() or not 1 <= int(raw) <= top:
            abort(400, description=f"{prefix + name} must be an integer in [1, {top}], got {raw!r}")
        return int(raw)

    status = request.args.get(prefix + "status") or None
    if status is not None and status not in data.SHARD_STATUSES:
        allowed = ", ".join(data.SHARD_STATUSES)
        abort(400, description=f"{prefix}status must be one of {allowed}, got {status!r}")
    return (int_arg("page", 1, 10**9), int_arg("per_page", data.SHARDS_PER_PAGE, data.MAX_SHARDS_PER_PAGE),
            status)


@bp.get("/jobs/<job_id>")
def job_page(job_id: str):
    job, config = existing_job(job_id)
    page, per_page, status = shard_page_args("shards_")
    return render_template(
        "job.html", job=job, job_config=config, warning=data.job_warning(job, config),
        worker_configs=data.job_worker_configs(job.job_id),
        shard_page=data.job_shard_page(job.job_id, page, per_page, status),
        shard_statuses=data.SHARD_STATUSES,
        outputs=data.job_outputs_sample(job.job_id, current_app.config["OUTPUT_SAMPLE_ROWS"]),
        latency=series.job_latency(job.job_id),
        preemptions=data.job_preemptions(job.job_id),
    )


@bp.get("/jobs/<job_id>/outputs.parquet")
def download_outputs(job_id: str):
    """Stream the job's outputs through a temporary file (never the whole table as one buffer)."""
    job, _ = existing_job(job_id)
    db = get_db()
    spool = tempfile.TemporaryFile()
    try:
        reader = db.sql(JOB_OUTPUTS_ALL, params={"job_id": job.job_id}).to_arrow_reader()
        with pq.ParquetWriter(spool, reader.schema, compression="zstd") as writer:
            for batch in reader:
                writer.write_batch(batch)
    except duckdb.Error as exc:  # an unreadable part: the error page (503) names it and the way back
        spool.close()
        raise UserSqlError(unreadable_part_message(str(exc))) from exc
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return send_file(spool, mimetype="application/vnd.apache.parquet", as_attachment=True,
                     download_name=f"{job.job_id}.outputs.parquet")


# ---------------------------------------------------------------- JSON


@bp.get("/api/jobs")
def api_jobs():
    return jsonify(jobs=[j.as_json() for j in data.job_summaries()], data_dir_exists=get_db() is not None)


@bp.get("/api/jobs/<job_id>")
def api_job(job_id: str):
    job, config = existing_job(job_id)
    shards = data.job_shard_page(job.job_id).as_json()
    return jsonify(job=job.as_json(), config=config, warning=data.job_warning(job, config),
                   shards=shards.pop("shards"), shard_counts=shards.pop("counts"), shards_page=shards,
                   latency=series.job_latency(job.job_id), preemptions=data.job_preemptions(job.job_id))


@bp.get("/api/jobs/<job_id>/shards")
def api_job_shards(job_id: str):
    job, _ = existing_job(job_id)
    return jsonify(job_id=job.job_id, **data.job_shard_page(job.job_id, *shard_page_args()).as_json())


@bp.get("/api/jobs/<job_id>/iterations")
def api_job_iterations(job_id: str):
    job, _ = existing_job(job_id)
    return jsonify(series.job_iterations(job.job_id))


@bp.get("/api/jobs/<job_id>/throughput")
def api_job_throughput(job_id: str):
    job, _ = existing_job(job_id)
    return jsonify(series.job_output_rate(job.job_id))


@bp.get("/api/jobs/<job_id>/latency")
def api_job_latency(job_id: str):
    job, _ = existing_job(job_id)
    return jsonify(series.job_latency(job.job_id))


@bp.get("/api/jobs/<job_id>/outputs")
def api_job_outputs(job_id: str):
    job, _ = existing_job(job_id)
    rows = data.job_outputs_sample(job.job_id, current_app.config["OUTPUT_SAMPLE_ROWS"])
    return jsonify(job_id=job.job_id, outputs=rows)
