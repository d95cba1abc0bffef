"""Paged attention for decode (one query token per sequence, GQA, online softmax, optional split
over the context): Triton kernels, launcher, torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels._triton import tl, triton

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # (S, Hq, D) one query token per sequence, head dim contiguous
    k_cache_ptr,  # (num_blocks, block_size, Hkv, D) contiguous key cache
    v_cache_ptr,  # (num_blocks, block_size, Hkv, D) contiguous value cache
    block_tables_ptr,  # (S, max_blocks_per_seq) int32 block ids per sequence
    context_lens_ptr,  # (S,) int32 cached tokens per sequence
    out_ptr,  # (S, Hq, D) output rows, head dim contiguous; written when NUM_SPLITS == 1
    partial_out_ptr,  # (S, Hq, NUM_SPLITS, D) fp32 per-split normalised outputs; NUM_SPLITS > 1
    partial_lse_ptr,  # (S, Hq, NUM_SPLITS) fp32 per-split log2-sum-exp2; NUM_SPLITS > 1
    q_seq_stride,
    q_head_stride,
    out_seq_stride,
    block_table_stride,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    num_kv_heads,
    window,  # keys the query sees, its own included (a sliding window); NO_WINDOW for all of them
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a tensor-core tile (>= 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_N: tl.constexpr,  # keys per loop step
    NUM_SPLITS: tl.constexpr,  # programs sharing one sequence's context (flash-decoding)
    FP32: tl.constexpr,  # fp32 operands ("ieee" dots); otherwise 16-bit operands, fp32 accumulation
):
    """Program (s, h, p): the GROUP query heads of KV head h of sequence s over split p of the keys it
    sees, [lo, ctx) with lo = max(ctx - window, 0): [lo + p*P, lo + (p+1)*P) with
    P = cdiv(cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N (every tile it runs holds a visible key).

    The split length comes from the sequence's own context length, read from memory, so nothing
    host-side depends on how long contexts are: one compiled kernel per NUM_SPLITS serves every
    length, and a CUDA graph captured once stays valid as contexts grow.
    Online softmax in fp32 with running row max m and row sum l: per key tile, m' = max(m, max_j s_j),
    l = l*2^(m-m') + sum_j 2^(s_j-m'), acc = acc*2^(m-m') + sum_j 2^(s_j-m') v_j, where
    s_j = q.k_j * scale * log2(e); out = acc / l. With several splits each writes acc/l and
    m + log2(l), and _reduce_splits_kernel merges them.
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g  # (BLOCK_G,) query heads of this KV head
    row_mask = (g < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]  # (BLOCK_G, D)
    q_ptrs = q_ptr + seq * q_seq_stride + heads[:, None] * q_head_stride + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)  # (BLOCK_G, D)
    if FP32:
        q = q.to(tl.float32)

    row_max = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
    lo = tl.maximum(ctx_len - window, 0)  # the first key the query sees
    part = tl.cdiv(tl.cdiv(ctx_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * part
    end = tl.minimum(ctx_len, start + part)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        key_ok = pos < end
        block = tl.load(block_tables_ptr + seq * block_table_stride + pos // BLOCK_SIZE, mask=key_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_offs = (slot * num_kv_heads + kv_head)[:, None] * HEAD_DIM + dims[None, :]  # (BLOCK_N, D)
        kv_mask = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if FP32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q.to(k.dtype), tl.trans(k))  # 16-bit operands, fp32 accumulation
        scores = tl.where(key_ok[None, :], scores * qk_scale, float("-inf"))  # (BLOCK_G, BLOCK_N)
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        if FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max

    row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)  # an empty split (start >= ctx_len) writes zeros
    out = acc / row_sum[:, None]
    num_q_heads = num_kv_heads * GROUP
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + seq * out_seq_stride + heads[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        row = (seq * num_q_heads + heads) * NUM_SPLITS + split  # (BLOCK_G,)
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=row_mask)
        lse = tl.where(row_max == float("-inf"), float("-inf"), row_max + tl.log2(row_sum))
        tl.store(partial_lse_ptr + row, lse, mask=g < GROUP)


@triton.jit
def _reduce_splits_kernel(
    partial_out_ptr,  # (S, Hq, NUM_SPLITS, D) fp32 per-split normalised outputs
    partial_lse_ptr,  # (S, Hq, NUM_SPLITS) fp32 per-split log2-sum-exp2 (-inf for empty splits)
    out_ptr,  # (S, Hq, D) output rows, head dim contiguous
    out_seq_stride,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
):
    """Program (s, h) merges the splits: w_p = 2^(lse_p - max lse), out = sum w_p out_p / sum w_p.
    A sequence with an empty context (every split empty) gets zeros."""
    seq = tl.program_id(0).to(tl.int64)
    row = seq * tl.num_programs(1) + tl.program_id(1)  # s * Hq + h
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)  # (BLOCK_SPLITS,); 0 for empty splits
    mask = (splits < NUM_SPLITS)[:, None] & (dims < HEAD_DIM)[None, :]
    partial_ptrs = partial_out_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :]
    partial = tl.load(partial_ptrs, mask=mask, other=0.0)  # (BLOCK_SPLITS, D)
    total = tl.sum(weights, axis=0)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    out_ptrs = out_ptr + seq * out_seq_stride + tl.program_id(1) * HEAD_DIM + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))


