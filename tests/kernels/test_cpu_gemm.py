"""The packed fp32/bf16 GEMMs (kernels/cpu_gemm.py): batchgen's panel kernel (csrc/gemm.c) and
oneDNN's, packed in place, and the model's use of them through kernels.ops."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.model import PRESETS, Transformer
from kernels import cpu_gemm, cpu_native, ops

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN linear ops")


# dtype -> (atol, rtol) against F.linear in the same dtype
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


PANEL_NEEDS = {torch.float32: cpu_native.FEATURE_GEMM_F32, torch.bfloat16: cpu_native.FEATURE_GEMM_BF16}


def _skip_without_panels(dtype):
    if not cpu_native.features() & PANEL_NEEDS[dtype]:
        pytest.skip(f"the panel GEMM has no {dtype} code in the {cpu_native.variant()} build "
                    "(it needs AVX2 and FMA, or AVX-512; bf16 on AVX-512 needs AVX512-BF16)")


@pytest.mark.parametrize("form", ["panels", "onednn"])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_packed_linear_matches_f_linear(rows, dtype, form, kernel_options, cpu_variant):
    if form == "onednn" and cpu_variant != cpu_native.choose():
        pytest.skip("oneDNN's packed linear is the same whichever variant of the library runs")
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=gen), torch.randn(960, 576, generator=gen)
    x, w = x.to(dtype), w.to(dtype)
    if form == "onednn":
        kernel_options(panel_gemm=False)
    else:
        _skip_without_panels(dtype)
    packed = cpu_gemm.pack(w)
    if form == "onednn" and not cpu_gemm.packs_dtype(dtype):
        assert packed is None  # stays plain (F.linear) rather than failing in oneDNN
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU (needs avx512bw/vl/dq or avx_ne_convert)")
    assert packed is not None and cpu_gemm.is_packed(packed)
    assert cpu_gemm.is_panels(packed) == (form == "panels")
    atol, rtol = TOLERANCE[dtype]
    want = F.linear(x, w)
    torch.testing.assert_close(cpu_gemm.linear(x, packed), want, atol=atol * 10, rtol=rtol)
    assert torch.equal(cpu_gemm.unpack(packed), w)  # reversible: unpack gives the weight back exactly


def _exact(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ residual) in float64, then rounded once to x's dtype: what the kernel should give
    up to its fp32 accumulation."""
    out = x.double() @ w.double().T
    if residual is not None:
        out = out + residual.double()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_kernel_every_tile_height_strided_rows_residual_and_a_partial_panel(dtype, threads,
                                                                                 cpu_variant):
    """Rows 1..40 cover every tile height (1-6) and the split of rows between threads; x is a
    strided view, `n` leaves part of the last panel unused (masked stores), and the residual is
    added in the epilogue."""
    _skip_without_panels(dtype)
    gen = torch.Generator().manual_seed(7)
    k, n_full = 96, 192
    w = (torch.randn(n_full, k, generator=gen) * 0.1).to(dtype)
    panels = cpu_gemm.pack_panels(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [*range(1, 14), 24, 31, 40]:
            wide = torch.randn(rows, k + 32, generator=gen).to(dtype)
            x = wide[:, 16:16 + k]  # rows k + 32 apart
            for n in (n_full, n_full - 37):
                got = cpu_gemm.linear_panels(x, panels, n=n)
                want = _exact(x, w[:n])
                torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2,
                                           rtol=1e-5 if dtype == torch.float32 else 8e-3)
                res = torch.randn(rows, n, generator=gen).to(dtype)
                got = cpu_gemm.linear_panels(x, panels, residual=res, n=n)
                torch.testing.assert_close(got, _exact(x, w[:n], res),
                                           atol=1e-5 if dtype == torch.float32 else 2e-2,
                                           rtol=1e-5 if dtype == torch.float32 else 8e-3)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("rows", [1, 5, 64, 131])
def test_gate_up_panels_give_silu_and_mul_in_the_epilogue(rows, dtype, cpu_variant):
    """[gate | up] packed as gate/up panels: one pass gives silu(x @ gate.T) * (x @ up.T)."""
    _skip_without_panels(dtype)
    gen = torch.Generator().manual_seed(rows)
    inter, k = 192, 80
    w = (torch.randn(2 * inter, k, generator=gen) * 0.2).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    panels = cpu_gemm.pack_gate_up(w)
    assert torch.equal(cpu_gemm.unpack_gate_up(panels), w)
    got = cpu_gemm.linear_panels(x, panels, silu=True)
    gate, up = x.double() @ w[:inter].double().T, x.double() @ w[inter:].double().T
    want = (F.silu(gate) * up).to(dtype)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    # what the unfused path gives (the GEMM's output rounded to dtype first) is within bf16's error
    torch.testing.assert_close(got, ops.silu_and_mul(F.linear(x, w)), atol=atol * 4, rtol=rtol * 4)


