"""Paged attention for decode (one query token per sequence, GQA, online softmax): Triton kernel,
launcher, torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
) -> torch.Tensor:
    """q (S, Hq, D), one token per sequence, attends to its context_lens[s] cached keys -> (S, Hq, D).

    Vectorised across sequences: gather every sequence's blocks into (S, L, Hkv, D) with L the
    longest context rounded up to whole blocks, mask positions past each context length, and run
    one batched SDPA with grouped query heads.
    """
    num_seqs, _, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_context_len // block_size)
    tables = block_tables[:num_seqs, :num_blocks]  # (S, nb)
    keys = k_cache[tables].view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)  # (S, Hkv, L, D)
    values = v_cache[tables].view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    key_pos = torch.arange(keys.shape[2], device=q.device)
    valid = (key_pos[None, :] < context_lens[:num_seqs, None]).view(num_seqs, 1, 1, -1)  # (S, 1, 1, L)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=valid, scale=scale, enable_gqa=True
    )  # (S, Hq, 1, D)
    return out.squeeze(2)
