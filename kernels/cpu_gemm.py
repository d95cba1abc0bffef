"""fp32 GEMMs on the CPU through oneDNN with pre-packed weights.

Stock `F.linear` on a CPU build of torch goes to MKL, which on non-Intel x86 (this project's AMD
EPYC machines) runs its AVX2 code: about 200 GFLOP/s on 2 cores, where oneDNN's AVX-512 kernels
reach about 470 with weights packed once into its blocked layout (`python -m kernels.cpu_gemm`
prints both for the model's shapes). The packed copy is made once per weight when the model runner
starts; the original parameter stays (state dict, GPU path, tests). `BATCHGEN_ONEDNN=0` turns
packing off, and anything oneDNN cannot take falls back to F.linear.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

ENV_SWITCH = "BATCHGEN_ONEDNN"
PACK_BATCH_HINT = 128  # oneDNN picks its blocking for this many rows; measured good from M=8 to 2048


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear ops."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (N, K) fp32 on the CPU -> oneDNN's packed copy, or None where packing does not apply."""
    if not (enabled() and weight.device.type == "cpu" and weight.dtype == torch.float32 and available()):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """x (T, K) @ weight.T -> (T, N), through the packed copy when there is one."""
    if packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return F.linear(x, weight)


def flops_per_s(m: int, k: int, n: int, use_packed: bool, seconds: float = 0.3) -> float:
    """Measured FLOP/s of one (m, k) x (k, n) fp32 product on the CPU, packed oneDNN or F.linear."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    packed = pack(w) if use_packed else None
    if use_packed and packed is None:
        return 0.0
    linear(x, w, packed)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        linear(x, w, packed)
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - t0)


def main() -> None:
    """Print F.linear (MKL) against packed oneDNN for SmolLM2-135M's decode and prefill shapes."""
    print(f"{'m x k x n':>18} {'F.linear GF/s':>14} {'oneDNN packed GF/s':>19}")
    for m, k, n in [(8, 576, 960), (128, 576, 960), (128, 576, 3072), (128, 1536, 576), (128, 576, 49152),
                    (2048, 576, 3072), (1024, 1024, 1024)]:
        print(f"{f'{m}x{k}x{n}':>18} {flops_per_s(m, k, n, False) / 1e9:14.0f} "
              f"{flops_per_s(m, k, n, True) / 1e9:19.0f}")


if __name__ == "__main__":
    main()
