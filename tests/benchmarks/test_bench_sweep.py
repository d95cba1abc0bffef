"""batchgen bench and sweep end to end on the tiny random model (numbers are not asserted on speed)."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from benchmarks.sweep import find_knee, first_slo_breach, parse_values, sweep
from benchmarks.throughput import BenchResult, _print, bench, make_workload, percentile
from engine.config import EngineConfig
from jobs.store import connect

TINY = ["--model", "tiny-random", "--num-kv-blocks", "256", "--block-size", "4"]


def test_workload_is_seeded_and_in_range():
    a = make_workload(20, (3, 9), (2, 5), 100, seed=7, shared_prefix=4)
    b = make_workload(20, (3, 9), (2, 5), 100, seed=7, shared_prefix=4)
    assert a == b
    assert all(7 <= len(p) <= 13 and p[:4] == a.prompts[0][:4] for p in a.prompts)
    assert all(2 <= n <= 5 for n in a.output_lens)


def test_percentile_interpolates():
    assert percentile([], 50) == 0.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5


def test_knee_and_slo():
    curve = [(1, 100.0, 0.01), (4, 300.0, 0.02), (16, 310.0, 0.05), (64, 312.0, 0.2)]
    assert find_knee(curve, 0.05) == 4
    assert find_knee(curve, 0.01) == 16
    assert find_knee(curve, 0.001) == 64  # never flattens enough: the largest tried
    assert first_slo_breach(curve, 0.03) == 16
    assert first_slo_breach(curve, 1.0) is None


def test_parse_values_rejects_bad_lists():
    assert parse_values("16, 4,4", "--x") == [4, 16]
    for bad in ("", "a,b", "0,4"):
        with pytest.raises(click.BadParameter) as info:
            parse_values(bad, "--x")
        assert repr(bad) in info.value.format_message()


def test_bench_json_counts_every_token():
    result = CliRunner().invoke(bench, TINY + ["--num-requests", "6", "--prompt-len", "3-12",
                                               "--output-len", "2-6", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the JSON alone: log lines (the engine's INFO ones) go to stderr
    engine = report["results"][0]
    wl = make_workload(6, (3, 12), (2, 6), 259, seed=0)
    assert engine["output_tokens"] == wl.output_tokens and engine["prompt_tokens"] == wl.prompt_tokens
    assert engine["output_tokens_per_s"] > 0 and 0 < engine["mfu"] < 5 and report["gemm_peak_flops"] > 0
    sampled = report["results"][1]  # the sampled default beside greedy: the same tokens, counted alike
    assert sampled["name"] == "batchgen-t1" and sampled["output_tokens"] == wl.output_tokens
    ratio = sampled["output_tokens_per_s"] / engine["output_tokens_per_s"]
    assert report["ratios"]["batchgen-t1"]["rounds"] == [ratio]


def test_bench_constrained_share_runs_plain_and_constrained_and_reports_the_cost(capsys):
    args = ["--num-requests", "4", "--prompt-len", "3-8", "--output-len", "6", "--constrained-share", "0.5",
            "--greedy-only"]
    result = CliRunner().invoke(bench, TINY + args + ["--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    plain, constrained = report["results"]
    assert (plain["num_constrained"], plain["mask_fill_s"]) == (0, 0.0)
    assert constrained["name"] == "constrained-0.5" and constrained["num_constrained"] == 2
    assert constrained["mask_fill_s"] > 0 and constrained["output_tokens"] <= plain["output_tokens"] == 24
    results = [BenchResult(**r) for r in report["results"]]
    _print(results, report["gemm_peaks"], make_workload(4, (3, 8), (6, 6), 259), as_json=False,
           config=EngineConfig())
    assert "structured output: 2 of 4 requests constrained cost" in capsys.readouterr().out


def test_bench_rejects_a_bad_range():
    result = CliRunner().invoke(bench, TINY + ["--prompt-len", "9-3"])
    assert result.exit_code == 2 and "--prompt-len" in result.output


def test_sweep_records_rows_in_the_sweeps_view(tmp_path):
    result = CliRunner().invoke(sweep, TINY + [
        "--num-requests", "6", "--prompt-len", "3-12", "--output-len", "2-6",
        "--max-num-seqs-values", "1,4", "--max-num-batched-tokens-values", "8,32", "--repeats", "2",
        "--itl-slo-ms", "1000", "--data-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "knee (max_num_seqs)" in result.output and "knee (max_num_batched_tokens)" in result.output
    assert "machine: " in result.output and " CPUs; flags: " in result.output
    rows = connect(tmp_path).execute(
        "SELECT swept, max_num_seqs, max_num_batched_tokens, repeat, output_tokens_per_s, mean_running "
        "FROM sweeps ORDER BY swept, max_num_seqs, max_num_batched_tokens, repeat").fetchall()
    assert len(rows) == 8
    held = EngineConfig()  # the swept knob moves, the other stays at its default
    assert {(r[0], r[1], r[2]) for r in rows} == {
        ("max_num_seqs", 1, held.max_num_batched_tokens), ("max_num_seqs", 4, held.max_num_batched_tokens),
        ("max_num_batched_tokens", held.max_num_seqs, 8), ("max_num_batched_tokens", held.max_num_seqs, 32)}
    assert all(r[4] > 0 for r in rows)
    assert all(r[5] <= 1.0 for r in rows if r[0] == "max_num_seqs" and r[1] == 1)
