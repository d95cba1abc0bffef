"""Workers page: each worker seen in the iteration telemetry.

    GET /workers         its engine limits and config, last heartbeat, current shards, recent tokens/s
    GET /api/workers     {"workers": [WorkerSummary, ...], "recent_window_s": ...}
"""

from __future__ import annotations

from flask import Blueprint, jsonify, render_template

from dashboard import data

bp = Blueprint("workers", __name__)


@bp.get("/workers")
def workers_page():
    return render_template("workers.html", workers=data.worker_summaries(),
                           recent_window_s=data.RECENT_WINDOW_S, stale_s=data.HEARTBEAT_STALE_S)


@bp.get("/api/workers")
def api_workers():
    return jsonify(workers=[w.as_json() for w in data.worker_summaries()],
                   recent_window_s=data.RECENT_WINDOW_S, heartbeat_stale_s=data.HEARTBEAT_STALE_S)
