"""What the families added to the kernels, against their references: sliding-window attention (the
torch references against a per-token loop; the Triton kernels against the references, with every
key outside a query's window poisoned with NaN so a kernel that reads one fails loudly), Gemma's
(1 + w) RMSNorm and the GELU-tanh gate."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.activation import gelu_tanh_and_mul_ref
from kernels.attention_decode import paged_decode_attention_ref
from kernels.attention_prefill import paged_prefill_attention_ref
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.testing import make_paged_inputs
from tests.kernels.cases import DTYPES, assert_close

HEAD_DIM = 32
WINDOWS = [1, 3, 8, 17, 1000]  # 1000: longer than every context
# (query_lens, context_lens), decodes first: chunks at the start and in the middle of their prompt
BATCH = ([1, 1, 1, 9, 5, 16], [1, 9, 40, 9, 30, 33])


def _poison_before_windows(inputs, window: int) -> None:
    """NaN into every cached key and value that no query of its sequence may see (before the window of
    the sequence's first query), so reading one poisons the output."""
    meta, block_size = inputs.meta, inputs.k_cache.shape[1]
    for seq, (q_len, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu, strict=True)):
        for pos in range(max(ctx - q_len - window + 1, 0)):
            block = int(meta.block_tables[seq, pos // block_size])
            inputs.k_cache[block, pos % block_size] = float("nan")
            inputs.v_cache[block, pos % block_size] = float("nan")


def _naive(inputs, window: int) -> torch.Tensor:
    """Per query token: softmax over the keys at positions p - window + 1 .. p of its sequence."""
    meta, block_size = inputs.meta, inputs.k_cache.shape[1]
    group = inputs.q.shape[1] // inputs.k_cache.shape[2]
    out, row = torch.empty_like(inputs.q), 0
    for seq, (q_len, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu, strict=True)):
        for p in range(ctx - q_len, ctx):
            keys = range(max(p - window + 1, 0), p + 1)
            slots = [(int(meta.block_tables[seq, k // block_size]), k % block_size) for k in keys]  # (L,)
            k = torch.stack([inputs.k_cache[b, o] for b, o in slots]).repeat_interleave(group, 1)
            v = torch.stack([inputs.v_cache[b, o] for b, o in slots]).repeat_interleave(group, 1)
            scores = torch.einsum("hd,lhd->hl", inputs.q[row].float(), k.float()) * inputs.scale
            weights = torch.softmax(scores, -1)
            out[row] = torch.einsum("hl,lhd->hd", weights, v.float()).to(out.dtype)
            row += 1
    return out


def _reference(inputs, window: int) -> torch.Tensor:
    meta, nd = inputs.meta, inputs.meta.num_decodes
    caches = (inputs.k_cache, inputs.v_cache)
    decodes = paged_decode_attention_ref(inputs.q[:nd], *caches, meta.block_tables[:nd],
                                         meta.context_lens[:nd], inputs.scale, window)
    lens = (meta.query_lens_cpu[nd:], meta.context_lens_cpu[nd:])
    chunks = paged_prefill_attention_ref(inputs.q[nd:], *caches, meta.block_tables[nd:], *lens, inputs.scale,
                                         window)
    return torch.cat([decodes, chunks])


@pytest.mark.parametrize("window", WINDOWS)
def test_window_references_equal_the_per_token_loop(window):
    inputs = make_paged_inputs(*BATCH, 4, 2, HEAD_DIM, 4, seed=window)
    assert_close(_reference(inputs, window), _naive(inputs, window), torch.float32)


def test_a_window_changes_the_result_only_past_its_length():
    inputs = make_paged_inputs(*BATCH, 4, 2, HEAD_DIM, 4)
    full = _reference(inputs, None)
    assert torch.equal(_reference(inputs, 1000), full)
    assert not torch.allclose(_reference(inputs, 3), full)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_paged_attention_with_a_window_on_the_cpu(backend, window):
    """The C kernels have no window: ops routes a windowed layer to the torch references."""
    inputs = make_paged_inputs(*BATCH, 4, 2, HEAD_DIM, 4, seed=window)
    want = _reference(inputs, window)
    ops.set_backend(backend)
    try:
        got = ops.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.scale, window)
    finally:
        ops.set_backend(None)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_decode_attention_with_a_window(window, num_splits, dtype):
    pytest.importorskip("triton")
    from kernels.attention_decode import paged_decode_attention_triton

    batch = ([1, 1, 1, 1], [1, 9, 40, 17], 4, 1, HEAD_DIM, 8, dtype)
    clean = make_paged_inputs(*batch, seed=1)
    inputs = make_paged_inputs(*batch, seed=1, garbage=float("nan"))
    _poison_before_windows(inputs, window)
    meta = inputs.meta
    want = paged_decode_attention_ref(clean.q, clean.k_cache, clean.v_cache, meta.block_tables,
                                      meta.context_lens, inputs.scale, window)
    got = paged_decode_attention_triton(inputs.q, inputs.k_cache, inputs.v_cache, meta.block_tables,
                                        meta.context_lens, inputs.scale, num_splits=num_splits, window=window)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_prefill_attention_with_a_window(window, dtype):
    pytest.importorskip("triton")
    from kernels.attention_prefill import paged_prefill_attention_triton

    want = _reference(make_paged_inputs(*BATCH, 4, 2, HEAD_DIM, 4, dtype, seed=2), window)
    inputs = make_paged_inputs(*BATCH, 4, 2, HEAD_DIM, 4, dtype, seed=2, garbage=float("nan"))
    _poison_before_windows(inputs, window)
    meta = inputs.meta
    ops.set_backend("triton")  # a mixed step: decodes through the decode kernel, chunks the prefill one
    try:
        got = ops.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, meta, inputs.scale, window)
    finally:
        ops.set_backend(None)
    assert_close(got, want, dtype)
    only_chunks = paged_prefill_attention_triton(
        inputs.q[meta.num_decodes:], inputs.k_cache, inputs.v_cache, meta.block_tables[meta.num_decodes:],
        meta.prefill_query_start_loc, meta.context_lens[meta.num_decodes:], meta.max_query_len, inputs.scale,
        window=window)
    assert_close(only_chunks, want[meta.num_decodes:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unit_offset_rms_norm_reference_is_gemmas(dtype):
    """transformers' Gemma3RMSNorm: normalise in fp32, times (1 + w) in fp32, cast once."""
    x, w = torch.randn(5, 48).to(dtype), (torch.randn(48) * 0.1).to(dtype)
    x32 = x.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(dtype)
    assert torch.equal(rms_norm_ref(x, w, 1e-6, unit_offset=True), want)
    assert not torch.equal(rms_norm_ref(x, w, 1e-6), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_unit_offset_rms_norm(dtype):
    pytest.importorskip("triton")
    from kernels.rms_norm import rms_norm_triton

    x, residual = torch.randn(7, 96).to(dtype), torch.randn(7, 96).to(dtype)
    w = (torch.randn(96) * 0.1).to(dtype)
    assert_close(rms_norm_triton(x, w, 1e-6, unit_offset=True)[0], rms_norm_ref(x, w, 1e-6, True), dtype)
    out, res = rms_norm_triton(x, w, 1e-6, residual, unit_offset=True)
    want_out, want_res = fused_add_rms_norm_ref(x, residual, w, 1e-6, unit_offset=True)
    assert_close(out, want_out, dtype)
    assert_close(res, want_res, dtype)


def test_the_cpu_declines_unit_offset_norms_and_gelu_to_the_references():
    x, residual, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64) * 0.1
    assert torch.equal(ops.rms_norm(x, w, 1e-6, unit_offset=True), rms_norm_ref(x, w, 1e-6, True))
    got = ops.fused_add_rms_norm(x, residual, w, 1e-6, unit_offset=True)
    assert all(torch.equal(a, b) for a, b in zip(got, fused_add_rms_norm_ref(x, residual, w, 1e-6, True),
                                                 strict=True))
    gate_up = torch.randn(4, 64) * 4
    assert torch.equal(ops.gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_ref(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_gelu_tanh_and_mul(dtype):
    pytest.importorskip("triton")
    from kernels.activation import gelu_tanh_and_mul_triton

    gate_up = (torch.randn(6, 2 * 80) * 30).to(dtype)  # large gates: the exponent's clamp is exercised
    assert_close(gelu_tanh_and_mul_triton(gate_up), gelu_tanh_and_mul_ref(gate_up), dtype)
