"""Random paged-attention inputs, shared by the kernel tests and `python -m kernels.bench`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata, build_attention_metadata


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
    garbage: float = 0.0,
) -> PagedInputs:
    """Sequences with the given query/context lengths (decodes first) over shuffled cache blocks.

    Every slot inside a context holds random K/V; every other slot (the tail of a last block,
    spare blocks) holds `garbage` (pass nan to prove a kernel never reads outside a context).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks that no sequence owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used : used + n])
        used += n
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, device=device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, garbage, dtype=dtype)
    v_cache = torch.full(shape, garbage, dtype=dtype)
    for ctx, table in zip(context_lens, tables, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = _randn((ctx, num_kv_heads, head_dim), gen, dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = _randn((ctx, num_kv_heads, head_dim), gen, dtype)
    slots = meta.slot_mapping.cpu()
    q = _randn((len(slots), num_q_heads, head_dim), gen, dtype)
    return PagedInputs(
        q=q.to(device),
        key=k_cache.view(-1, num_kv_heads, head_dim)[slots].to(device),
        value=v_cache.view(-1, num_kv_heads, head_dim)[slots].to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        meta=meta,
        scale=head_dim**-0.5,
    )


def _randn(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)