@pytest.mark.parametrize("threads", [1, 2])
def test_avx2_bf16_panels_give_the_fp32_kernels_sums_exactly(threads):
    """On AVX2 a bf16 product is the fp32 kernel's over the widened values, rounded once (the tiles
    widen each pair of k in registers and add k, then k + 1, as the fp32 tiles do): with a residual,
    the SiLU epilogue and fp32 logits, one tile and many, K past the tiles' 512-k blocks and not a
    multiple of 8, a partial last panel."""
    try:
        cpu_native.use("avx2")
    except ValueError as exc:
        pytest.skip(str(exc))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(11)
        k, n = 1100, 155
        w = (torch.randn(192, k, generator=gen) * 0.1).bfloat16()
        panels, panels32 = cpu_gemm.pack_panels(w), cpu_gemm.pack_panels(w.float())
        gate_up, gate_up32 = cpu_gemm.pack_gate_up(w[:128]), cpu_gemm.pack_gate_up(w[:128].float())
        for rows in (1, 6, 7, 12, 13, 40, 64):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            res = torch.randn(rows, n, generator=gen).bfloat16()
            cases = [
                (dict(n=n), dict(n=n)),
                (dict(n=n, residual=res), dict(n=n, residual=res.float())),
                (dict(n=n, out_dtype=torch.float32), dict(n=n)),
            ]
            for kw, kw32 in cases:
                got = cpu_gemm.linear_panels(x, panels, **kw)
                want = cpu_gemm.linear_panels(x.float(), panels32, **kw32).to(got.dtype)
                assert torch.equal(got, want), (rows, sorted(kw))
            got = cpu_gemm.linear_panels(x, gate_up, silu=True)
            assert torch.equal(got, cpu_gemm.linear_panels(x.float(), gate_up32, silu=True).bfloat16()), rows
    finally:
        torch.set_num_threads(before)
        cpu_native.use(None)


@pytest.mark.parametrize("inter", [96, 128])
def test_a_gate_up_layer_the_pairs_do_not_fit_keeps_its_plain_panels_unfused(inter, cpu_variant):
    """2I = 192 is a multiple of a panel (64) but not of a pair of panels: packed as plain panels, the
    layer must not be read as gate/up pairs (it was, and every 2-layer family with I = 96 went wrong)."""
    _skip_without_panels(torch.float32)
    gen = torch.Generator().manual_seed(inter)
    layer = nn.Linear(64, 2 * inter, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(2 * inter, 64, generator=gen) * 0.2)
    setattr(layer, cpu_gemm.GATE_UP, True)
    plain = layer.weight.detach().clone()
    x = torch.randn(5, 64, generator=gen)
    assert cpu_gemm.pack_linears(layer) and cpu_gemm.is_panels(layer.weight)
    assert cpu_gemm.gate_up_panels(layer) == (2 * inter % (2 * cpu_gemm.PANEL) == 0)
    torch.testing.assert_close(ops.linear_silu_and_mul(x, layer), ops.silu_and_mul(F.linear(x, plain)),
                               atol=1e-5, rtol=1e-5)
    cpu_gemm.unpack_linears(layer)
    assert torch.equal(layer.weight, plain) and not cpu_gemm.gate_up_panels(layer)


def test_model_gate_up_packs_as_pairs_and_unpacks_exactly(cpu_variant):
    _skip_without_panels(torch.float32)
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    plain = model.layers[0].mlp.gate_up_proj.weight.detach().clone()
    assert model.pack_weights()
    assert cpu_gemm.gate_up_panels(model.layers[0].mlp.gate_up_proj)
    assert not cpu_gemm.gate_up_panels(model.layers[0].mlp.down_proj)
    ops.unpack_linears(model)
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight, plain)


def test_a_build_without_simd_declines_and_packing_keeps_onednn(monkeypatch, tmp_path):
    """The library without AVX2 or AVX-512 (-mno-avx2 after the variant's flags, as a CPU older than
    Haswell gets it): its GEMM entry declines instead of running, and packing picks oneDNN (or
    nothing) for every weight."""
    from tests.kernels.test_cpu_native import _fresh_build_with

    real = shutil.which("gcc") or shutil.which("cc")
    _fresh_build_with(monkeypatch, tmp_path, "exec " + real + ' "$@" -mno-avx2\n')
    assert cpu_native.load() is not None
    assert not cpu_native.features() & (cpu_native.FEATURE_GEMM_F32 | cpu_native.FEATURE_GEMM_BF16)
    w = torch.randn(128, 64)
    assert not cpu_gemm.panels_apply(w) and not cpu_gemm.panels_apply(w.bfloat16())
    packed = cpu_gemm.pack(w)
    assert packed is None or packed.is_mkldnn
    with pytest.raises(RuntimeError, match="declined, code 2"):
        cpu_gemm.linear_panels(torch.randn(4, 64), cpu_gemm.pack_panels(w))


