"""The in-place RoPE Triton kernel against its torch reference."""

import pytest
import torch

from tests.kernels.cases import DTYPES, HEAD_DIM, HEADS, assert_close, require_triton

require_triton()

from kernels.rotary import make_cos_sin_cache, rotary_embedding_ref, rotary_embedding_triton  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("positions", [[0], [0, 1, 15, 16, 17, 99, 3]])
def test_rotary_embedding(positions, num_q_heads, num_kv_heads, dtype):
    gen = torch.Generator().manual_seed(len(positions))
    positions = torch.tensor(positions, dtype=torch.int64)
    q = torch.randn(len(positions), num_q_heads, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(len(positions), num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    cache = make_cos_sin_cache(HEAD_DIM, 128, 10000.0, dtype, "cpu")
    want_q, want_k = rotary_embedding_ref(positions, q.clone(), k.clone(), cache)
    q_out, k_out = rotary_embedding_triton(positions, q, k, cache)
    assert q_out is q and k_out is k  # rotated in place
    assert_close(q, want_q, dtype)
    assert_close(k, want_k, dtype)


def test_rotary_embedding_on_views_of_a_fused_qkv():
    """The model may pass q and k as strided views into one (T, (Hq + 2 Hkv) * D) projection."""
    qkv = torch.randn(5, (9 + 2 * 3) * HEAD_DIM)
    q = qkv[:, : 9 * HEAD_DIM].view(5, 9, HEAD_DIM)
    k = qkv[:, 9 * HEAD_DIM : 12 * HEAD_DIM].view(5, 3, HEAD_DIM)
    positions = torch.tensor([4, 0, 7, 7, 31])
    cache = make_cos_sin_cache(HEAD_DIM, 32, 10000.0, torch.float32, "cpu")
    want_q, want_k = rotary_embedding_ref(positions, q.clone(), k.clone(), cache)
    untouched = qkv[:, 12 * HEAD_DIM :].clone()
    rotary_embedding_triton(positions, q, k, cache)
    assert_close(q, want_q, torch.float32)
    assert_close(k, want_k, torch.float32)
    assert torch.equal(qkv[:, 12 * HEAD_DIM :], untouched)  # the values next to k are left alone
