"""`batchgen bench <benchmark>`: the lab plugs into the CLI through pyproject's `batchgen.commands`
entry points (as the dashboard does), lists its benchmarks without importing torch, and hands an
argparse benchmark its arguments as they are."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from benchmarks.cli import BENCHMARKS, bench
from jobs import cli as jobs_cli

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return project["project"]["entry-points"][jobs_cli.ENTRY_POINT_GROUP]


@pytest.fixture
def plugged(monkeypatch):
    """jobs.cli seeing the entry points pyproject.toml declares (the venv's installed copy may predate
    them until `make setup` reinstalls)."""
    points = [EntryPoint(name, value, jobs_cli.ENTRY_POINT_GROUP) for name, value in _declared().items()]
    monkeypatch.setattr("importlib.metadata.entry_points",
                        lambda group=None: [p for p in points if group in (None, p.group)])


def test_pyproject_plugs_bench_and_sweep_in_and_jobs_does_not_name_them():
    declared = _declared()
    assert declared["bench"] == "benchmarks.cli:bench" and declared["sweep"] == "benchmarks.sweep:sweep"
    for value in declared.values():
        module, attr = value.split(":")
        assert isinstance(getattr(importlib.import_module(module), attr), click.Command), value
    assert not any(target.startswith("benchmarks") for target in jobs_cli.COMMANDS.values())


def test_every_benchmark_resolves_to_a_command():
    for name, (target, _) in BENCHMARKS.items():
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
        assert isinstance(bench.get_command(click.Context(bench), name), click.Command), name
    assert bench.get_command(click.Context(bench), "nope") is None


def test_bench_help_lists_every_benchmark_without_importing_torch():
    code = ("import sys; from click.testing import CliRunner; from benchmarks.cli import bench; "
            "r = CliRunner().invoke(bench, ['--help']); print(r.output); "
            "assert r.exit_code == 0; assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in BENCHMARKS:
        assert f"  {name} " in proc.stdout, name


def test_batchgen_bench_throughput_through_the_cli(plugged):
    result = CliRunner().invoke(jobs_cli.cli, ["bench", "throughput", "--help"])
    assert result.exit_code == 0, result.output
    assert "--baseline" in result.output and "--log-format" in result.output
    assert "Usage: cli bench throughput" in result.output
    assert "--log-format" in CliRunner().invoke(jobs_cli.cli, ["sweep", "--help"]).output


def test_an_argparse_benchmark_gets_its_arguments_as_they_are(plugged):
    result = CliRunner().invoke(jobs_cli.cli, ["bench", "store", "--help"])
    assert result.exit_code == 0, result.output
    assert "usage: batchgen bench store" in result.output and "--requests" in result.output
    bad = CliRunner().invoke(jobs_cli.cli, ["bench", "store", "--no-such-flag"])
    assert bad.exit_code == 2 and "--no-such-flag" in bad.output


def test_an_unknown_benchmark_is_refused_by_name(plugged):
    result = CliRunner().invoke(jobs_cli.cli, ["bench", "nope"])
    assert result.exit_code == 2 and "No such command 'nope'" in result.output
