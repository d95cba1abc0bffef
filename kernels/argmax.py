"""Row-wise argmax over logits, the sampler's greedy pick: the torch reference and the cpu-native
kernel (torch.argmax over a (64, 49152) fp32 block takes ~4.5 ms on 2 cores, ~12x its max)."""

from __future__ import annotations

import torch

from kernels import cpu_native


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """x (S, V) -> (S,) int64: the first index of each row's maximum (of its first NaN, if any)."""
    return x.argmax(dim=-1)


def argmax_native(x: torch.Tensor) -> torch.Tensor:
    """argmax_ref through the C kernel: x (S, V) fp32 on the CPU with a contiguous last dim."""
    stride = cpu_native.row_stride(x, "argmax")
    if x.dtype != torch.float32:
        raise ValueError(f"native argmax: needs float32 rows, got {x.dtype}")
    rows, cols = x.shape
    if cols == 0 or cols >= 2**31:
        raise ValueError(f"native argmax: rows of 1 .. 2**31 - 1 values, got {cols}")
    out = torch.empty(rows, dtype=torch.int64)
    cpu_native.library().argmax_rows_f32(x.data_ptr(), stride, rows, cols, out.data_ptr(),
                                         torch.get_num_threads())
    return out
