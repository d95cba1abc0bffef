"""Sweeps page: throughput against TTFT and ITL for every configuration `batchgen sweep` measured.

    GET /sweeps          one pair of charts and a table per sweep, to pick an operating region
    GET /api/sweeps      {"sweeps": {sweep_id: [configuration, ...]}} (repeats averaged)
"""

from __future__ import annotations

from flask import Blueprint, jsonify, render_template

from dashboard import data

bp = Blueprint("sweeps", __name__)


@bp.get("/sweeps")
def sweeps_page():
    return render_template("sweeps.html", sweeps=data.sweep_configurations())


@bp.get("/api/sweeps")
def api_sweeps():
    return jsonify(sweeps=data.sweep_configurations())