MAX_SPLITS = 16
NO_WINDOW = 1 << 30  # the window argument of a layer without one: every key is within it


def decode_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence so that (sequences x KV heads x splits) programs fill the GPU about four
    times over: many for a few long sequences, one for a big batch. It depends on the batch size
    only, never on context lengths, so it takes a handful of values (one compiled kernel each)."""
    programs = max(num_seqs * num_kv_heads, 1)
    want = -(-4 * num_sms // programs)
    return min(MAX_SPLITS, triton.next_power_of_2(want)) if want > 1 else 1


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """q (S, Hq, D) -> (S, Hq, D), written into `out` when given (rows with a contiguous head dim).
    With a sliding `window` each query sees its last `window` keys only.

    Each sequence's context is split across `num_splits` programs (flash-decoding; default from
    decode_num_splits) so that small batches with long contexts still fill the GPU, and a second,
    tiny kernel merges the splits. Tile sizes and warps: `config`, else kernels.tuning's (measured
    on the GPU when a tuned table for it is named, defaults otherwise)."""
    from kernels import tile_configs as tuning

    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    _check_attention_inputs(q, k_cache, v_cache, block_tables)
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, tuning.num_sms(q.device))
    if not 1 <= num_splits <= 64:
        raise ValueError(f"paged attention: num_splits must be in [1, 64], got {num_splits}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if out.shape != q.shape or out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"paged attention: out must be {tuple(q.shape)} with contiguous heads")
    if num_seqs == 0:
        return out
    partial_out = partial_lse = out  # unused placeholders when there is one split
    if num_splits > 1:
        partial_out = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32,
                                  device=q.device)
        partial_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    cfg = config or tuning.decode_config(q.device, head_dim, q.dtype)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial_out, partial_lse,
        q.stride(0), q.stride(1), out.stride(0), block_tables.stride(0), scale * _LOG2E, num_kv_heads,
        window or NO_WINDOW, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=num_splits,
        FP32=q.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_seqs, num_q_heads)](
            partial_out, partial_lse, out, out.stride(0), HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        )
    return out


def _check_attention_inputs(q, k_cache, v_cache, block_tables) -> None:
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"paged attention: caches must be (num_blocks, block_size, Hkv, {head_dim}), "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if num_q_heads % k_cache.shape[2]:
        raise ValueError(f"paged attention: {num_q_heads} query heads is not a multiple of "
                         f"{k_cache.shape[2]} KV heads")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(-1) != 1:
        raise ValueError("paged attention: the Triton kernels need contiguous caches and a contiguous "
                         "q head dim")
    if block_tables.dtype != torch.int32 or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"paged attention: need int32 block tables and a power-of-two head dim >= 16, "
                         f"got {block_tables.dtype} and {head_dim}")


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q (S, Hq, D), one token per sequence, attends to its context_lens[s] cached keys (its last
    `window` of them with a sliding window) -> (S, Hq, D).

    The torch backend's one decode attention (the specification the Triton and native kernels are
    tested against): plan the groups, then paged_decode_attention_planned, which kernels.ops calls
    with a plan made once per step and shared by every layer.
    """
    num_seqs = q.shape[0]
    plan = plan_decode_groups(context_lens[:num_seqs].tolist(), block_tables[:num_seqs],
                              context_lens[:num_seqs], k_cache.shape[1], window)
    return paged_decode_attention_planned(q, k_cache, v_cache, plan, scale)


@dataclass
class DecodeGroup:
    """Decodes of similar context length, gathered and attended together on the torch path."""

    seqs: torch.Tensor | None  # (n,) int64 decode indices in this group; None = all decodes, in order
    blocks: torch.Tensor  # (n * nb,) int64 block ids of the group, row-major, for index_select
    mask: torch.Tensor  # (n, 1, 1, nb * block_size) bool: the key is in the sequence's context (window)


