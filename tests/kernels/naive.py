"""Naive per-token implementations in float64: the references are tested against these."""

from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        row = x[t].double()
        out[t] = row / math.sqrt(float((row * row).sum()) / row.numel() + eps) * weight.double()
    return out


def rotary(positions: torch.Tensor, x: torch.Tensor, rope_theta: float) -> torch.Tensor:
    """Rotate each pair (i, i + D/2) of every head by the angle pos * theta^(-2i/D)."""
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    out = x.double().clone()
    for t in range(num_tokens):
        for i in range(half):
            angle = int(positions[t]) * rope_theta ** (-2.0 * i / head_dim)
            c, s = math.cos(angle), math.sin(angle)
            for h in range(num_heads):
                a, b = float(x[t, h, i]), float(x[t, h, i + half])
                out[t, h, i], out[t, h, i + half] = a * c - b * s, b * c + a * s
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    gate, up = x[:, :half].double(), x[:, half:].double()
    return gate / (1.0 + torch.exp(-gate)) * up


def paged_attention(q, k_cache, v_cache, block_tables, query_lens, context_lens, scale) -> torch.Tensor:
    """One query token and one head at a time, keys looked up slot by slot through the block table."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    token = 0
    for seq, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        for i in range(q_len):
            pos = ctx_len - q_len + i
            slots = [(int(block_tables[seq][j // block_size]), j % block_size) for j in range(pos + 1)]
            for h in range(q.shape[1]):
                keys = torch.stack([k_cache[b, o, h // group].double() for b, o in slots])
                values = torch.stack([v_cache[b, o, h // group].double() for b, o in slots])
                probs = torch.softmax(keys @ q[token, h].double() * scale, dim=0)
                out[token, h] = probs @ values
            token += 1
    return out
