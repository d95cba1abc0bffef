"""The KV-cache store Triton kernel against its torch reference."""

import pytest
import torch

from kernels.testing import make_paged_inputs
from tests.kernels.cases import BLOCK_SIZES, DTYPES, HEAD_DIM, HEADS, require_triton

require_triton()

from kernels.kv_cache import store_kv_cache_ref, store_kv_cache_triton  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_store_kv_cache(num_q_heads, num_kv_heads, block_size, dtype):
    inputs = make_paged_inputs([1, 1, 15, 17], [16, 100, 15, 40], num_q_heads, num_kv_heads, HEAD_DIM,
                               block_size, dtype)
    slots = inputs.meta.slot_mapping.clone()
    slots[[1, 7]] = -1  # e.g. padding tokens
    want_k, want_v = torch.zeros_like(inputs.k_cache), torch.zeros_like(inputs.v_cache)
    store_kv_cache_ref(inputs.key, inputs.value, want_k, want_v, slots)
    k_cache, v_cache = torch.zeros_like(inputs.k_cache), torch.zeros_like(inputs.v_cache)
    store_kv_cache_triton(inputs.key, inputs.value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # a copy is exact


def test_store_kv_cache_from_strided_views_and_casts_to_the_cache_dtype():
    inputs = make_paged_inputs([3], [3], 9, 3, HEAD_DIM, 16)
    kv = torch.stack([inputs.key, inputs.value], dim=1)  # (T, 2, Hkv, D): key and value are strided views
    k_cache = torch.zeros(inputs.k_cache.shape, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    store_kv_cache_triton(kv[:, 0], kv[:, 1], k_cache, v_cache, inputs.meta.slot_mapping)
    slots = inputs.meta.slot_mapping
    assert torch.equal(k_cache.view(-1, 3, HEAD_DIM)[slots], inputs.key.half())
    assert torch.equal(v_cache.view(-1, 3, HEAD_DIM)[slots], inputs.value.half())


def test_store_kv_cache_rejects_int32_slots():
    inputs = make_paged_inputs([2], [2], 8, 1, HEAD_DIM, 16)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        store_kv_cache_triton(inputs.key, inputs.value, inputs.k_cache, inputs.v_cache,
                              inputs.meta.slot_mapping.int())


@pytest.mark.parametrize("skipped", [[], [0], [1, 3], [0, 1, 2, 3]], ids=["none", "first", "some", "all"])
def test_store_kv_cache_ref_skips_slot_minus_one_without_a_host_read(skipped):
    """The reference redirects skipped tokens instead of testing `keep.all()` on the host (a sync on
    a GPU): every stored slot holds its token's rows and every other slot keeps its value, also when
    the first stored token writes slot 0, the target of the redirect when nothing stores."""
    gen = torch.Generator().manual_seed(len(skipped))
    key, value = torch.randn(4, 2, HEAD_DIM, generator=gen), torch.randn(4, 2, HEAD_DIM, generator=gen)
    slots = torch.tensor([0, 9, 5, 17])
    slots[skipped] = -1
    k_cache = torch.randn(3, 8, 2, HEAD_DIM, generator=gen)
    v_cache = torch.randn(3, 8, 2, HEAD_DIM, generator=gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):  # the per-token specification
        if slot >= 0:
            want_k.view(-1, 2, HEAD_DIM)[slot], want_v.view(-1, 2, HEAD_DIM)[slot] = key[t], value[t]
    store_kv_cache_ref(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
