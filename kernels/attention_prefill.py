"""Attention for prefill and chunked prefill over the paged KV cache (a varlen batch of query
chunks, decodes included as chunks of one): Triton kernel, launcher, torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import tl, triton
from kernels.attention_decode import _check_attention_inputs

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # (T, Hq, D) query chunks of all sequences back to back, head dim contiguous
    k_cache_ptr,  # (num_blocks, block_size, Hkv, D) contiguous key cache (this step's keys stored)
    v_cache_ptr,  # (num_blocks, block_size, Hkv, D) contiguous value cache
    block_tables_ptr,  # (S, max_blocks_per_seq) int32 block ids per sequence
    query_start_loc_ptr,  # (S+1,) int32 first query token of each sequence in q (q's row 0 = 0)
    context_lens_ptr,  # (S,) int32 cached tokens per sequence, this chunk included
    out_ptr,  # (T, Hq, D) output rows, head dim contiguous
    q_token_stride,
    q_head_stride,
    out_token_stride,
    block_table_stride,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    num_kv_heads,
    window,  # keys a query sees, its own included (a sliding window); read only when HAS_WINDOW
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program: BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,  # rows per program: (token, query head of the group) pairs, flattened
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_N: tl.constexpr,  # keys per loop step
    FP32: tl.constexpr,  # fp32 operands ("ieee" dots); otherwise 16-bit operands, fp32 accumulation
    HAS_WINDOW: tl.constexpr,  # a sliding window: keys before position - window + 1 are masked
):
    """Program (s, t, h): query tokens [t*BLOCK_Q, (t+1)*BLOCK_Q) of sequence s's chunk, every query
    head of KV head h (rows r = token*GROUP + head, so the group shares each K/V tile it loads).

    The chunk's token i sits at position ctx - q_len + i and sees keys 0 .. that position (causal,
    aligned bottom-right), with a window only the last `window` of them (the loop starts at the
    tile's first visible key, and a row may see no key of a tile, so its running max stays -inf
    there: the exponents subtract 0 instead); decodes are chunks of one. Online softmax in fp32 as
    in the decode kernel (running max m, running sum l, out = acc / l). With 16-bit inputs, both products take
    16-bit operands (the probabilities are rounded to the value dtype, as FlashAttention does) and
    accumulate in fp32: the full tensor-core rate, where fp32 operands would run at the tf32 rate.
    """
    seq = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if first < q_len:  # tiles past this sequence's chunk have nothing to do
        ctx_len = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        token = first + rows // GROUP  # (BLOCK_M,) token index within the chunk
        head = kv_head * GROUP + rows % GROUP  # (BLOCK_M,) query head
        row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
        query_pos = ctx_len - q_len + token  # (BLOCK_M,)
        row_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]  # (BLOCK_M, D)
        q_offs = (q_start + token).to(tl.int64)[:, None] * q_token_stride + head[:, None] * q_head_stride
        q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_mask, other=0.0)
        if FP32:
            q = q.to(tl.float32)

        row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        row_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        kv_end = tl.minimum(ctx_len, ctx_len - q_len + first + BLOCK_Q)  # last visible key + 1
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(ctx_len - q_len + first - window + 1, 0)  # the first row's first key
        for tile_start in range(kv_start, kv_end, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
            key_ok = pos < kv_end
            block = tl.load(block_tables_ptr + seq * block_table_stride + pos // BLOCK_SIZE, mask=key_ok,
                            other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_offs = (slot * num_kv_heads + kv_head)[:, None] * HEAD_DIM + dims[None, :]  # (BLOCK_N, D)
            kv_mask = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
            k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            if FP32:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q.to(k.dtype), tl.trans(k))  # (BLOCK_M, BLOCK_N) fp32
            visible = (pos[None, :] <= query_pos[:, None]) & key_ok[None, :]
            if HAS_WINDOW:
                visible &= pos[None, :] > query_pos[:, None] - window
            scores = tl.where(visible, scores * qk_scale, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))  # without a window: finite (key 0)
            if HAS_WINDOW:
                new_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no key yet
            alpha = tl.exp2(row_max - new_max)
            p = tl.exp2(scores - new_max[:, None])
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            if FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            row_max = new_max

        if HAS_WINDOW:  # rows past the chunk may see no key at all: nothing to divide (they are not stored)
            row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
        out = acc / row_sum[:, None]
        out_offs = (q_start + token).to(tl.int64)[:, None] * out_token_stride + head[:, None] * HEAD_DIM
        tl.store(out_ptr + out_offs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q (T, Hq, D) -> (T, Hq, D) for a varlen batch of chunks (decodes included) in one launch
    (with a sliding `window`, each query sees its last `window` keys):
    a (S, query tiles of the longest chunk, Hkv) grid; tiles past a shorter chunk exit at once.
    query_start_loc[0] must be 0 (q's first row). Written into `out` when given. Tile sizes and warps
    come from kernels.tuning (measured per GPU when a tuned table exists, defaults otherwise)."""
    from kernels import tile_configs as tuning

    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    _check_attention_inputs(q, k_cache, v_cache, block_tables)
    group = num_q_heads // num_kv_heads
    cfg = config or tuning.prefill_config(q.device, head_dim, q.dtype)
    block_m = max(cfg["BLOCK_M"], triton.next_power_of_2(group))
    block_q = block_m // group
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if out.shape != q.shape or out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"paged attention: out must be {tuple(q.shape)} with contiguous heads")
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    _paged_prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        q.stride(0), q.stride(1), out.stride(0), block_tables.stride(0), scale * _LOG2E, num_kv_heads,
        window or 0, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=cfg["BLOCK_N"], FP32=q.dtype == torch.float32, HAS_WINDOW=window is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q (T, Hq, D) holds the query chunks of sequences 0..S-1 back to back -> (T, Hq, D).

    Sequence s has query_lens[s] new tokens at positions context_lens[s] - query_lens[s] ..
    context_lens[s] - 1, already stored in the cache; token i attends to cached keys 0 ..
    its own position, or with a sliding `window` to the last `window` of them (its own included).
    One SDPA per sequence over its gathered keys with a bottom-right aligned causal mask
    (`is_causal` alone is top-left aligned, wrong when the chunk is shorter).
    """
    out = torch.empty_like(q)
    start = 0
    for seq, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        end = start + q_len
        keys, values = _gather_context(k_cache, v_cache, block_tables[seq], ctx_len)  # (Hkv, L, D)
        queries = q[start:end].transpose(0, 1)  # (Hq, q_len, D)
        out[start:end] = _causal_sdpa(queries, keys, values, scale, window).transpose(0, 1)
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
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """queries (Hq, q_len, D) are the last q_len positions of the ctx_len keys (Hkv, ctx_len, D); with
    a window, query position p sees keys p - window + 1 .. p only.

    Keys and values are expanded to Hq heads and given a batch dim: with 3-D inputs or
    enable_gqa, torch's CPU SDPA takes its math path (bmm + softmax), 2-2.5x slower than the
    flash kernel it picks for 4-D inputs of equal head counts.
    """
    q_len, ctx_len = queries.shape[1], keys.shape[1]
    first = 0 if window is None else max(ctx_len - q_len - window + 1, 0)  # the first key any query sees
    keys, values = keys[:, first:], values[:, first:]
    group = queries.shape[0] // keys.shape[0]
    if group > 1:
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    queries, keys, values = queries[None], keys[None], values[None]
    windowed = window is not None and ctx_len > window
    if q_len == ctx_len and not windowed:  # whole prompt: top-left and bottom-right alignment coincide
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)[0]
    if q_len == 1:  # the last position sees every key gathered
        return F.scaled_dot_product_attention(queries, keys, values, scale=scale)[0]
    query_pos = torch.arange(ctx_len - q_len, ctx_len, device=queries.device)
    key_pos = torch.arange(first, ctx_len, device=queries.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # (q_len, ctx_len - first)
    if windowed:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)[0]


_NATIVE_UNSUPPORTED = 2  # the C kernel's answer for shapes or CPUs it does not take


def paged_prefill_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
) -> torch.Tensor | None:
    """The prefill chunks through the cpu-native tiled kernel: query_start_loc (S+1,) int32 from 0,
    context_lens (S,) int32, block_tables (S, nb) int32; the contract of paged_prefill_attention_ref
    otherwise. bf16 on CPUs with AVX512-BF16 (head dim 32, 64, 128 or 256, an even block size), and
    fp32, or bf16 without AVX512-BF16, in fp32 vectors (head dim a multiple of 16 with AVX2, 32 with
    AVX-512, up to 256); up to 8 query heads per KV head; None for anything else (the caller takes the
    decode kernel row by row then)."""
    from kernels import cpu_native

    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = len(context_lens)
    if (q.dtype not in (torch.float32, torch.bfloat16) or not q.dtype == k_cache.dtype == v_cache.dtype
            or q.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or block_tables.stride(-1) != 1 or len(query_start_loc) != num_seqs + 1):
        return None
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("context_lens", context_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"native prefill attention: {name} must be int32, got {t.dtype}")
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"native prefill attention: q {tuple(q.shape)} does not fit caches "
                         f"{tuple(k_cache.shape)}")
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype)
    status = cpu_native.kernel("paged_prefill_attention", q.dtype)(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), query_start_loc.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, scale,
        num_threads or torch.get_num_threads())
    if status == _NATIVE_UNSUPPORTED:
        return None
    if status:
        raise RuntimeError("native prefill attention failed: out of memory")
    return out
