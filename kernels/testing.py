"""Random paged-attention inputs, shared by the kernel tests and `batchgen bench kernels`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata, build_attention_metadata

# (atol, rtol) of a Triton kernel against the torch reference in the same dtype (bench and tuner)
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}


@dataclass
class PagedInputs:
    """One step's attention inputs over a randomly laid out paged KV cache."""

    q: torch.Tensor  # (T, Hq, D) this step's queries
    key: torch.Tensor  # (T, Hkv, D) this step's new keys, already in k_cache at meta.slot_mapping
    value: torch.Tensor  # (T, Hkv, D) this step's new values, already in v_cache
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    meta: AttentionMetadata  # lengths, block tables and slots of this step
    scale: float  # softmax scale, 1/sqrt(D)


def make_paged_inputs(
    query_lens: list[int],
    context_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    garbage: float | None = 0.0,
) -> PagedInputs:
    """Sequences with the given query/context lengths (decodes first) over shuffled cache blocks.

    Every slot inside a context holds random K/V; every other slot (the tail of a last block,
    spare blocks) holds `garbage` (nan proves a kernel never reads outside a context; None leaves
    the random values, which is quickest at serving sizes). Tensors are made on `device`.
    """
    blocks_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks that no sequence owns
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used : used + n])
        used += n
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = _randn(shape, gen, dtype, device), _randn(shape, gen, dtype, device)
    if garbage is not None:
        outside = _outside_contexts(meta, num_blocks * block_size, block_size)
        k_cache.view(-1, num_kv_heads, head_dim)[outside] = garbage
        v_cache.view(-1, num_kv_heads, head_dim)[outside] = garbage
    slots = meta.slot_mapping
    return PagedInputs(
        q=_randn((len(slots), num_q_heads, head_dim), gen, dtype, device),
        key=k_cache.view(-1, num_kv_heads, head_dim)[slots],
        value=v_cache.view(-1, num_kv_heads, head_dim)[slots],
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
        scale=head_dim**-0.5,
    )


def _outside_contexts(meta: AttentionMetadata, num_slots: int, block_size: int) -> torch.Tensor:
    """(num_slots,) bool: True for every cache slot that no sequence's context covers."""
    pos = torch.arange(meta.block_tables.shape[1] * block_size, device=meta.block_tables.device)
    slots = meta.block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # (S, W*bs)
    inside = pos[None, :] < meta.context_lens[:, None]
    outside = torch.ones(num_slots, dtype=torch.bool, device=pos.device)
    outside[slots[inside]] = False
    return outside


def _randn(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device).to(dtype)
