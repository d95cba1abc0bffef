"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): top-k routing, the grouped expert GEMM as a
Triton kernel in the fused-MoE manner, its CPU path, and its torch reference.

Every token t goes through its k routed experts e_j = topk_ids[t, j], weighted by topk_weights[t, j]:
out[t] = sum_j topk_weights[t, j] * w2[e_j] @ (silu(w13[e_j, :I] @ x[t]) * (w13[e_j, I:] @ x[t])).
w13 (E, 2I, D) holds each expert's [gate | up] rows and w2 (E, D, I) its down projection, as
transformers stores them (`gate_up_proj`, `down_proj`). A (token, slot) pair p = t*k + j is one row of
the grouped GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._triton import interpreting, tl, triton


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) -> (topk_weights (T, k) float32, topk_ids (T, k) int32).

    A softmax over all E experts in float32, the k most probable (ties broken as torch.topk breaks
    them), and with `renormalize` those k divided by their sum, so each token's weights add up to 1
    (Qwen3-MoE's `norm_topk_prob`; Mixtral always renormalizes)."""
    if router_logits.dim() != 2:
        raise ValueError(f"select_experts: router_logits must be (T, E), got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"select_experts: top_k must be in 1..{num_experts} (the number of experts), "
                         f"got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # (rows, K) activations, last dim contiguous: x (T, D), or h (T*k, I) with one row per pair
    w_ptr,  # (E, N or 2N, K) expert weights, last dim contiguous: w13 (E, 2I, D) or w2 (E, D, I)
    out_ptr,  # (T*k, N) one row per (token, slot) pair, contiguous
    weights_ptr,  # (T*k,) fp32 routing weight of each pair; read only when MUL_WEIGHT
    sorted_pairs_ptr,  # (P,) int32 pair indexes grouped by expert, each group padded to BLOCK_M with T*k
    block_experts_ptr,  # (P / BLOCK_M,) int32 the expert of each BLOCK_M block of sorted_pairs
    num_padded_ptr,  # (1,) int32 entries of sorted_pairs in use; the blocks past them are spare
    a_row_stride,
    w_expert_stride,
    w_row_stride,
    N,  # output columns: I (GATED) or D
    K,  # reduction length: D (GATED) or I
    num_pairs,  # T*k: a pair index at or past it is padding
    pairs_per_a_row,  # k when a is x (pair p reads row p // k), 1 when a is h (row p)
    GATED: tl.constexpr,  # w rows c (gate) and N + c (up), out = silu(gate) * up
    MUL_WEIGHT: tl.constexpr,  # scale each output row by its pair's routing weight
    FP32: tl.constexpr,  # fp32 operands ("ieee" dots); otherwise 16-bit operands, fp32 accumulation
    BLOCK_M: tl.constexpr,  # pairs per program; every expert's pairs are padded to a multiple of it
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (b, n): the pairs p of block b of sorted_pairs, all routed to the block's expert e,
    times columns c in [n*BLOCK_N, (n+1)*BLOCK_N) of e's weights, accumulated in fp32:
    out[p, c] = sum_i a[row(p), i] * w[e, c, i]. GATED: out[p, c] = silu(g) * u with g that sum over
    w[e, c] and u over w[e, N + c], silu(g) = g / (1 + exp(-g)). MUL_WEIGHT: out[p, c] *= weights[p].

    The grid covers the most blocks any routing can need (the host never reads how many it did);
    blocks at or past num_padded exit at once; padding rows are masked out of loads and stores.
    """
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a spare block
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,)
    pair_ok = pairs < num_pairs
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_cols = cols % N  # columns past N read row c % N (in bounds, never stored): no mask on w
    ks = tl.arange(0, BLOCK_K)
    rows = (pairs // pairs_per_a_row).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * a_row_stride + ks[None, :]  # (BLOCK_M, BLOCK_K)
    # (BLOCK_K, BLOCK_N): expert e's rows `cols`, read transposed
    w_ptrs = w_ptr + expert * w_expert_stride + w_cols[None, :] * w_row_stride + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # GATED only
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - step * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _dot(acc, a, w, FP32)
        if GATED:
            w_up = tl.load(w_ptrs + N * w_row_stride, mask=k_ok[:, None], other=0.0)
            acc_up = _dot(acc_up, a, w_up, FP32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _dot(acc, a, w, FP32: tl.constexpr):
    """acc + a @ w in fp32: fp32 operands without tf32, or 16-bit operands at the tensor-core rate."""
    if FP32:
        acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@dataclass
class ExpertBlocks:
    """A step's (token, slot) pairs sorted by expert and cut into blocks of block_m rows, each block
    one expert's: where the grouped GEMM's programs find their rows."""

    sorted_pairs: torch.Tensor  # (P,) int32 pairs t*k + j by expert, each expert's padded to block_m with T*k
    block_experts: torch.Tensor  # (P / block_m,) int32 each block's expert (E for the spare blocks)
    num_padded: torch.Tensor  # (1,) int32 entries of sorted_pairs in use: the padded pair count
    block_m: int  # rows per block


def align_pairs_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group the pairs of topk_ids (T, k) by expert, in pair order within an expert, each group padded
    to a multiple of block_m (moe_align_block_size, in torch). Sizes depend only on T, k, E and
    block_m, never on the routing, so nothing is read back to the host. An expert id outside
    0..E-1 fails in scatter_add_ (a RuntimeError on the CPU, a device-side assert on CUDA)."""
    experts = topk_ids.reshape(-1).long()  # (T*k,) expert of pair p
    num_pairs, device = experts.numel(), experts.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))  # (E,) pairs per expert
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # (E,) end of each expert's group in sorted_pairs
    order = torch.argsort(experts, stable=True)  # (T*k,) pairs by expert
    expert_of = experts[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]  # within its group
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)  # every used expert one row past a block
    capacity = -(-worst // block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)  # skips empty experts
    return ExpertBlocks(sorted_pairs, block_experts, ends[-1:].to(torch.int32), block_m)


def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tile sizes for a step: BLOCK_M near the pairs an expert gets on average (each expert's group is
    padded to BLOCK_M, so a decode step's few rows per expert want 16), 64-wide N tiles, 64-deep K
    tiles for 16-bit operands and 32-deep for fp32 (twice the bytes per element)."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    fp32 = dtype == torch.float32
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 32 if fp32 else 64, "num_warps": 4,
            "num_stages": 2 if fp32 else 3}


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:
    """x (T, D) -> (T, D) in two grouped GEMM launches over the pairs sorted by expert: h = silu(x w_gate)
    * (x w_up) per pair (T*k, I) in x's dtype, then weight * h w2 per pair (T*k, D) in fp32, summed
    over each token's k pairs in fp32. Tile sizes from moe_config unless `config` gives them."""
    _check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    cfg = config or moe_config(num_pairs, num_experts, x.dtype)
    blocks = align_pairs_to_blocks(topk_ids, num_experts, cfg["BLOCK_M"])
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, h, blocks, cfg, pairs_per_a_row=top_k, gated=True)
    y = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    _moe_gemm(h, w2, y, blocks, cfg, pairs_per_a_row=1, weights=topk_weights.reshape(-1).float())
    return y.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, cfg: dict, *,
              pairs_per_a_row: int, gated: bool = False, weights: torch.Tensor | None = None) -> None:
    """One grouped GEMM launch into out (T*k, N): gated for w13, weighted when `weights` is given.
    fp32 operands for fp32, and for bf16 under the interpreter (which computes bf16 wrongly)."""
    num_cols, depth = out.shape[1], a.shape[1]
    fp32 = a.dtype == torch.float32 or (a.dtype == torch.bfloat16 and interpreting())
    grid = (blocks.sorted_pairs.numel() // blocks.block_m, triton.cdiv(num_cols, cfg["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a, w, out, out if weights is None else weights, blocks.sorted_pairs, blocks.block_experts,
        blocks.num_padded, a.stride(0), w.stride(0), w.stride(1), num_cols, depth, out.shape[0],
        pairs_per_a_row, GATED=gated, MUL_WEIGHT=weights is not None, FP32=fp32, BLOCK_M=blocks.block_m,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def fused_moe_cpu(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x (T, D) -> (T, D) on the CPU: the pairs sorted by expert once, then per expert that got any,
    one GEMM over its rows for w13 and one for w2 in x's dtype (F.linear), SiLU-and-mul, and its
    weighted rows added into an fp32 output (index_add_). Pairs are taken slot-major (j*T + t) as
    transformers' MoE blocks take them, so in fp32 the same GEMMs run on the same rows, equal bits."""
    _check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    num_experts, num_tokens = w13.shape[0], x.shape[0]
    experts = topk_ids.t().reshape(-1)  # (k*T,) expert of pair j*T + t
    counts = _expert_counts(experts, num_experts)
    order = torch.argsort(experts, stable=True)
    tokens, weights = order % num_tokens, topk_weights.t().reshape(-1)[order].float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = tokens[start:start + count]
            gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[expert])  # (count, D)
            out.index_add_(0, rows, y.float() * weights[start:start + count, None])
        start += count
    return out.to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The specification, x (T, D) -> (T, D): per expert, the tokens routed to it through its gated
    MLP, weighted and added up, all in fp32; the output in x's dtype."""
    _check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    _expert_counts(topk_ids.reshape(-1), w13.shape[0])
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel():
            xs = x[token].float()  # (n, D)
            gate = xs @ w13[expert, :inter].float().T  # (n, I)
            up = xs @ w13[expert, inter:].float().T
            y = (F.silu(gate) * up) @ w2[expert].float().T  # (n, D)
            out.index_add_(0, token, topk_weights[token, slot, None].float() * y)
    return out.to(x.dtype)


def _expert_counts(experts: torch.Tensor, num_experts: int) -> list[int]:
    """Pairs per expert, refusing ids outside 0..E-1 (a host sync: the CPU and reference paths only)."""
    if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < num_experts:
        raise ValueError(f"fused_moe: topk_ids must be in 0..{num_experts - 1} (the experts of w13), got "
                         f"{int(experts.min())}..{int(experts.max())}")
    return torch.bincount(experts, minlength=num_experts).tolist()


def _check_moe_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> None:
    """x (T, D), w13 (E, 2I, D), w2 (E, D, I) in one dtype with contiguous last dims; topk_weights and
    topk_ids (T, k) with k >= 1, the ids an integer type."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"fused_moe: x must be (T, D) with a contiguous last dim, got {tuple(x.shape)}")
    hidden = x.shape[1]
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != hidden or not w13.is_contiguous():
        raise ValueError(f"fused_moe: w13 must be a contiguous (E, 2I, {hidden}) for x {tuple(x.shape)}, "
                         f"got {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_experts, hidden, inter) or not w2.is_contiguous():
        raise ValueError(f"fused_moe: w2 must be a contiguous ({num_experts}, {hidden}, {inter}) for w13 "
                         f"{tuple(w13.shape)}, got {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, "
                         f"{w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1 \
            or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: topk_weights and topk_ids must be ({x.shape[0]}, k) with k >= 1, got "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