def test_a_build_without_amx_keeps_bf16_with_onednn_on_an_amx_cpu(monkeypatch, tmp_path):
    """The library as a compiler without AMX support builds it (-mno-amx-tile -mno-amx-bf16): no
    tiles; on a CPU that has them, bf16 weights go to oneDNN (which uses them), fp32 stays in panels."""
    from tests.kernels.test_cpu_native import _fresh_build_with

    if "amx_bf16" not in cpu_gemm.cpu_features.cpu_flags():
        pytest.skip("this CPU has no AMX: bf16 panels run vdpbf16ps whether or not the build has AMX")
    real = shutil.which("gcc") or shutil.which("cc")
    _fresh_build_with(monkeypatch, tmp_path, "exec " + real + ' "$@" -mno-amx-tile -mno-amx-bf16\n')
    assert cpu_native.load() is not None and not cpu_native.amx()
    w = torch.randn(128, 64)
    assert cpu_gemm.panels_apply(w) == bool(cpu_native.features() & cpu_native.FEATURE_AVX512)
    assert not cpu_gemm.panels_apply(w.bfloat16())
    packed = cpu_gemm.pack(w.bfloat16())
    assert packed is None or packed.is_mkldnn


def test_packing_summary_counts_each_gemm_path(cpu_variant):
    _skip_without_panels(torch.float32)
    model = Transformer(PRESETS["tiny"]).eval()
    assert cpu_gemm.packing_summary(model) == "panel GEMM 0 (SiLU fused into 0), oneDNN 0, plain 8"
    assert model.pack_weights()  # 2 layers x 4 projections in panels, the 259-row tied head in oneDNN
    assert cpu_gemm.packing_summary(model) == "panel GEMM 8 (SiLU fused into 2), oneDNN 1, plain 0"


def test_packing_summary_says_when_bf16_panels_run_on_amx(monkeypatch):
    _skip_without_panels(torch.bfloat16)
    monkeypatch.setattr(cpu_gemm, "amx_in_use", lambda: True)
    model = Transformer(PRESETS["tiny"]).eval().to(torch.bfloat16)
    model.pack_weights()  # the 259-row head: oneDNN where it packs bf16, else plain
    assert cpu_gemm.packing_summary(model).startswith("panel GEMM 8 (AMX tiles, SiLU fused into 2)")


def test_panel_kernel_keeps_nan_and_inf_in_their_rows(cpu_variant):
    _skip_without_panels(torch.float32)
    w = torch.randn(64, 32)
    x = torch.randn(8, 32)
    x[2, 5], x[6, 0] = float("nan"), float("inf")
    got = cpu_gemm.linear_panels(x, cpu_gemm.pack_panels(w))
    assert got[2].isnan().all() and not got[[0, 1, 3, 4, 5, 7]].isnan().any()
    assert not torch.isfinite(got[6]).any()
    torch.testing.assert_close(got[[0, 1, 3, 4, 5, 7]], F.linear(x, w)[[0, 1, 3, 4, 5, 7]])


def test_panel_kernel_rejects_what_does_not_fit():
    _skip_without_panels(torch.float32)
    panels = cpu_gemm.pack_panels(torch.randn(64, 32))
    with pytest.raises(ValueError, match="does not fit panels of K=32"):
        cpu_gemm.linear_panels(torch.randn(4, 48), panels)
    with pytest.raises(ValueError, match="does not fit panels"):
        cpu_gemm.linear_panels(torch.randn(4, 32).bfloat16(), panels)
    with pytest.raises(ValueError, match="must be contiguous"):
        cpu_gemm.linear_panels(torch.randn(32, 4).t(), panels)
    with pytest.raises(ValueError, match="residual"):
        cpu_gemm.linear_panels(torch.randn(4, 32), panels, residual=torch.randn(4, 63))


BOTH = cpu_native.FEATURE_GEMM_F32 | cpu_native.FEATURE_GEMM_BF16


