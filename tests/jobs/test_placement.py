"""Data parallel on one host: the placement code that `batchgen run --workers N` and `batchgen worker
--device` run, on the CPU with the visible GPU count mocked (the real placement code, not a copy)."""

from __future__ import annotations

import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import jobs.placement as placement
from engine.config import EngineConfig
from jobs.cli import cli
from jobs.local_run import LocalRun
from jobs.metrics import _info_labels
from jobs.placement import PlacementError, check_device, place_workers
from tests.jobs.helpers import MODEL


def test_workers_spread_over_the_visible_gpus():
    two = lambda: 2  # noqa: E731
    assert place_workers("cuda", 4, two) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert place_workers("cuda", 2, two) == ["cuda:0", "cuda:1"]  # one engine per GPU
    assert place_workers("cuda", 1, lambda: 8) == ["cuda:0"]
    assert place_workers("cuda:1", 3, two) == ["cuda:1"] * 3  # a named GPU takes every worker
    assert place_workers("cpu", 3, two) == ["cpu"] * 3  # the CPU: every worker stays on cpu


def test_a_device_the_host_does_not_have_is_refused_naming_the_flag():
    with pytest.raises(PlacementError, match=r"--device cuda:7: this host has 2 CUDA device\(s\), cuda:0 to"):
        place_workers("cuda:7", 2, lambda: 2)
    with pytest.raises(PlacementError, match="--device cuda: no CUDA device is visible"):
        place_workers("cuda", 2, lambda: 0)
    with pytest.raises(PlacementError, match="--device cuda:2"):
        check_device("cuda:2", lambda: 2)
    check_device("cuda:1", lambda: 2)
    check_device("cpu", lambda: 0)  # never asks for GPUs


def _prompts(tmp_path) -> str:
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), path)
    return str(path)


def test_run_hands_each_worker_its_device(tmp_path, monkeypatch):
    """`batchgen run --workers 3 --device cuda` on a host with 2 GPUs: the workers' command lines
    say --device cuda:0, cuda:1, cuda:0 (LocalRun starts them; Popen is replaced)."""
    monkeypatch.setattr(placement, "visible_gpus", lambda: 2)
    started = []

    class Proc:
        def __init__(self, cmd, **kwargs):
            started.append(cmd)

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Proc)
    monkeypatch.setattr(LocalRun, "run", lambda self: [self._start(i) for i in range(self.num_workers)] and 0)
    result = CliRunner().invoke(cli, ["run", _prompts(tmp_path), "--model", MODEL, "--data-dir",
                                      str(tmp_path / "data"), "--workers", "3", "--device", "cuda"])
    assert result.exit_code == 0, result.output
    devices = [cmd[cmd.index("--device") + 1] for cmd in started]
    assert devices == ["cuda:0", "cuda:1", "cuda:0"]


@pytest.mark.parametrize("command", ["run", "worker"])
def test_run_and_worker_refuse_a_gpu_past_the_last(tmp_path, monkeypatch, command):
    monkeypatch.setattr(placement, "visible_gpus", lambda: 2)
    args = [_prompts(tmp_path), "--model", MODEL, "--workers", "2"] if command == "run" else []
    result = CliRunner().invoke(cli, [command, *args, "--data-dir", str(tmp_path / "data"),
                                      "--device", "cuda:7"])
    assert result.exit_code == 2, result.output
    assert "--device cuda:7: this host has 2 CUDA device(s)" in result.output
    assert not (tmp_path / "data" / "jobs").exists()  # refused before any job was made


def test_a_workers_device_is_in_its_record_and_its_metrics_labels():
    from jobs.broker import BrokerSettings
    from jobs.worker_main import _record

    config = EngineConfig(model=MODEL, device="cuda:1")
    record = _record(config, BrokerSettings("embedded", "embedded", "q", 60.0), "w1", 2)
    assert record.device == "cuda:1" and record.engine_config["device"] == "cuda:1"
    assert _info_labels(config)["device"] == "cuda:1"


def test_on_a_host_without_cuda_a_cuda_device_is_refused_before_any_worker_starts(tmp_path):
    """The real GPU count of this host (none in CI): `run --device cuda` is a usage error."""
    if placement.visible_gpus():
        pytest.skip("this host has a GPU")
    result = CliRunner().invoke(cli, ["run", _prompts(tmp_path), "--model", MODEL, "--data-dir",
                                      str(tmp_path / "data"), "--device", "cuda"])
    assert result.exit_code == 2 and "--device cuda: no CUDA device is visible" in result.output
