"""oneDNN packed fp32 GEMMs (kernels/cpu_gemm.py) and the model's use of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.bench import measure_gemm_peaks
from engine.model import PRESETS, Linear, Transformer
from kernels import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_packed_linear_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=gen), torch.randn(960, 576, generator=gen)
    packed = cpu_gemm.pack(w)
    assert packed is not None and packed.is_mkldnn
    torch.testing.assert_close(cpu_gemm.linear(x, w, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_packing_is_off_where_it_does_not_apply(monkeypatch):
    w = torch.randn(8, 16)
    assert cpu_gemm.pack(w.half()) is None  # fp32 only
    monkeypatch.setenv(cpu_gemm.ENV_SWITCH, "0")
    assert cpu_gemm.pack(w) is None
    x = torch.randn(3, 16)
    assert torch.equal(cpu_gemm.linear(x, w, None), F.linear(x, w))


def test_model_gives_the_same_logits_packed_and_unpacked(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    hidden = torch.randn(5, model.args.dim)
    with torch.inference_mode():
        plain = model.compute_logits(hidden)
        mlp_plain = model.layers[0].mlp(hidden)
        assert model.pack_weights()
        assert model.tied_head_packed is not None
        assert all(m.packed is not None for m in model.modules() if isinstance(m, Linear))
        torch.testing.assert_close(model.compute_logits(hidden), plain, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(model.layers[0].mlp(hidden), mlp_plain, atol=1e-4, rtol=1e-5)
        monkeypatch.setenv(cpu_gemm.ENV_SWITCH, "0")
        assert not model.pack_weights()  # switched off: back to F.linear everywhere
        assert model.tied_head_packed is None


def test_gemm_peak_counts_the_path_the_engine_runs():
    peaks = measure_gemm_peaks("float32", "cpu", seconds=0.2)
    assert set(peaks) == {"torch.mm", "onednn-packed"} and min(peaks.values()) > 0


def test_loading_new_weights_repacks():
    from tests.engine.tiny import tiny_hf_checkpoint

    first, second = tiny_hf_checkpoint(seed=0), tiny_hf_checkpoint(seed=1)
    model = Transformer(_args(first.config)).eval()
    model.load_hf_weights(first.weights)
    assert model.pack_weights()
    model.load_hf_weights(second.weights)
    hidden = torch.randn(3, model.args.dim)
    with torch.inference_mode():
        got = model.compute_logits(hidden)  # untied lm_head, through its packed copy
    want = F.linear(hidden, second.weights["lm_head.weight"])
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def _args(config):
    from engine.model import ModelArgs

    return ModelArgs.from_hf_config(config)


def test_the_gemm_comparison_script_measures_both_paths(capsys, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "flops_per_s", lambda m, k, n, packed, seconds=0.3: 2e9 if packed else 1e9)
    cpu_gemm.main()
    lines = capsys.readouterr().out.splitlines()
    assert "oneDNN packed GF/s" in lines[0] and lines[2].split() == ["128x576x960", "1", "2"]
    assert cpu_gemm.flops_per_s(8, 16, 16, True, seconds=0.01) > 0
    assert cpu_gemm.flops_per_s(8, 16, 16, False, seconds=0.01) > 0
