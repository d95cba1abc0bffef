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


def test_a_path_far_too_slow_for_the_peak_is_timed_from_one_call(monkeypatch):
    """torch.mm in bf16 on a CPU without native bf16 runs at ~2 GFLOP/s: one call of its first shape
    gives its rate, and its other shapes are not run (they held a bf16 bench for minutes)."""
    import time

    calls = []

    def slow_mm(a, b):
        calls.append(a.shape)
        time.sleep(0.05)
        return a.new_empty(a.shape[0], b.shape[1])

    monkeypatch.setattr(torch, "mm", slow_mm)
    peaks = measure_gemm_peaks("float32", "cpu", seconds=0.01)
    assert calls == [torch.Size([1024, 1024])]
    assert 0 < peaks["torch.mm"] <= 2 * 1024 ** 3 / 0.05


def test_the_gemm_comparison_script_measures_every_path(capsys, monkeypatch):
    rates = {"F.linear": 1e9, "oneDNN packed": 2e9, "panels": 3e9}
    monkeypatch.setattr(gemm, "flops_per_s", lambda m, k, n, path, seconds=0.3, dtype=None, cpu_time=False:
                        rates[path])
    gemm.main([])
    lines = capsys.readouterr().out.splitlines()
    assert "oneDNN packed GF/s" in lines[1] and "panels GF/s" in lines[1]
    assert lines[3].split() == ["64x576x960", "float32", "1", "2", "3"]
    assert ["64x576x960", "bfloat16", "1", "2", "3"] in [line.split() for line in lines]


def test_the_gemm_comparison_runs_the_variant_and_shapes_it_is_given(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(gemm, "flops_per_s", lambda m, k, n, path, seconds=0.3, dtype=None, cpu_time=False:
                        seen.append((m, k, n, seconds, cpu_time, cpu_native.variant())) or 1e9)
    variant = cpu_native.runnable()[0]  # the plainest this CPU runs, not the one it picks
    threads = torch.get_num_threads()
    try:
        gemm.main(["--variant", variant, "--shape", "5x32x64", "--seconds", "0.01", "--threads", "1",
                   "--cpu-time"])
    finally:
        cpu_native.use(None)
        torch.set_num_threads(threads)
    assert f"panels on the {variant} variant, 1 thread(s), GF/s over CPU time" in capsys.readouterr().out
    assert set(seen) == {(5, 32, 64, 0.01, True, variant)}


def test_cpu_time_rates_count_the_calling_threads_work():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rate = gemm.flops_per_s(64, 256, 256, "F.linear", seconds=0.05, cpu_time=True)
    finally:
        torch.set_num_threads(threads)
    assert rate > 0


@pytest.mark.parametrize("argv, named", [(["--shape", "64x576"], "--shape '64x576'"),
                                         (["--shape", "0x1x1"], "--shape '0x1x1'"),
                                         (["--threads", "0"], "--threads 0"),
                                         (["--cpu-time"], "--cpu-time needs --threads 1")])
def test_the_gemm_comparison_names_a_bad_argument(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        gemm.main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("path", list(gemm.PATHS))
def test_each_compared_path_measures_or_says_it_does_not_apply(path):
    rate = gemm.flops_per_s(8, 16, 64, path, seconds=0.01)
    applies = path == "F.linear" or gemm.PATHS[path](torch.randn(64, 16)) is not None
    assert (rate > 0) == applies


def test_the_gemm_comparison_refuses_a_variant_this_cpu_cannot_run(capsys):
    missing = [v for v in cpu_native.VARIANTS if v not in cpu_native.runnable()]
    if not missing:
        pytest.skip("this CPU runs every variant")
    try:
        with pytest.raises(SystemExit) as e:
            gemm.main(["--variant", missing[-1]])
    finally:
        cpu_native.use(None)
    assert e.value.code == 2 and f"--variant {missing[-1]}: this CPU cannot run" in capsys.readouterr().err
