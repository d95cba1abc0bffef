"""`python -m benchmarks.profile_step` on the tiny random model: it reports the step split and op table."""

from __future__ import annotations

from click.testing import CliRunner

from benchmarks.profile_step import main


def test_profile_step_reports_the_outside_share_and_top_ops():
    result = CliRunner().invoke(main, ["--model", "tiny-random", "--num-kv-blocks", "64", "--num-seqs", "3",
                                       "--prompt-len", "5", "--steps", "2", "--top", "5"])
    assert result.exit_code == 0, result.output
    assert "3 sequences" in result.output and "outside the model's forward" in result.output
    assert "Self CPU" in result.output  # the profiler's table
