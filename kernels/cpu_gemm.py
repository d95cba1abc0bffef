"""The projections' GEMM: the torch reference (`F.linear`) and the cpu-native one, oneDNN over weights
packed once into its blocked layout.

Stock `F.linear` on a CPU build of torch runs fp32 through MKL, which on non-Intel x86 (this
project's AMD EPYC machines) takes its AVX2 code: about 200 GFLOP/s on 2 cores, where oneDNN's
AVX-512 kernels reach about 470 with packed weights (`python -m kernels.cpu_gemm` prints both for
the model's shapes); bf16 goes to oneDNN either way, and packed is as fast or faster at every shape
measured. Packing is in place: `pack_linears` swaps each `nn.Linear`'s weight for its packed
(opaque) tensor and frees the plain one, so no second copy stays in memory; `unpack_linears` turns
them back. `linear` reads which one a weight is. `BATCHGEN_ONEDNN=0` turns packing off, and anything
oneDNN cannot take stays plain.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_features

ENV_SWITCH = "BATCHGEN_ONEDNN"
PACK_BATCH_HINT = 128  # oneDNN picks its blocking for this many rows; measured good from M=8 to 2048
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


# oneDNN packs bf16 weights only on CPUs with these (its own check, `mkldnn_reorder_linear_weight`)
BF16_PACK_FLAGS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))


def packs_dtype(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether oneDNN packs weights of dtype on this CPU (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    if dtype not in PACKED_DTYPES:
        return False
    if dtype == torch.bfloat16:
        flags = cpu_features.cpu_flags() if flags is None else flags
        return any(need <= flags for need in BF16_PACK_FLAGS)
    return True


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (N, K) fp32/bf16 on the CPU -> oneDNN's packed tensor, or None where packing does not apply."""
    if not (enabled() and weight.device.type == "cpu" and packs_dtype(weight.dtype) and available()):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def is_packed(weight: torch.Tensor) -> bool:
    return weight.is_mkldnn


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ weight.T -> (T, N): the reference, any device."""
    return F.linear(x, weight)


def linear_native(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ weight.T -> (T, N) through oneDNN, with the weight packed by pack()."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through whichever form the weight is in."""
    return linear_native(x, weight) if weight.is_mkldnn else linear_ref(x, weight)


def _bias_free_linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear) and m.bias is None]


def pack_linears(module: nn.Module) -> bool:
    """Pack every bias-free nn.Linear weight under module in place; returns whether all are packed."""
    done = True
    for m in _bias_free_linears(module):
        if is_packed(m.weight):
            continue
        packed = pack(m.weight)
        if packed is None:
            done = False
            continue
        m.weight = nn.Parameter(packed, requires_grad=False)  # the plain tensor is freed here
    return done


def unpack_linears(module: nn.Module) -> None:
    """Back to plain weights (to load new ones, or read them)."""
    for m in _bias_free_linears(module):
        if is_packed(m.weight):
            m.weight = nn.Parameter(m.weight.to_dense(), requires_grad=False)


def flops_per_s(m: int, k: int, n: int, use_packed: bool, seconds: float = 0.3,
                dtype: torch.dtype = torch.float32) -> float:
    """Measured FLOP/s of one (m, k) x (k, n) product on the CPU, packed oneDNN or F.linear."""
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    if use_packed:
        w = pack(w)
        if w is None:
            return 0.0
    linear(x, w)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        linear(x, w)
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - t0)


def main() -> None:
    """Print F.linear against packed oneDNN for SmolLM2-135M's decode and prefill shapes, fp32 and bf16."""
    print(f"{'m x k x n':>18} {'dtype':>9} {'F.linear GF/s':>14} {'oneDNN packed GF/s':>19}")
    for dtype in PACKED_DTYPES:
        for m, k, n in [(8, 576, 960), (64, 576, 960), (128, 576, 3072), (128, 1536, 576),
                        (128, 576, 49152), (2048, 576, 3072), (1024, 1024, 1024)]:
            plain, packed = (flops_per_s(m, k, n, p, dtype=dtype) / 1e9 for p in (False, True))
            print(f"{f'{m}x{k}x{n}':>18} {str(dtype)[6:]:>9} {plain:14.0f} {packed:19.0f}")


if __name__ == "__main__":
    main()
