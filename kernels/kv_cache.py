"""Store this step's new keys and values into the paged KV cache: Triton kernel, launcher, torch
reference."""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels._triton import tl, triton


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,  # (T, Hkv, D) new keys, head dim contiguous
    value_ptr,  # (T, Hkv, D) new values, head dim contiguous
    k_cache_ptr,  # (num_blocks, block_size, Hkv, D) contiguous key cache
    v_cache_ptr,  # (num_blocks, block_size, Hkv, D) contiguous value cache
    slot_mapping_ptr,  # (T,) int64 flat slot per token; -1 = do not store
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program per token t: cache[slot_mapping[t]] = key/value[t] (every head), unless the slot is -1.

    A contiguous cache puts flat slot s at element offset s * Hkv * D, whatever the block size.
    """
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    stored_heads = tl.where(slot >= 0, num_kv_heads, 0)  # slot -1 stores nothing
    mask = (heads < stored_heads) & (dims < HEAD_DIM)  # (BLOCK_H, D)
    key = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + heads * value_head_stride + dims, mask=mask)
    cache_offset = slot * num_kv_heads * HEAD_DIM + heads * HEAD_DIM + dims
    tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch one program per new token."""
    _check_store(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens:
        _store_kv_cache_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), num_kv_heads,
            HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        )


def _check_store(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.dim() != 3 or value.shape != key.shape or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"store_kv_cache: key and value must be (T, Hkv, D) with a contiguous head dim, "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.shape[2:] != key.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv_cache: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not hold "
                         f"(Hkv, D) = {tuple(key.shape[1:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv_cache: the Triton kernel needs contiguous caches")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"store_kv_cache: slot_mapping must be ({key.shape[0]},) int64, "
                         f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")


def store_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value (T, Hkv, D) into caches (num_blocks, block_size, Hkv, D) at flat slots
    slot_mapping (T,) = block_id * block_size + offset; slot -1 means do not store.

    Nothing here reads a device value on the host (no `.all()` test, no boolean indexing), so on a
    GPU it costs no sync: each token with slot -1 is sent to the first token that stores, with that
    token's slot and rows, so the duplicate writes agree whatever their order; when no token stores,
    all go to slot 0 with the rows slot 0 already holds."""
    num_tokens, num_heads, head_dim = key.shape[0], k_cache.shape[2], k_cache.shape[3]
    if num_tokens == 0:
        return
    keep = slot_mapping >= 0  # (T,)
    first = keep.to(torch.int32).argmax()  # the first token that stores (0 when none does)
    source = torch.where(keep, torch.arange(num_tokens, device=keep.device), first)  # (T,) token to copy
    slots = slot_mapping.index_select(0, source).clamp(min=0)
    none = ~keep.any()  # () on the device
    for cache, rows in ((k_cache, key), (v_cache, value)):
        flat = cache.view(-1, num_heads, head_dim)  # (slots, Hkv, D)
        new = rows.index_select(0, source).to(cache.dtype)
        flat.index_copy_(0, slots, torch.where(none, flat.index_select(0, slots), new))


def store_kv_cache_native(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value (T, Hkv, D) into k_cache/v_cache (num_blocks, block_size, Hkv, D) at flat slots
    slot_mapping (T,); slot -1 skips. Rows may be strided (views of the qkv GEMM's output)."""
    rows, heads, dim = key.shape
    for name, x in (("key", key), ("value", value)):
        if x.stride(2) != 1 or x.stride(1) != dim:
            raise ValueError(f"native store_kv_cache: {name} needs contiguous heads and head dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("native store_kv_cache: caches must be contiguous and of one shape")
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if not key.dtype == value.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"native store_kv_cache: key {key.dtype}, value {value.dtype} and caches "
                         f"{k_cache.dtype} must share one dtype")
    size = key.element_size()
    bad = cpu_native.library().store_kv_cache(
        key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size, k_cache.data_ptr(),
        v_cache.data_ptr(), slots.data_ptr(), rows, heads * dim * size, num_slots)
    if bad:
        raise IndexError(f"store_kv_cache: token {bad - 1} has slot {int(slots[bad - 1])}, outside the "
                         f"cache's {num_slots} slots")
