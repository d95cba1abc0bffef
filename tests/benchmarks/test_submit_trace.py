"""`bench submit-scale --trace-rss`: a submit's memory phase by phase (benchmarks/submit_trace.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.submit_scale import submit_child, write_prompts

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["start", "shards", "id check", "manifest", "job record", "queued events", "messages", "end"]


def test_a_traced_submit_reports_every_phase_in_order(tmp_path):
    source = tmp_path / "in.parquet"
    write_prompts(source, 3_000, row_group_rows=1_000)
    run = submit_child(source, tmp_path / "data", 250, ROOT, trace=["--trim"])
    assert run["rc"] == 0, run["err"]
    trace = run["trace"]
    # every function the trace wraps still exists under its name: a renamed one would drop its phase
    assert [p["phase"] for p in trace["phases"]] == PHASES, trace["wrapped"]
    by_name = {p["phase"]: p for p in trace["phases"]}
    assert by_name["messages"]["calls"] == 12 and by_name["shards"]["calls"] == 1  # 12 shards, 1 file
    for p in trace["phases"]:
        assert 0 < p["rss_in"] <= p["rss_max"] and p["rss_out"] <= p["rss_max"], p
        assert p["rss_out"] <= p["hwm_out"], p
        if trace["glibc"]:
            assert p["heap_in_use"] > 0 and "trim_gave_back" in p, p
    assert trace["arrow_pool"] == "system"  # as `batchgen submit` runs (jobs.cli.set_arrow_allocator)
    assert not (tmp_path / "data.trace.json").exists()