def test_panels_take_only_what_the_kernel_has_code_for(kernel_options, monkeypatch):
    """N not a multiple of 64, an odd K in bf16, fp16, or panel_gemm off: oneDNN (or plain)."""
    monkeypatch.setattr(cpu_native, "features", lambda: BOTH)
    monkeypatch.setattr(cpu_gemm.cpu_features, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert cpu_gemm.panels_apply(torch.randn(128, 48))
    assert cpu_gemm.panels_apply(torch.randn(128, 48).bfloat16())
    assert not cpu_gemm.panels_apply(torch.randn(100, 48))  # N % 64
    assert not cpu_gemm.panels_apply(torch.randn(128, 47).bfloat16())  # odd K in pairs
    assert cpu_gemm.panels_apply(torch.randn(128, 47))  # fp32 takes any K
    assert not cpu_gemm.panels_apply(torch.randn(128, 48).half())
    monkeypatch.setattr(cpu_native, "features", lambda: cpu_native.FEATURE_GEMM_F32)  # AVX-512, no vdpbf16ps
    assert not cpu_gemm.panels_apply(torch.randn(128, 48).bfloat16())
    assert cpu_gemm.panels_apply(torch.randn(128, 48))
    monkeypatch.setattr(cpu_native, "features", lambda: cpu_native.FEATURE_AVX512)  # no GEMM code at all
    assert not cpu_gemm.panels_apply(torch.randn(128, 48))
    monkeypatch.setattr(cpu_native, "features", lambda: BOTH)
    kernel_options(panel_gemm=False)
    assert not cpu_gemm.panels_apply(torch.randn(128, 48))


def test_bf16_on_an_amx_cpu_takes_panels_only_where_they_run_on_amx(kernel_options, monkeypatch):
    """oneDNN runs AMX tiles itself: where this build's panel kernel cannot (no AMX code, Linux
    refused the tiles), bf16 stays with oneDNN unless KernelOptions(amx=False) asks for vdpbf16ps."""
    w = torch.randn(128, 64).bfloat16()
    monkeypatch.setattr(cpu_native, "features", lambda: BOTH)
    monkeypatch.setattr(cpu_gemm.cpu_features, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    monkeypatch.setattr(cpu_gemm, "amx_in_use", lambda: False)
    assert not cpu_gemm.panels_apply(w)
    assert cpu_gemm.panels_apply(w.float())  # AMX has no fp32: the panels' FMA kernel keeps it
    kernel_options(amx=False)
    assert cpu_gemm.panels_apply(w)
    kernel_options(amx=True)
    monkeypatch.setattr(cpu_gemm, "amx_in_use", lambda: True)
    assert cpu_gemm.panels_apply(w)


def _skip_without_amx():
    _skip_without_panels(torch.bfloat16)
    if not cpu_gemm.amx_in_use():
        pytest.skip("no AMX tiles here (the CPU lacks amx_bf16, the compiler AMX code, or Linux refused "
                    "the tiles): bf16 panels run vdpbf16ps, which the tests above cover")


@pytest.fixture
def vdpbf16ps(kernel_options):
    """A function that runs its argument with the AMX tiles switched off (amx=False), then switches
    them back as they were when it was called (after the `cpu_variant` fixture chose its variant)."""

    def run(fn):
        was, tiles = kernel_options().amx, cpu_gemm.amx_in_use()
        kernel_options(amx=False)
        try:
            assert not cpu_gemm.amx_in_use()
            return fn()
        finally:
            kernel_options(amx=was)
            assert cpu_gemm.amx_in_use() == tiles
    yield run
    cpu_gemm.amx_in_use()


@pytest.mark.parametrize("threads", [1, 2])
def test_amx_tiles_match_the_exact_product_and_the_vector_kernel(threads, vdpbf16ps):
    """Rows around the 16-row tile and the 32-row block (1, 15, 16, 17, 31, 33, 64) and past the
    480-row pass (481), K a multiple of 32 (the tiles) or not (then vdpbf16ps), strided rows of x, a
    partial last panel, the residual epilogue, gate/up pairs: AMX against float64 and vdpbf16ps."""
    _skip_without_amx()
    gen = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (96, 80):
            w = (torch.randn(192, k, generator=gen) * 0.1).bfloat16()
            panels = cpu_gemm.pack_panels(w)
            pairs = cpu_gemm.pack_gate_up(w)
            for rows in (1, 15, 16, 17, 31, 33, 64, 481):
                wide = torch.randn(rows, k + 32, generator=gen).bfloat16()
                x = wide[:, 16:16 + k]
                res = torch.randn(rows, 150, generator=gen).bfloat16()
                got = cpu_gemm.linear_panels(x, panels, residual=res, n=150)
                torch.testing.assert_close(got, _exact(x, w[:150], res), atol=2e-2, rtol=8e-3)
                vec = vdpbf16ps(functools.partial(cpu_gemm.linear_panels, x, panels, residual=res, n=150))
                torch.testing.assert_close(got, vec, atol=2e-2, rtol=8e-3)
                fused = cpu_gemm.linear_panels(x, pairs, silu=True)
                gate, up = x.double() @ w[:96].double().T, x.double() @ w[96:].double().T
                torch.testing.assert_close(fused, (F.silu(gate) * up).bfloat16(), atol=1e-2, rtol=1e-2)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_a_prefill_sized_product_runs_as_mm_on_the_unpacked_weight(dtype, monkeypatch, cpu_variant):
    """From unpack_rows() rows on, a plain product over panels is torch.mm on the weight unpacked for
    the call (the same numbers to the bit, a partial last panel and strided rows of x included);
    below it, and with the SiLU, residual or fp32-logits epilogues, the panel kernel runs as before."""
    _skip_without_panels(dtype)
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(192, 96, generator=gen) * 0.1).to(dtype)
    panels, pairs = cpu_gemm.pack_panels(w), cpu_gemm.pack_gate_up(w)
    x = torch.randn(40, 128, generator=gen).to(dtype)[:, 16:112]
    res = torch.randn(40, 150, dtype=dtype, generator=gen)
    monkeypatch.setattr(cpu_gemm, "unpack_rows", lambda d: None)
    kernel = {"plain": cpu_gemm.linear_panels(x, panels, n=150),
              "short": cpu_gemm.linear_panels(x[:39], panels),
              "silu": cpu_gemm.linear_panels(x, pairs, silu=True),
              "residual": cpu_gemm.linear_panels(x, panels, residual=res, n=150)}
    monkeypatch.setattr(cpu_gemm, "unpack_rows", lambda d: 40)
    assert torch.equal(cpu_gemm.linear_panels(x, panels, n=150), torch.mm(x, w[:150].t()))
    assert torch.equal(cpu_gemm.linear_panels(x[:39], panels), kernel["short"])
    assert torch.equal(cpu_gemm.linear_panels(x, pairs, silu=True), kernel["silu"])
    assert torch.equal(cpu_gemm.linear_panels(x, panels, residual=res, n=150), kernel["residual"])
    if dtype == torch.bfloat16:
        monkeypatch.setattr(cpu_gemm, "unpack_rows", lambda d: None)
        logits = cpu_gemm.linear_panels(x, panels, out_dtype=torch.float32)
        monkeypatch.setattr(cpu_gemm, "unpack_rows", lambda d: 40)
        assert torch.equal(cpu_gemm.linear_panels(x, panels, out_dtype=torch.float32), logits)


@pytest.mark.parametrize("dtype,tiles", [(torch.float32, "vector"), (torch.bfloat16, "vector"),
                                         (torch.bfloat16, "amx")])
def test_argmax_panels_picks_what_argmax_of_the_logits_picks(dtype, tiles, vdpbf16ps, kernel_options,
                                                             cpu_variant):
    """argmax_panels: each thread folds its run of panels a chunk at a time, then the threads' picks
    are folded in column order. The same picks as argmax over the whole logits, to the index, on 1, 2
    and 3 threads, for rows of every tile height and strided rows of x: with the largest logit tied
    in a later chunk of the same thread and in the last thread's run (the first wins), and with NaN
    columns in two threads' runs after the largest value (the first NaN wins, as torch.argmax
    answers); None with fused_argmax off."""
    _skip_without_panels(dtype)
    if tiles == "amx":
        _skip_without_amx()
    gen = torch.Generator().manual_seed(11)
    n, k = 160 * cpu_gemm.PANEL, 96
    assert cpu_gemm.argmax_chunk_cols(33) < 40 * cpu_gemm.PANEL  # 33 rows: several chunks a thread's run
    w = torch.randn(n, k, generator=gen) * 0.1
    w[100] *= 30  # the largest logit of most rows ...
    w[50 * cpu_gemm.PANEL + 5] = w[100]  # ... tied in a later chunk of thread 0 (of 2 or 3) ...
    w[n - 7] = w[100]  # ... and in the last thread's run: 100 wins
    panels = cpu_gemm.pack_panels(w.to(dtype))
    wide = torch.randn(33, k + 32, generator=gen).to(dtype)
    wide[0, 16:16 + k] = w[100]  # row 0's largest logit: columns 100 and its ties

    def picks():
        threads = torch.get_num_threads()
        try:
            out = []
            for nth in (1, 2, 3):
                torch.set_num_threads(nth)
                out += [(cpu_gemm.argmax_panels(wide[:rows, 16:16 + k], panels),
                         torch.argmax(cpu_gemm.linear_f32(wide[:rows, 16:16 + k], panels), dim=-1))
                        for rows in (1, 7, 16, 33)]
            return out
        finally:
            torch.set_num_threads(threads)

    for got, want in (vdpbf16ps(picks) if tiles == "vector" else picks()):
        assert got.dtype == torch.int64 and torch.equal(got, want) and got[0] == 100
    w[100 * cpu_gemm.PANEL + 3] = float("nan")  # a NaN column in the second of 2 threads' runs ...
    w[n - 3] = float("nan")  # ... and another in the last one's
    panels = cpu_gemm.pack_panels(w.to(dtype))
    for got, want in (vdpbf16ps(picks) if tiles == "vector" else picks()):
        assert torch.equal(got, want) and (got == 100 * cpu_gemm.PANEL + 3).all()
    kernel_options(fused_argmax=False)
    assert cpu_gemm.argmax_panels(wide[:, 16:16 + k], panels) is None


def test_unpack_rows_follows_the_cpu_and_the_switch(kernel_options, monkeypatch):
    """bf16 goes to mm where the panels run on AMX (oneDNN's tiles beat them at prefill sizes); fp32
    on Intel CPUs (MKL's AVX-512 code), never on AMD ones (MKL takes AVX2 there); never with
    prefill_unpack off, nor for another dtype."""
    kernel_options(prefill_unpack=True)
    for amx, vendor, bf16, fp32 in [(True, "GenuineIntel", cpu_gemm.UNPACK_ROWS, cpu_gemm.UNPACK_ROWS),
                                    (False, "GenuineIntel", None, cpu_gemm.UNPACK_ROWS),
                                    (False, "AuthenticAMD", None, None)]:
        monkeypatch.setattr(cpu_gemm, "amx_in_use", lambda amx=amx: amx)
        monkeypatch.setattr(cpu_gemm.cpu_features, "cpu_vendor", lambda vendor=vendor: vendor)
        assert (cpu_gemm.unpack_rows(torch.bfloat16), cpu_gemm.unpack_rows(torch.float32)) == (bf16, fp32)
        assert cpu_gemm.unpack_rows(torch.float16) is None
    kernel_options(prefill_unpack=False)
    monkeypatch.setattr(cpu_gemm, "amx_in_use", lambda: True)
    monkeypatch.setattr(cpu_gemm.cpu_features, "cpu_vendor", lambda: "GenuineIntel")
    assert cpu_gemm.unpack_rows(torch.bfloat16) is None and cpu_gemm.unpack_rows(torch.float32) is None


@pytest.mark.parametrize("tiles", ["amx", "vector"])
def test_bf16_logits_come_out_as_the_unrounded_fp32_accumulators(tiles, vdpbf16ps, cpu_variant):
    """out_dtype=float32: the fp32 sums as they are (within fp32 error of float64), where bf16
    output is off by bf16's rounding; the lm_head's ops.linear_logits takes that path."""
    _skip_without_panels(torch.bfloat16)
    if tiles == "amx":
        _skip_without_amx()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(320, 96, generator=gen).bfloat16()
    panels = cpu_gemm.pack_panels(w)
    for rows in (1, 17, 64):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        exact = x.double() @ w.double().T
        run = functools.partial(cpu_gemm.linear_panels, x, panels, n=300, out_dtype=torch.float32)
        got = run() if tiles == "amx" else vdpbf16ps(run)
        assert got.dtype == torch.float32 and got.shape == (rows, 300)
        torch.testing.assert_close(got.double(), exact[:, :300], atol=1e-4, rtol=1e-5)
        layer = nn.Linear(96, 320, bias=False).bfloat16()
        layer.weight = nn.Parameter(panels, requires_grad=False)
        if tiles == "amx":
            torch.testing.assert_close(ops.linear_logits(x, layer).double(), exact, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="only float32 from bf16"):
        cpu_gemm.linear_panels(x, panels, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="only float32 from bf16"):
        cpu_gemm.linear_panels(x, cpu_gemm.pack_gate_up(w[:256]), silu=True, out_dtype=torch.float32)


def test_logits_of_every_weight_form_are_float32():
    """oneDNN-packed and plain weights give linear(...).float()."""
    x, w = torch.randn(5, 64), torch.randn(128, 64)
    for dtype in (torch.float32, torch.bfloat16):
        layer = nn.Linear(64, 128, bias=False).to(dtype)
        layer.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        want = F.linear(x.to(dtype), w.to(dtype)).float()
        torch.testing.assert_close(ops.linear_logits(x.to(dtype), layer), want)
        packed = cpu_gemm.pack_onednn(w.to(dtype))
        if packed is not None:
            layer.weight = nn.Parameter(packed, requires_grad=False)
            got = ops.linear_logits(x.to(dtype), layer)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)