def plan_decode_groups(
    context_lens_cpu: list[int], block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
    window: int | None = None,
) -> list[DecodeGroup]:
    """Split decodes into groups whose contexts are within 1.5x of the group's longest, so that the
    padded gather wastes little; build each group's gather indices and mask once per step (a
    sliding `window` masks the keys before each sequence's last `window`).

    The groups are runs of the decodes sorted by length, longest first. Their indices are slices of
    the same (stable) sort done on the device lengths, so no index list is uploaded from the host
    (a blocking copy: on a GPU, a sync)."""
    order = sorted(range(len(context_lens_cpu)), key=context_lens_cpu.__getitem__, reverse=True)
    starts: list[int] = []  # where each group begins in `order`
    for at, seq in enumerate(order):
        top = context_lens_cpu[order[starts[-1]]] if starts else 0
        if not starts or not (context_lens_cpu[seq] * 1.5 >= top or top - context_lens_cpu[seq] < 128):
            starts.append(at)
    if len(starts) == 1:
        longest = context_lens_cpu[order[0]]
        return [_decode_group(None, longest, block_tables, context_lens, block_size, window)]
    device_order = torch.argsort(context_lens[: len(order)], descending=True, stable=True)  # == order
    ends = starts[1:] + [len(order)]
    return [_decode_group(device_order[a:b], context_lens_cpu[order[a]], block_tables, context_lens,
                          block_size, window) for a, b in zip(starts, ends, strict=True)]


def _decode_group(
    index: torch.Tensor | None,
    longest: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    window: int | None = None,
) -> DecodeGroup:
    """One group's gather indices and mask; index (n,) int64 of its decodes, None for every decode."""
    tables = block_tables if index is None else block_tables.index_select(0, index)
    lens = context_lens if index is None else context_lens.index_select(0, index)
    num_blocks = -(-longest // block_size)
    key_pos = torch.arange(num_blocks * block_size, device=block_tables.device)
    mask = key_pos[None, :] < lens[:, None]
    if window is not None:
        mask &= key_pos[None, :] >= lens[:, None] - window
    mask = mask.view(len(lens), 1, 1, -1)
    return DecodeGroup(index, tables[:, :num_blocks].reshape(-1).long(), mask)


def paged_decode_attention_planned(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list[DecodeGroup], scale: float
) -> torch.Tensor:
    """The torch decode path: gather each group's blocks into (n, Hkv, L, D) with L its longest context
    rounded up to whole blocks, mask positions past each context length, one batched SDPA per group."""
    if len(plan) == 1 and plan[0].seqs is None:
        return _attend_group(q, k_cache, v_cache, plan[0], scale)
    out = torch.empty_like(q)
    for group in plan:
        queries = q.index_select(0, group.seqs)
        out.index_copy_(0, group.seqs, _attend_group(queries, k_cache, v_cache, group, scale))
    return out


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                  scale: float) -> torch.Tensor:
    num_seqs, num_kv_heads, head_dim = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.index_select(0, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    # one query token per sequence: a KV head's G query heads become G query rows against the
    # same keys, so no GQA expansion of keys/values is needed (exact: decode has no causal mask)
    group_size = q.shape[1] // num_kv_heads
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, num_kv_heads, group_size, head_dim), keys, values, attn_mask=group.mask, scale=scale
    )  # (n, Hkv, G, D)
    return out.reshape(num_seqs, num_kv_heads * group_size, head_dim)


_NATIVE_ERRORS = {1: "out of memory", 2: "more than 64 query heads per KV head"}


def paged_decode_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
) -> torch.Tensor:
    """q (S, Hq, D) fp32 or bf16, one query token per sequence, attends to its context_lens[s] cached
    keys in k_cache/v_cache (num_blocks, block_size, Hkv, D) through block_tables (>= S, nb) int32
    -> (S, Hq, D). The same contract as kernels.attention_decode.paged_decode_attention_ref."""
    kernel = cpu_native.kernel("paged_decode_attention", q.dtype)
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or kv_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"native paged attention: q {tuple(q.shape)} does not fit caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(-1) != 1:
        raise ValueError("native paged attention: needs contiguous caches and a contiguous q head dim")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("native paged attention: block_tables and context_lens must be int32")
    if block_tables.stride(-1) != 1 or not context_lens.is_contiguous() or len(context_lens) < num_seqs:
        raise ValueError("native paged attention: block_tables rows and context_lens must be contiguous")
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype)
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"native paged attention: q {q.dtype} and caches {k_cache.dtype}/{v_cache.dtype} "
                         "must share one dtype")
    status = kernel(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(),
        num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, scale,
        num_threads or torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"native paged attention failed: {_NATIVE_ERRORS.get(status, status)}")
    return out
