"""oneDNN packed fp32/bf16 GEMMs (kernels/cpu_gemm.py), packed in place, and the model's use of them
through kernels.ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.bench import measure_gemm_peaks
from engine.model import PRESETS, Transformer
from kernels import cpu_gemm, ops

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN linear ops")


# dtype -> (atol, rtol) against F.linear in the same dtype
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_packed_linear_matches_f_linear(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=gen), torch.randn(960, 576, generator=gen)
    x, w = x.to(dtype), w.to(dtype)
    packed = cpu_gemm.pack(w)
    if not cpu_gemm.packs_dtype(dtype):
        assert packed is None  # stays plain (F.linear) rather than failing in oneDNN
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU (needs avx512bw/vl/dq or avx_ne_convert)")
    assert packed is not None and cpu_gemm.is_packed(packed)
    atol, rtol = TOLERANCE[dtype]
    want = F.linear(x, w)
    torch.testing.assert_close(cpu_gemm.linear(x, packed), want, atol=atol * 10, rtol=rtol)
    assert torch.equal(packed.to_dense(), w)  # reversible: unpack gives the weight back exactly


def test_packing_is_off_where_it_does_not_apply(monkeypatch):
    w = torch.randn(8, 16)
    assert cpu_gemm.pack(w.half()) is None  # fp32 and bf16 only
    no_bf16_pack = frozenset({"avx", "avx2", "fma", "avx512f"})  # AVX-512 F alone is not enough
    assert not cpu_gemm.packs_dtype(torch.bfloat16, no_bf16_pack)
    assert cpu_gemm.packs_dtype(torch.float32, no_bf16_pack)
    assert cpu_gemm.packs_dtype(torch.bfloat16, no_bf16_pack | {"avx512bw", "avx512vl", "avx512dq"})
    assert cpu_gemm.packs_dtype(torch.bfloat16, no_bf16_pack | {"avx_ne_convert"})
    monkeypatch.setenv(cpu_gemm.ENV_SWITCH, "0")
    assert cpu_gemm.pack(w) is None
    x = torch.randn(3, 16)
    assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))


def test_pack_linears_swaps_weights_in_place_and_back():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=True))
    plain = layers[0].weight.detach().clone()
    assert cpu_gemm.pack_linears(layers)  # every bias-free one; a biased one stays plain
    assert cpu_gemm.is_packed(layers[0].weight) and not cpu_gemm.is_packed(layers[1].weight)  # bias: kept
    x = torch.randn(4, 16)
    torch.testing.assert_close(ops.linear(x, layers[0]), F.linear(x, plain), atol=1e-5, rtol=1e-5)
    cpu_gemm.unpack_linears(layers)
    assert torch.equal(layers[0].weight, plain)


def test_torch_backend_packs_nothing():
    model = Transformer(PRESETS["tiny"]).eval()
    ops.set_backend("torch")
    try:
        assert not model.pack_weights()
    finally:
        ops.set_backend(None)
    assert model.tied_head is None and not any(p.is_mkldnn for p in model.parameters())


def test_model_gives_the_same_logits_packed_and_unpacked():
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    hidden = torch.randn(5, model.args.dim)
    with torch.inference_mode():
        plain = model.compute_logits(hidden)
        mlp_plain = model.layers[0].mlp(hidden)
        assert model.pack_weights()
        assert model.tied_head is not None and model.tied_head.weight.is_mkldnn
        assert all(m.weight.is_mkldnn for m in model.modules() if isinstance(m, nn.Linear))
        assert not model.embed_tokens.weight.is_mkldnn  # lookups still read plain rows
        torch.testing.assert_close(model.compute_logits(hidden), plain, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(model.layers[0].mlp(hidden), mlp_plain, atol=1e-4, rtol=1e-5)


def test_packing_is_in_place_no_second_copy():
    model = Transformer(PRESETS["tiny"]).eval()
    before = {id(m): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    assert model.pack_weights()
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m) in before:
            assert m.weight is not before[id(m)]  # the module holds only the packed tensor now
    projections = [p for n, p in model.named_parameters() if "proj" in n]
    assert projections and all(p.is_mkldnn for p in projections)


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
    monkeypatch.setattr(cpu_gemm, "flops_per_s",
                        lambda m, k, n, packed, seconds=0.3, dtype=None: 2e9 if packed else 1e9)
    cpu_gemm.main()
    lines = capsys.readouterr().out.splitlines()
    assert "oneDNN packed GF/s" in lines[0] and lines[2].split() == ["64x576x960", "float32", "1", "2"]
    assert ["64x576x960", "bfloat16", "1", "2"] in [line.split() for line in lines]
    assert cpu_gemm.flops_per_s(8, 16, 16, True, seconds=0.01) > 0
    assert cpu_gemm.flops_per_s(8, 16, 16, False, seconds=0.01) > 0