def test_amx_off_keeps_the_tiles_off_from_the_library_load(tmp_path):
    """With amx=False the library starts switched off: a GEMM called before anything asks
    cpu_native.amx() (no packing) runs vdpbf16ps too."""
    _skip_without_amx()
    import subprocess
    import sys

    probe = ("from kernels import cpu_native, ops; from kernels.options import KernelOptions; "
             "ops.configure(KernelOptions(amx={})); print(cpu_native.load().batchgen_amx(-1))")
    off, on = (subprocess.run([sys.executable, "-c", probe.format(amx)], capture_output=True, text=True,
                              check=True) for amx in (False, True))
    assert (off.stdout.strip(), on.stdout.strip()) == ("0", "1")


def test_amx_keeps_nan_and_inf_in_their_rows():
    _skip_without_amx()
    w = torch.randn(64, 64).bfloat16()
    x = torch.randn(20, 64).bfloat16()
    x[2, 5], x[17, 0] = float("nan"), float("inf")
    got = cpu_gemm.linear_panels(x, cpu_gemm.pack_panels(w))
    rest = [r for r in range(20) if r not in (2, 17)]
    assert got[2].isnan().all() and not got[rest].isnan().any() and not torch.isfinite(got[17]).any()
    torch.testing.assert_close(got[rest], F.linear(x, w)[rest], atol=2e-2, rtol=2e-2)


