"""The one kernel dispatch the engine calls: Triton on CUDA tensors, the torch reference elsewhere.

`BATCHGEN_KERNELS=torch|triton` (read once, and again on `set_backend(None)`) or `set_backend(name)`
forces one backend for every call; `auto` (or unset) picks by the tensor's device. Triton on CPU
tensors runs only under the Triton interpreter (`TRITON_INTERPRET=1`, set before kernels are
imported). The torch path is the CPU production path: every function here is vectorised and
reads host-side lengths from the `*_cpu` lists of AttentionMetadata, never from tensors. On fp32
CPU tensors decode attention and the elementwise ops go to the native C kernels
(kernels/cpu_native.py) when they build; `BATCHGEN_NATIVE=0` keeps the pure torch path.
"""

from __future__ import annotations

import os

import torch

from kernels import cpu_native
from kernels._triton import HAS_TRITON, interpreting
from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.attention_decode import (
    paged_decode_attention_planned,
    paged_decode_attention_triton,
    plan_decode_groups,
)
from kernels.attention_prefill import paged_prefill_attention_ref, paged_prefill_attention_triton
from kernels.kv_cache import store_kv_cache_ref, store_kv_cache_triton
from kernels.metadata import AttentionMetadata, build_attention_metadata
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref, rms_norm_triton
from kernels.rotary import make_cos_sin_cache, rotary_embedding_ref, rotary_embedding_triton

__all__ = [
    "AttentionMetadata",
    "build_attention_metadata",
    "fused_add_rms_norm",
    "get_backend",
    "make_cos_sin_cache",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "set_backend",
    "silu_and_mul",
    "store_kv_cache",
]

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "BATCHGEN_KERNELS"
_forced_backend: str | None = None  # set_backend() override; None defers to BATCHGEN_KERNELS
_env_backend: str = os.environ.get(ENV_VAR) or "auto"  # read once: not on every kernel call


def set_backend(name: str | None) -> None:
    """Force `torch` or `triton` for every call (`auto` or None: back to BATCHGEN_KERNELS, read again,
    and the tensor's device)."""
    global _forced_backend, _env_backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS} or None, got {name!r}")
    _forced_backend = None if name in (None, "auto") else name
    _env_backend = os.environ.get(ENV_VAR) or "auto"


def get_backend(x: torch.Tensor) -> str:
    """The backend a call on tensor x uses: 'torch' or 'triton'."""
    name = _forced_backend or _env_backend
    if name == "auto":
        return "triton" if x.is_cuda and HAS_TRITON else "torch"
    if name == "torch":
        return name
    if name != "triton":
        raise ValueError(f"BATCHGEN_KERNELS must be one of {BACKENDS}, got {name!r}")
    if not HAS_TRITON:
        raise RuntimeError("BATCHGEN_KERNELS=triton but `triton` is not importable; install batchgen[triton]")
    if not x.is_cuda and not interpreting():
        raise RuntimeError(
            "BATCHGEN_KERNELS=triton on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before kernels is imported"
        )
    return name


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (T, D), scaled by weight (D,)."""
    if get_backend(x) == "triton":
        return rms_norm_triton(x, weight, eps)[0]
    if x.dim() == 2 and cpu_native.supports(x, weight):
        return cpu_native.rms_norm(x, weight, eps)[0]
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; returns (rms_norm(residual_out), residual_out)."""
    if get_backend(x) == "triton":
        return rms_norm_triton(x, weight, eps, residual)
    if x.dim() == 2 and x.shape == residual.shape and cpu_native.supports(x, residual, weight):
        return cpu_native.rms_norm(x, weight, eps, residual)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by positions (T,) int64; returns (q, k)."""
    if get_backend(q) == "triton":
        return rotary_embedding_triton(positions, q, k, cos_sin_cache)
    if cpu_native.supports(q, k, cos_sin_cache):
        return cpu_native.rotary_embedding(positions, q, k, cos_sin_cache)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> silu(gate) * up, (T, I)."""
    if get_backend(x) == "triton":
        return silu_and_mul_triton(x)
    if x.dim() == 2 and cpu_native.supports(x):
        return cpu_native.silu_and_mul(x)
    return silu_and_mul_ref(x)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value (T, Hkv, D) into k_cache/v_cache (num_blocks, block_size, Hkv, D); slot -1 skips."""
    if get_backend(key) == "triton":
        store_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    elif cpu_native.supports(key, value, k_cache, v_cache) and key.shape[1:] == k_cache.shape[2:]:
        cpu_native.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q (T, Hq, D) -> (T, Hq, D) for a mixed step: decodes first, then prefill chunks.

    Every query token attends causally to its sequence's cached keys (this step's included:
    store_kv_cache runs first). Query heads are grouped over KV heads (Hq a multiple of Hkv).
    """
    if get_backend(q) == "torch":
        return _paged_attention_torch(q, k_cache, v_cache, meta, scale)
    nd = meta.num_decodes
    if nd == meta.num_seqs:  # decode-only step (the one CUDA graphs capture)
        return paged_decode_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if nd:  # a mixed step's decodes take the decode kernel: one query row per sequence, no wasted tile
        paged_decode_attention_triton(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                      meta.context_lens[:nd], scale, out=out[:nd])
    paged_prefill_attention_triton(
        q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.prefill_query_start_loc,
        meta.context_lens[nd:], meta.max_query_len, scale, out=out[nd:],
    )
    return out


def _paged_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decodes in one vectorised batch, prefill chunks one SDPA per sequence."""
    num_decodes = meta.num_decodes
    if num_decodes == len(meta.query_lens_cpu):
        return _decode_torch(q, k_cache, v_cache, meta, num_decodes, scale)
    chunks = paged_prefill_attention_ref(
        q[num_decodes:], k_cache, v_cache, meta.block_tables[num_decodes:],
        meta.query_lens_cpu[num_decodes:], meta.context_lens_cpu[num_decodes:], scale,
    )
    if num_decodes == 0:
        return chunks
    return torch.cat([_decode_torch(q[:num_decodes], k_cache, v_cache, meta, num_decodes, scale), chunks])


def _decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    num_decodes: int, scale: float,
) -> torch.Tensor:
    if cpu_native.supports(q, k_cache):  # reads the blocks in place: no gather, no padding
        return cpu_native.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables[:num_decodes], meta.context_lens[:num_decodes], scale
        )
    if meta.torch_decode_plan is None:  # the first layer of the step plans for all of them
        meta.torch_decode_plan = plan_decode_groups(
            meta.context_lens_cpu[:num_decodes], meta.block_tables[:num_decodes],
            meta.context_lens[:num_decodes], k_cache.shape[1],
        )
    return paged_decode_attention_planned(q, k_cache, v_cache, meta.torch_decode_plan, scale)
