"""The torch references (the CPU production path) against naive per-token float64 loops."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.testing import make_paged_inputs
from tests.kernels import naive
from tests.kernels.cases import ATTENTION_BATCHES, HEADS, TOLERANCES

# decodes whose contexts differ enough that the torch path splits them into groups, then a chunk
SPREAD_DECODES = ([1, 1, 1, 1, 1, 4], [300, 40, 1, 200, 35, 20])


@pytest.fixture(autouse=True, params=["cpu-native", "torch"])
def torch_backend(request):
    """These tests are about the CPU path, whatever the kernel options say: once through the
    cpu-native backend (C kernels for fp32, torch where they do not apply), once pure torch."""
    ops.set_backend(request.param)
    yield
    ops.set_backend(None)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 576), (33, 100)])
def test_rms_norm_matches_loop(num_tokens, hidden, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weight = (1 + torch.randn(hidden, generator=gen) / 10).to(dtype)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6).double(), naive.rms_norm(x, weight, 1e-6),
                               atol=atol, rtol=rtol)
    out, residual_out = ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual_out, x + residual)
    torch.testing.assert_close(out.double(), naive.rms_norm(x + residual, weight, 1e-6), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_rotary_matches_loop_and_is_in_place(num_q_heads, num_kv_heads, dtype):
    gen = torch.Generator().manual_seed(num_q_heads)
    positions = torch.tensor([0, 1, 15, 16, 17, 99, 3], dtype=torch.int64)
    q = torch.randn(len(positions), num_q_heads, 64, generator=gen).to(dtype)
    k = torch.randn(len(positions), num_kv_heads, 64, generator=gen).to(dtype)
    want_q, want_k = naive.rotary(positions, q, 10000.0), naive.rotary(positions, k, 10000.0)
    cache = ops.make_cos_sin_cache(64, 128, 10000.0, dtype, "cpu")
    q_out, k_out = ops.rotary_embedding(positions, q, k, cache)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    atol, rtol = TOLERANCES[dtype]
    atol = max(atol, 4e-3 if dtype == torch.float16 else 0)  # the fp16 cache itself is rounded
    torch.testing.assert_close(q.double(), want_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k.double(), want_k, atol=atol, rtol=rtol)


def test_cos_sin_cache_and_rms_norm_match_transformers_llama():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                               rope_theta=100000.0, max_position_embeddings=256)
    positions = torch.arange(200)[None]
    x = torch.randn(1, 200, 9, 64)
    cos, sin = llama.LlamaRotaryEmbedding(config)(x, positions)  # (1, 200, 64) each
    q_hf, _ = llama.apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    cache = ops.make_cos_sin_cache(64, 256, 100000.0, torch.float32, "cpu")
    q, _ = ops.rotary_embedding(positions[0], x[0].clone(), x[0, :, :3].clone(), cache)
    torch.testing.assert_close(q, q_hf.transpose(1, 2)[0], atol=1e-6, rtol=1e-6)
    norm = llama.LlamaRMSNorm(576, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    h = torch.randn(5, 576)
    torch.testing.assert_close(ops.rms_norm(h, norm.weight.detach(), 1e-5), norm(h).detach())


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("num_tokens,inter", [(1, 8), (5, 1536), (17, 33)])
def test_silu_and_mul_matches_loop(num_tokens, inter, dtype):
    x = torch.randn(num_tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(ops.silu_and_mul(x).double(), naive.silu_and_mul(x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_cache_writes_slots_and_skips_minus_one(block_size):
    inputs = make_paged_inputs([1, 5, 17], [16, 5, 40], 9, 3, 64, block_size)
    k_cache, v_cache = torch.zeros_like(inputs.k_cache), torch.zeros_like(inputs.v_cache)
    slots = inputs.meta.slot_mapping.clone()
    slots[3] = -1
    ops.store_kv_cache(inputs.key, inputs.value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 3, 64), v_cache.view(-1, 3, 64)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], inputs.key[t]) and torch.equal(flat_v[slot], inputs.value[t])
    written = slots[slots >= 0]
    assert int((flat_k.abs().sum((1, 2)) != 0).sum()) == len(written)  # nothing else was touched


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("batch", [*ATTENTION_BATCHES, "spread_decodes"])
def test_paged_attention_matches_loop(batch, num_q_heads, num_kv_heads, block_size, dtype):
    query_lens, context_lens = SPREAD_DECODES if batch == "spread_decodes" else ATTENTION_BATCHES[batch]
    inputs = make_paged_inputs(query_lens, context_lens, num_q_heads, num_kv_heads, 64, block_size, dtype,
                               garbage=7.0)  # slots outside every context must not be read
    out = ops.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.scale)
    want = naive.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta.block_tables.tolist(),
                                 query_lens, context_lens, inputs.scale)
    atol, rtol = TOLERANCES[dtype]
    assert out.shape == inputs.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)


def test_spread_decodes_are_planned_in_groups_once_per_step():
    ops.set_backend("torch")  # the plan belongs to the pure torch path
    query_lens, context_lens = SPREAD_DECODES
    inputs = make_paged_inputs(query_lens, context_lens, 9, 3, 64, 16)
    ops.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.scale)
    plan = inputs.meta.torch_decode_plan
    assert [group.seqs.tolist() for group in plan] == [[0, 3], [1, 4, 2]]
    ops.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.meta, inputs.scale)
    assert inputs.meta.torch_decode_plan is plan  # the next layer reuses it
