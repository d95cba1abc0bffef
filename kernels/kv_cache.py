"""Store this step's new keys and values into the paged KV cache: Triton kernel, launcher, torch
reference."""

from __future__ import annotations

import torch


def store_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value (T, Hkv, D) into caches (num_blocks, block_size, Hkv, D) at flat slots
    slot_mapping (T,) = block_id * block_size + offset; slot -1 means do not store."""
    num_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k = k_cache.view(-1, num_heads, head_dim)
    flat_v = v_cache.view(-1, num_heads, head_dim)
    keep = slot_mapping >= 0
    if bool(keep.all()):
        flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
        return
    slots = slot_mapping[keep]
    flat_k.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value[keep].to(v_cache.dtype))
