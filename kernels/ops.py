"""The one kernel dispatch the model calls, with an explicit backend table.

Backends: `triton` (CUDA tensors; CPU tensors only under the Triton interpreter, TRITON_INTERPRET=1
set before kernels are imported), `cpu-native` (the CPU's production path: the C kernels of
kernels/csrc for fp32 and bf16 and oneDNN's packed GEMMs for fp32/bf16, wherever they apply) and `torch` (the
references: the specification every other implementation is tested against, and what runs where
nothing else applies). Each implementation lives in its kernel's file beside its reference; KERNELS
below names them. Which backend and variants run is the process's KernelOptions
(kernels/options.py), set by `configure()` when an engine is built with them (EngineConfig's
kernel_options) and never read from the environment: `backend` `torch|triton|cpu-native` forces one
backend for every call (`set_backend(name)` changes only that), `auto` picks Triton on CUDA and
cpu-native on the CPU; `native` / `onednn` off switch the C kernels / the packed GEMMs off.
Everything here reads host-side lengths from the `*_cpu` lists of AttentionMetadata, never from
tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from kernels import cpu_gemm, cpu_native, options
from kernels._triton import HAS_TRITON, interpreting
from kernels.activation import (
    gelu_tanh_and_mul_ref,
    gelu_tanh_and_mul_triton,
    silu_and_mul_native,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from kernels.argmax import argmax_native, argmax_ref
from kernels.attention_decode import (
    paged_decode_attention_native,
    paged_decode_attention_planned,
    paged_decode_attention_triton,
    plan_decode_groups,
)
from kernels.attention_prefill import (
    paged_prefill_attention_native,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
)
from kernels.fused_moe import fused_moe_cpu, fused_moe_ref, fused_moe_triton, select_experts
from kernels.kv_cache import store_kv_cache_native, store_kv_cache_ref, store_kv_cache_triton
from kernels.metadata import AttentionMetadata, build_attention_metadata
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_native, rms_norm_ref, rms_norm_triton
from kernels.rotary import (
    make_cos_sin_cache,
    rotary_embedding_native,
    rotary_embedding_ref,
    rotary_embedding_triton,
)

__all__ = [
    "KERNELS",
    "AttentionMetadata",
    "KernelOptions",
    "argmax",
    "build_attention_metadata",
    "configure",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "get_backend",
    "linear",
    "linear_logits",
    "linear_silu_and_mul",
    "make_cos_sin_cache",
    "pack_linears",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "select_experts",
    "set_backend",
    "silu_and_mul",
    "store_kv_cache",
    "unpack_linears",
]

BACKENDS = options.BACKENDS
KernelOptions = options.KernelOptions


def _prefill_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int | None = None,
) -> torch.Tensor:
    nd = meta.num_decodes
    return paged_prefill_attention_ref(q, k_cache, v_cache, meta.block_tables[nd:], meta.query_lens_cpu[nd:],
                                       meta.context_lens_cpu[nd:], scale, window)


def _decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    num_decodes: int, scale: float, window: int | None = None,
) -> torch.Tensor:
    """The torch decode attention, planned once per step (per window) by the first layer that needs
    it and shared by the rest."""
    plan = meta.torch_decode_plan if window is None else meta.window_plans.get(window)
    if plan is None:
        plan = plan_decode_groups(meta.context_lens_cpu[:num_decodes], meta.block_tables[:num_decodes],
                                  meta.context_lens[:num_decodes], k_cache.shape[1], window)
        if window is None:
            meta.torch_decode_plan = plan
        else:
            meta.window_plans[window] = plan
    return paged_decode_attention_planned(q, k_cache, v_cache, plan, scale)


def _prefill_native(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: None = None,
) -> torch.Tensor:
    """The prefill chunks on the CPU: the tiled kernel, whose query tiles share every key and value
    they read (vdpbf16ps tiles for bf16 with AVX512-BF16, fp32 vector tiles otherwise), else (shapes
    it does not take) each query token as a decode of its own through the decode kernel, which reads
    the blocks in place (no gather, no heads expanded for GQA)."""
    nd = meta.num_decodes
    out = paged_prefill_attention_native(q, k_cache, v_cache, meta.block_tables[nd:],
                                         meta.prefill_query_start_loc, meta.context_lens[nd:], scale)
    if out is not None:
        return out
    return paged_decode_attention_native(q, k_cache, v_cache, *meta.prefill_rows(), scale)


# op -> backend -> implementation, every entry with the op's own signature. decode_attention is
# paged_attention's decode half (prefill chunks: Triton's kernel or the torch reference); linear's
# cpu-native entry takes the weight pack_linears packed (the weight's form decides, not the call).
KERNELS: dict[str, dict[str, Callable]] = {
    # the C kernels scale by w alone: rms_norm and fused_add_rms_norm decline them for unit_offset (Gemma)
    "rms_norm": {
        "torch": rms_norm_ref,
        "triton": lambda x, w, eps, unit_offset: rms_norm_triton(x, w, eps, unit_offset=unit_offset)[0],
        "cpu-native": lambda x, w, eps, unit_offset: rms_norm_native(x, w, eps)[0],
    },
    "fused_add_rms_norm": {
        "torch": fused_add_rms_norm_ref,
        "triton": lambda x, residual, w, eps, unit_offset: rms_norm_triton(x, w, eps, residual, unit_offset),
        "cpu-native": lambda x, residual, w, eps, unit_offset: rms_norm_native(x, w, eps, residual),
    },
    "rotary_embedding": {
        "torch": rotary_embedding_ref,
        "triton": rotary_embedding_triton,
        "cpu-native": rotary_embedding_native,
    },
    "silu_and_mul": {
        "torch": silu_and_mul_ref,
        "triton": silu_and_mul_triton,
        "cpu-native": silu_and_mul_native,
    },
    "gelu_tanh_and_mul": {  # the C kernels have no GELU: the CPU runs the torch reference
        "torch": gelu_tanh_and_mul_ref,
        "triton": gelu_tanh_and_mul_triton,
        "cpu-native": gelu_tanh_and_mul_ref,
    },
    "store_kv_cache": {
        "torch": store_kv_cache_ref,
        "triton": store_kv_cache_triton,
        "cpu-native": store_kv_cache_native,
    },
    # a sliding window: the C kernels have none, so paged_attention takes the torch references then
    "decode_attention": {
        "torch": _decode_torch,
        "triton": lambda q, k_cache, v_cache, meta, n, scale, window: paged_decode_attention_triton(
            q, k_cache, v_cache, meta.block_tables[:n], meta.context_lens[:n], scale, window=window),
        "cpu-native": lambda q, k_cache, v_cache, meta, n, scale, window: paged_decode_attention_native(
            q, k_cache, v_cache, meta.block_tables[:n], meta.context_lens[:n], scale),
    },
    # the prefill chunks (rows num_decodes.. of q): per sequence SDPA over its gathered keys, or on
    # the CPU _prefill_native: the row-by-row decode kernel was 2.5-3x the SDPA path (48 prompts of
    # 64-256 tokens), the tiled bf16 kernel 1.7-2x the rows there and 2.2-2.7x at 2048-token prompts.
    # Triton's prefill kernel runs in _paged_attention_triton.
    "prefill_attention": {
        "torch": _prefill_torch,
        "triton": _prefill_torch,
        "cpu-native": _prefill_native,
    },
    "argmax": {
        "torch": argmax_ref,
        "triton": argmax_ref,  # torch's CUDA reduction
        "cpu-native": argmax_native,
    },
    # the mixture-of-experts MLP; cpu-native is torch's own GEMMs grouped by expert (no C kernel)
    "fused_moe": {
        "torch": fused_moe_ref,
        "triton": fused_moe_triton,
        "cpu-native": fused_moe_cpu,
    },
    "linear": {
        "torch": cpu_gemm.linear_ref,
        "triton": cpu_gemm.linear_ref,  # cuBLAS through torch
        "cpu-native": cpu_gemm.linear_native,
    },
}


def configure(kernel_options: KernelOptions) -> None:
    """The kernel options every call follows from now on (an engine built with kernel_options sets
    them; the process's engines share the kernels, so the last one built decides)."""
    if isinstance(kernel_options, KernelOptions):  # (options.configure names anything else)
        cpu_native.use_isa(kernel_options.isa)  # first: a variant this CPU cannot run changes nothing
    options.configure(kernel_options)
    cpu_native.apply_options()  # the library-wide switches (AMX, the attention's L2 stream), if loaded


def set_backend(name: str | None) -> None:
    """Force one backend for every call (`auto` or None: the device's own), the other options kept."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS} or None, got {name!r}")
    options.configure(replace(options.current(), backend=name or "auto"))


def get_backend(x: torch.Tensor) -> str:
    """The backend family for a call on tensor x: 'torch', 'triton' or 'cpu-native' (which falls
    back to torch per call where its kernels do not apply; see _pick)."""
    name = options.current().backend
    if name == "auto":
        return "triton" if x.is_cuda and HAS_TRITON else "torch" if x.is_cuda else "cpu-native"
    if name in ("torch", "cpu-native"):
        return name
    if not HAS_TRITON:
        raise RuntimeError("the triton kernel backend was asked for but `triton` is not importable; install "
                           "batchgen[triton]")
    if not x.is_cuda and not interpreting():
        raise RuntimeError(
            "the triton kernel backend on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before kernels is imported"
        )
    return name


def _pick(op: str, x: torch.Tensor, *tensors: torch.Tensor, fits: bool = True) -> Callable:
    """KERNELS[op]'s implementation for this call: cpu-native only where its C kernels take these
    tensors (fp32 or bf16, contiguous last dims, a built library) and the op's shapes `fits`."""
    backend = get_backend(x)
    if backend == "cpu-native" and not (fits and cpu_native.supports(x, *tensors)):
        backend = "torch"
    return KERNELS[op][backend]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x (T, D), scaled by weight (D,), or by 1 + weight in fp32
    (unit_offset: Gemma's)."""
    return _pick("rms_norm", x, weight, fits=x.dim() == 2 and not unit_offset)(x, weight, eps, unit_offset)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; returns (rms_norm(residual_out), residual_out)."""
    fits = x.dim() == 2 and x.shape == residual.shape and not unit_offset
    return _pick("fused_add_rms_norm", x, residual, weight, fits=fits)(x, residual, weight, eps, unit_offset)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by positions (T,) int64; returns (q, k)."""
    return _pick("rotary_embedding", q, k, cos_sin_cache)(positions, q, k, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> silu(gate) * up, (T, I)."""
    return _pick("silu_and_mul", x, fits=x.dim() == 2)(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> gelu_tanh(gate) * up, (T, I) (Gemma's GeGLU)."""
    return _pick("gelu_tanh_and_mul", x, fits=x.dim() == 2)(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x (S, V) -> (S,) int64, each row's first maximum (first NaN), as torch.argmax(dim=-1)."""
    return _pick("argmax", x, fits=x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0)(x)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The MoE MLP of x (T, D): each token through its k experts topk_ids (T, k), w13 (E, 2I, D) their
    [gate | up] rows and w2 (E, D, I) their down projections, weighted by topk_weights (T, k) and
    summed (see kernels.fused_moe; select_experts makes the weights and ids). The CPU path takes
    CPU tensors of any dtype; cuda tensors forced onto cpu-native take the reference."""
    backend = get_backend(x)
    if backend == "cpu-native" and not x.is_cpu:
        backend = "torch"
    return KERNELS["fused_moe"][backend](x, w13, w2, topk_weights, topk_ids)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value (T, Hkv, D) into k_cache/v_cache (num_blocks, block_size, Hkv, D); slot -1 skips."""
    fits = key.shape[1:] == k_cache.shape[2:]
    store = _pick("store_kv_cache", key, value, k_cache, v_cache, fits=fits)
    store(key, value, k_cache, v_cache, slot_mapping)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x (T, K) through a bias-free nn.Linear -> (T, N): oneDNN when pack_linears packed its weight."""
    weight = layer.weight
    if cpu_gemm.is_packed(weight):
        return KERNELS["linear"]["cpu-native"](x, weight)
    return KERNELS["linear"]["torch"](x, weight)


def linear_logits(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """linear(x, layer) as float32 (the lm_head): a bf16 panel GEMM writes its fp32 accumulators
    directly, unrounded and without a second pass over (T, vocab); other forms convert after."""
    if cpu_gemm.is_packed(layer.weight):
        return cpu_gemm.linear_f32(x, layer.weight)
    return linear(x, layer).float()


def linear_silu_and_mul(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """silu_and_mul(linear(x, layer)) for a [gate | up] layer: (T, K) -> (T, I). One pass (the GEMM's
    epilogue) where packing paired gate and up columns in the panel kernel's layout."""
    if cpu_gemm.gate_up_panels(layer):
        return cpu_gemm.linear_panels(x, layer.weight, silu=True)
    return silu_and_mul(linear(x, layer))


def pack_linears(module: nn.Module) -> bool:
    """The cpu-native GEMMs' weights: every bias-free nn.Linear under module packed in place for
    oneDNN (CPU, fp32 or bf16); returns whether all were. A no-op under the torch backend."""
    probe = next(module.parameters())
    if get_backend(probe) != "cpu-native":
        return False
    return cpu_gemm.pack_linears(module)


def unpack_linears(module: nn.Module) -> None:
    cpu_gemm.unpack_linears(module)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q (T, Hq, D) -> (T, Hq, D) for a mixed step: decodes first, then prefill chunks.

    Every query token attends causally to its sequence's cached keys (this step's included:
    store_kv_cache runs first), or with a sliding `window` to the last `window` of them, its own
    included (the blocks before stay in the cache; their keys are masked). Query heads are grouped
    over KV heads (Hq a multiple of Hkv).
    """
    if get_backend(q) == "triton":
        return _paged_attention_triton(q, k_cache, v_cache, meta, scale, window)
    no_window = window is None  # the C kernels have no window: the torch references take it
    decode = _pick("decode_attention", q, k_cache, fits=no_window)  # C reads blocks in place: no gather
    nd = meta.num_decodes
    if nd == len(meta.query_lens_cpu):
        return decode(q, k_cache, v_cache, meta, nd, scale, window)
    prefill = _pick("prefill_attention", q, k_cache, fits=no_window)
    chunks = prefill(q[nd:], k_cache, v_cache, meta, scale, window)
    if nd == 0:
        return chunks
    return torch.cat([decode(q[:nd], k_cache, v_cache, meta, nd, scale, window), chunks])


def _paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int | None,
) -> torch.Tensor:
    nd = meta.num_decodes
    if nd == meta.num_seqs:  # decode-only step (the one CUDA graphs capture)
        return KERNELS["decode_attention"]["triton"](q, k_cache, v_cache, meta, nd, scale, window)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if nd:  # a mixed step's decodes take the decode kernel: one query row per sequence, no wasted tile
        paged_decode_attention_triton(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                      meta.context_lens[:nd], scale, out=out[:nd], window=window)
    paged_prefill_attention_triton(
        q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.prefill_query_start_loc,
        meta.context_lens[nd:], meta.max_query_len, scale, out=out[nd:], window=window,
    )
    return out
