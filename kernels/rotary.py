"""Rotary position embedding (HF Llama rotate_half / NeoX layout): Triton kernel, launcher, torch
reference, and the cos/sin cache they both read."""

from __future__ import annotations

import torch


def make_cos_sin_cache(
    head_dim: int, max_pos: int, rope_theta: float, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """(max_pos, head_dim): the first head_dim/2 columns cos(pos * f_i), the last head_dim/2 sin.

    f_i = rope_theta ** (-2i / head_dim), computed in fp32 exactly as Hugging Face Llama does, so
    the cached values match `LlamaRotaryEmbedding` before the cast to `dtype`.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)  # (D/2,)
    positions = torch.arange(max_pos, dtype=torch.int64, device=device).float()
    freqs = torch.outer(positions, inv_freq)  # (max_pos, D/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by their token positions (T,); returns (q, k).

    With x = [x1 | x2] (halves of the head dim): out = [x1*cos - x2*sin | x2*cos + x1*sin].
    """
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)  # (T, D)
    cos = cos_sin[:, None, :half]  # (T, 1, D/2)
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half:]
        rotated1 = x1 * cos - x2 * sin
        rotated2 = x2 * cos + x1 * sin
        x1.copy_(rotated1)
        x2.copy_(rotated2)
    return q, k
