"""Attention for prefill and chunked prefill over the paged KV cache (a varlen batch of query
chunks, decodes included as chunks of one): Triton kernel, launcher, torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """q (T, Hq, D) holds the query chunks of sequences 0..S-1 back to back -> (T, Hq, D).

    Sequence s has query_lens[s] new tokens at positions context_lens[s] - query_lens[s] ..
    context_lens[s] - 1, already stored in the cache; token i attends to cached keys 0 ..
    its own position. One SDPA per sequence over its gathered keys with a bottom-right aligned
    causal mask (`is_causal` alone is top-left aligned, wrong when the chunk is shorter).
    """
    out = torch.empty_like(q)
    start = 0
    for seq, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        end = start + q_len
        keys, values = _gather_context(k_cache, v_cache, block_tables[seq], ctx_len)  # (Hkv, L, D)
        queries = q[start:end].transpose(0, 1)  # (Hq, q_len, D)
        out[start:end] = _causal_sdpa(queries, keys, values, scale).transpose(0, 1)
        start = end
    return out


def _gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ctx_len cached keys and values, each (Hkv, ctx_len, D)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    blocks = block_table[: -(-ctx_len // block_size)]
    keys = k_cache[blocks].view(-1, num_kv_heads, head_dim)[:ctx_len]
    values = v_cache[blocks].view(-1, num_kv_heads, head_dim)[:ctx_len]
    return keys.transpose(0, 1), values.transpose(0, 1)


def _causal_sdpa(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """queries (Hq, q_len, D) are the last q_len positions of the ctx_len keys (Hkv, ctx_len, D)."""
    q_len, ctx_len = queries.shape[1], keys.shape[1]
    if q_len == ctx_len:  # whole prompt: top-left and bottom-right alignment coincide
        return F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    if q_len == 1:  # the last position sees every key
        return F.scaled_dot_product_attention(queries, keys, values, scale=scale, enable_gqa=True)
    query_pos = torch.arange(ctx_len - q_len, ctx_len, device=queries.device)
    key_pos = torch.arange(ctx_len, device=queries.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # (q_len, ctx_len)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
