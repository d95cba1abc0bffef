"""The gated MLP's activation-and-multiply: SiLU (SwiGLU, Llama) and GELU-tanh (GeGLU, Gemma). Triton
kernel, launcher, torch references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels._triton import tl, triton


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (T, 2I) rows [gate | up], last dim contiguous
    out_ptr,  # (T, I) contiguous
    x_row_stride,
    inter,  # I, the intermediate size
    GELU_TANH: tl.constexpr,  # the gate's activation: GELU's tanh form, else SiLU
    BLOCK: tl.constexpr,
):
    """Program (t, j) covers columns j*BLOCK.. of row t, in fp32: out = silu(gate) * up with
    silu(g) = g / (1 + exp(-g)), or gelu(gate) * up with gelu(g) = g/2 (1 + tanh(y)),
    y = sqrt(2/pi) (g + 0.044715 g^3), computed as g sigmoid(2y) (tanh(y) = 2 sigmoid(2y) - 1)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < inter
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + inter + cols, mask=in_row, other=0.0).to(tl.float32)
    if GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        # g/2 (1 + tanh(y)) = g sigmoid(2y); past +-40 the sigmoid is 1 or 0 to fp32's precision, and
        # the clamp keeps its exp from overflowing
        out = gate * tl.sigmoid(tl.minimum(tl.maximum(2.0 * inner, -40.0), 40.0)) * up
    else:
        out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


def silu_and_mul_triton(x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """Launch a (T, I/BLOCK) grid over x (T, 2I); returns (T, I). gelu_tanh: the GELU-tanh gate."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: x must be (T, 2I) with a contiguous last dim, got {tuple(x.shape)}")
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(inter, 1)))
    if num_rows and inter:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](x, out, x.stride(0), inter,
                                                                   GELU_TANH=gelu_tanh, BLOCK=block)
    return out


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> gelu_tanh(gate) * up, (T, I)."""
    return silu_and_mul_triton(x, gelu_tanh=True)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> silu(gate) * up, (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> gelu(gate, tanh approximation) * up, (T, I): transformers'
    gelu_pytorch_tanh (Gemma)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> silu(gate) * up, (T, I)."""
    stride = cpu_native.row_stride(x, "silu_and_mul")
    if x.shape[1] % 2:
        raise ValueError(f"native silu_and_mul: x needs [gate | up] halves, got an odd width {x.shape[1]}")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)
    cpu_native.kernel("silu_and_mul", x.dtype)(x.data_ptr(), stride, out.data_ptr(), rows, inter,
                                                torch.get_num_threads())
    return out