def test_packing_is_off_where_it_does_not_apply(kernel_options):
    w = torch.randn(8, 16)
    assert cpu_gemm.pack(w.half()) is None  # fp32 and bf16 only
    no_bf16_pack = frozenset({"avx", "avx2", "fma", "avx512f"})  # AVX-512 F alone is not enough
    assert not cpu_gemm.packs_dtype(torch.bfloat16, no_bf16_pack)
    assert cpu_gemm.packs_dtype(torch.float32, no_bf16_pack)
    assert cpu_gemm.packs_dtype(torch.bfloat16, no_bf16_pack | {"avx512bw", "avx512vl", "avx512dq"})
    assert cpu_gemm.packs_dtype(torch.bfloat16, no_bf16_pack | {"avx_ne_convert"})
    kernel_options(onednn=False)
    assert cpu_gemm.pack(w) is None
    x = torch.randn(3, 16)
    assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))


def test_bf16_packing_heeds_a_onednn_isa_cap(monkeypatch):
    """ONEDNN_MAX_CPU_ISA below AVX-512 (set to compare with the AVX2 kernels) leaves oneDNN no bf16
    packing on any CPU: the path is off, not an error from oneDNN."""
    avx512 = frozenset({"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    for cap, packs in (("AVX2", False), ("avx2", False), ("AVX512_CORE_BF16", True), ("", True)):
        monkeypatch.setenv(cpu_gemm.ONEDNN_ISA_ENV, cap)
        assert cpu_gemm.packs_dtype(torch.bfloat16, avx512) is packs, cap
        assert cpu_gemm.packs_dtype(torch.float32, avx512)
    monkeypatch.setenv(cpu_gemm.ONEDNN_ISA_ENV, "AVX2_VNNI_2")
    assert cpu_gemm.packs_dtype(torch.bfloat16, avx512 | {"avx_ne_convert"})
    assert not cpu_gemm.packs_dtype(torch.bfloat16, avx512)
    code = ("import torch; from kernels import cpu_gemm; "
            "print(cpu_gemm.pack_onednn(torch.randn(64, 64).bfloat16()) is None, "
            "cpu_gemm.pack_onednn(torch.randn(64, 64)) is not None or not cpu_gemm.available())")
    env = {**os.environ, cpu_gemm.ONEDNN_ISA_ENV: "AVX2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]


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
    assert model.tied_head is None and not any(cpu_gemm.is_packed(p) for p in model.parameters())


def test_model_gives_the_same_logits_packed_and_unpacked():
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    hidden = torch.randn(5, model.args.dim)
    with torch.inference_mode():
        plain = model.compute_logits(hidden)
        mlp_plain = model.layers[0].mlp(hidden)
        assert model.pack_weights()
        assert model.tied_head is not None and cpu_gemm.is_packed(model.tied_head.weight)
        assert all(cpu_gemm.is_packed(m.weight) for m in model.modules() if isinstance(m, nn.Linear))
        assert not cpu_gemm.is_packed(model.embed_tokens.weight)  # lookups still read plain rows
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
    assert projections and all(cpu_gemm.is_packed(p) for p in projections)


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
    from engine.families import read_model_args

    return read_model_args(config)


def test_bf16_on_a_cpu_without_native_bf16_runs_the_avx2_panels(monkeypatch):
    """`--dtype bfloat16` on an AVX2 CPU (no avx512_bf16, no AMX) is not refused: its weights go to
    the AVX2 panel GEMM, bf16 in memory and fp32 in registers (about fp32's speed, half its bytes),
    the SiLU fused as in fp32, not to oneDNN (which packs no bf16 there) or plain torch; `auto`
    stays fp32 on such a CPU."""
    from engine.config import EngineConfig
    from kernels import cpu_features

    try:
        cpu_native.use("avx2")
    except ValueError as exc:
        pytest.skip(str(exc))
    try:
        avx2 = frozenset("avx avx2 fma f16c bmi1 bmi2 movbe".split())
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: avx2)
        monkeypatch.delenv(cpu_features.PIN_ENV, raising=False)
        assert EngineConfig(dtype="auto").dtype == "float32"
        assert EngineConfig(dtype="bfloat16").dtype == "bfloat16"
        torch.manual_seed(0)
        model = Transformer(PRESETS["tiny"]).eval().to(torch.bfloat16)
        hidden = torch.randn(5, model.args.dim, dtype=torch.bfloat16)
        with torch.inference_mode():
            plain = model.layers[0].mlp(hidden)
            model.pack_weights()
            assert cpu_gemm.packing_summary(model).startswith("panel GEMM 8 (SiLU fused into 2), oneDNN 0")
            torch.testing.assert_close(model.layers[0].mlp(hidden), plain, atol=3e-2, rtol=3e-2)
    finally:
        cpu_native.use(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("strips", [False, True], ids=["rows", "strips"])
def test_panels_pack_and_unpack_exactly_in_either_layout(strips, dtype, monkeypatch):
    """Panels are rows of 64 columns a k (a pair of k in bf16) for the AVX-512 and AMX tiles and
    strips of 16 columns for the AVX2 ones: each layout packs, unpacks and reports its K exactly,
    plain and as gate/up pairs, and its element (panel p, column c, k) is the weight's (64 p + c, k)."""
    monkeypatch.setattr(cpu_gemm, "strips", lambda: strips)
    w = torch.arange(192 * 10, dtype=torch.float32).reshape(192, 10).to(dtype)
    panels = cpu_gemm.pack_panels(w)
    want = {(torch.float32, False): (3, 10, 64), (torch.float32, True): (3, 4, 10, 16),
            (torch.bfloat16, False): (3, 5, 64, 2), (torch.bfloat16, True): (3, 4, 5, 16, 2)}[dtype, strips]
    assert panels.shape == want and panels.is_contiguous() and cpu_gemm.in_strips(panels) == strips
    assert cpu_gemm.panel_k(panels) == 10 and torch.equal(cpu_gemm.unpack_panels(panels), w)
    for p, c, k in [(0, 0, 0), (1, 17, 3), (2, 63, 9)]:
        if dtype == torch.bfloat16:
            at = panels[p, c // 16, k // 2, c % 16, k % 2] if strips else panels[p, k // 2, c, k % 2]
        else:
            at = panels[p, c // 16, k, c % 16] if strips else panels[p, k, c]
        assert at == w[64 * p + c, k]
    assert torch.equal(cpu_gemm.unpack_gate_up(cpu_gemm.pack_gate_up(w[:128])), w[:128])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_panels_of_the_other_layout_are_refused_by_name(dtype, monkeypatch, cpu_variant):
    """Panels packed for one variant's layout and handed to a library that reads the other (use()
    switched between avx2 and avx512 after packing) would give wrong products: the products and the
    fused argmax refuse them, naming the layouts and the variant."""
    _skip_without_panels(dtype)
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(128, 40, generator=gen).to(dtype), torch.randn(5, 40, generator=gen).to(dtype)
    panels = cpu_gemm.pack_panels(w)
    assert cpu_gemm.panels_fit(panels)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(cpu_gemm.linear_panels(x, panels), F.linear(x, w), atol=atol, rtol=rtol)
    strips = cpu_gemm.strips()
    assert strips == (cpu_variant == "avx2") == cpu_gemm.in_strips(panels)
    monkeypatch.setattr(cpu_gemm, "strips", lambda: not strips)
    assert not cpu_gemm.panels_fit(panels)
    have = "strips" if strips else "rows of 64"
    match = rf"{dtype} panels packed as {have} \(.*\), while the loaded {cpu_variant} kernels read"
    with pytest.raises(ValueError, match="linear_panels: " + match):
        cpu_gemm.linear_panels(x, panels)
    with pytest.raises(ValueError, match="argmax_panels: " + match):
        cpu_gemm.argmax_panels(x, panels)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("epilogue", ["plain", "residual", "silu"])
def test_tall_row_tasks_take_k_in_chunks_and_give_the_short_tasks_sums_bit_for_bit(epilogue, threads,
                                                                                   cpu_variant):
    """A task of many rows (a prefill's) goes through K in chunks, its sums kept between them
    (csrc/gemm.c gemm_task_kblocked_f32, AVX2); each row's sum still takes its k in order, so the
    rows come out exactly as they do in calls of a few rows (short tasks, one pass over K). K = 600
    is three chunks of 200 (and 1000 four of 250); 977 rows are blocks of 480, 480 and 17 (the last
    one's tasks unblocked), row counts give uneven tiles, x's rows are strided and the last panel
    is partial."""
    _skip_without_panels(torch.float32)
    gen = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, rows in ((600, 977), (1000, 130), (600, 97)):
            n = 160 if epilogue == "silu" else 190  # silu: 5 gate/up panels; else the last panel partial
            w = torch.randn(2 * n if epilogue == "silu" else 192, k, generator=gen) * 0.05
            panels = cpu_gemm.pack_gate_up(w) if epilogue == "silu" else cpu_gemm.pack_panels(w)
            x = torch.randn(rows, k + 8, generator=gen)[:, 4:4 + k]
            res = torch.randn(rows, n, generator=gen) if epilogue == "residual" else None

            def product(lo, hi, x=x, panels=panels, n=n, res=res):
                return cpu_gemm.linear_panels(x[lo:hi], panels, n=None if epilogue == "silu" else n,
                                              residual=None if res is None else res[lo:hi].contiguous(),
                                              silu=epilogue == "silu")

            tall = product(0, rows)
            short = torch.cat([product(i, min(i + 5, rows)) for i in range(0, rows, 5)])
            assert torch.equal(tall, short), f"K={k}, {rows} rows: {(tall - short).abs().max()}"
            if epilogue == "silu":
                want = F.silu(x.double() @ w[:n].double().T) * (x.double() @ w[n:].double().T)
            else:
                want = x.double() @ w[:n].double().T + (0 if res is None else res.double())
            torch.testing.assert_close(tall, want.float(), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)
