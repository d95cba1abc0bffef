"""The GEMM benchmarks: `batchgen bench gemm` (every CPU GEMM path at the model's shapes) and the
GEMM peak that MFU is taken against (benchmarks.throughput.measure_gemm_peaks)."""

import pytest
import torch

from benchmarks import gemm
from benchmarks.throughput import measure_gemm_peaks
from kernels import cpu_gemm, cpu_native

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN linear ops")


def test_gemm_peak_counts_the_paths_the_engine_runs():
    peaks = measure_gemm_peaks("float32", "cpu", seconds=0.2)
    panels = cpu_native.features() & cpu_native.FEATURE_GEMM_F32
    want = {"torch.mm", "onednn-packed"} | ({"panels"} if panels else set())
    assert set(peaks) == want and min(peaks.values()) > 0


def test_the_gemm_comparison_script_measures_every_path(capsys, monkeypatch):
    rates = {"F.linear": 1e9, "oneDNN packed": 2e9, "panels": 3e9}
    monkeypatch.setattr(gemm, "flops_per_s", lambda m, k, n, path, seconds=0.3, dtype=None: rates[path])
    gemm.main([])
    lines = capsys.readouterr().out.splitlines()
    assert "oneDNN packed GF/s" in lines[0] and "panels GF/s" in lines[0]
    assert lines[2].split() == ["64x576x960", "float32", "1", "2", "3"]
    assert ["64x576x960", "bfloat16", "1", "2", "3"] in [line.split() for line in lines]


@pytest.mark.parametrize("path", list(gemm.PATHS))
def test_each_compared_path_measures_or_says_it_does_not_apply(path):
    rate = gemm.flops_per_s(8, 16, 64, path, seconds=0.01)
    applies = path == "F.linear" or gemm.PATHS[path](torch.randn(64, 16)) is not None
    assert (rate > 0) == applies
