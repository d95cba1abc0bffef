"""Rotary position embedding (HF Llama rotate_half / NeoX layout): Triton kernel, launcher, torch
reference, and the cos/sin cache they both read."""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels._triton import tl, triton


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


@triton.jit
def _rotate_heads(
    x_ptr,  # (T, H, D) queries or keys of this token's row, rotated in place
    row_offset,  # element offset of the token's row in x
    head_stride,
    num_heads,
    cos,  # (HALF,) fp32 cos of this token's angles
    sin,  # (HALF,) fp32 sin
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """x = [x1 | x2] per head -> [x1*cos - x2*sin | x2*cos + x1*sin]."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    ptrs = x_ptr + row_offset + heads * head_stride + dims  # (BLOCK_H, HALF) first halves
    mask = heads < num_heads
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # (T,) int64 token positions
    q_ptr,  # (T, Hq, D) queries, rotated in place; head dim contiguous
    k_ptr,  # (T, Hkv, D) keys, rotated in place; head dim contiguous
    cos_sin_ptr,  # (max_pos, D) contiguous: cos in the first D/2 columns, sin in the last D/2
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
):
    """One program per token t: rotate every query and key head of t by the angles of positions[t]."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + dims).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + dims).to(tl.float32)
    _rotate_heads(q_ptr, token * q_token_stride, q_head_stride, num_q_heads, cos, sin, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, token * k_token_stride, k_head_stride, num_kv_heads, cos, sin, HALF, BLOCK_HKV)


def rotary_embedding_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch one program per token; rotates q and k in place and returns them."""
    _check_rotary(positions, q, k, cos_sin_cache)
    half = q.shape[2] // 2
    if q.shape[0]:
        _rotary_kernel[(q.shape[0],)](
            positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q.shape[1], k.shape[1], HALF=half,
            BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HKV=triton.next_power_of_2(k.shape[1]),
        )
    return q, k


def _check_rotary(positions, q, k, cos_sin_cache) -> None:
    head_dim = q.shape[-1]
    if q.dim() != 3 or k.dim() != 3 or k.shape[-1] != head_dim or k.shape[0] != q.shape[0]:
        raise ValueError(f"rotary_embedding: q (T, Hq, D) and k (T, Hkv, D) disagree: "
                         f"{tuple(q.shape)} vs {tuple(k.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding: q and k need a contiguous head dim")
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(f"rotary_embedding: positions must be ({q.shape[0]},) int64, "
                         f"got {tuple(positions.shape)} {positions.dtype}")
    if cos_sin_cache.shape[-1] != head_dim or not cos_sin_cache.is_contiguous():
        raise ValueError(f"rotary_embedding: cos_sin_cache must be contiguous (max_pos, {head_dim}), "
                         f"got {tuple(cos_sin_cache.shape)}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"rotary_embedding: the Triton kernel needs a power-of-two head dim, got {head_dim}")


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


def rotary_embedding_native(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place; head dims contiguous, any other strides."""
    if q.stride(2) != 1 or k.stride(2) != 1 or not cos_sin_cache.is_contiguous():
        raise ValueError("native rotary: q and k need contiguous head dims, cos_sin_cache contiguity")
    positions = positions.to(torch.int64).contiguous()
    rows, dim = q.shape[0], q.shape[2]
    if k.shape[0] != rows or k.shape[2] != dim or positions.numel() != rows or cos_sin_cache.shape[-1] != dim:
        raise ValueError(f"native rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
                         f"{tuple(positions.shape)}, cos_sin_cache {tuple(cos_sin_cache.shape)} do not fit")
    max_len = cos_sin_cache.shape[0]
    bad = cpu_native.kernel("rotary", q.dtype)(  # checks every position before it writes
        positions.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), q.shape[1], k.data_ptr(), k.stride(0),
        k.stride(1), k.shape[1], cos_sin_cache.data_ptr(), max_len, rows, dim, torch.get_num_threads())
    if bad:
        raise IndexError(f"native rotary: token {bad - 1} has position {int(positions[bad - 1])}, outside "
                         f"the rotary cache's {max_len} positions")
    return q, k
