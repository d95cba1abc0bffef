"""RMSNorm and the fused residual-add RMSNorm: Triton kernel, launcher, torch reference.

Two forms of the scale, as transformers has them: Llama's `weight * cast(normed)` (the normalised
row rounded to the input dtype, then scaled), and Gemma's `cast(normed * (1 + weight))` (unit_offset:
scaled by 1 + w in fp32, rounded once)."""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels._triton import tl, triton


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (T, D) input rows, last dim contiguous
    residual_ptr,  # (T, D) residual rows; read only when HAS_RESIDUAL
    residual_out_ptr,  # (T, D) x + residual, written when HAS_RESIDUAL (may alias residual_ptr)
    weight_ptr,  # (D,) per-channel scale
    out_ptr,  # (T, D) normalised rows, contiguous
    x_row_stride,
    residual_row_stride,
    eps,
    D,
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,  # Gemma: out = cast(h * rsqrt(...) * (1 + weight))
    BLOCK_D: tl.constexpr,
):
    """One program per row t: h = x[t] (+ residual[t], rounded to the input dtype and written out),
    out[t] = weight * cast(h * rsqrt(mean(h^2) + eps)), all arithmetic in fp32; with UNIT_OFFSET
    out[t] = cast(h * rsqrt(mean(h^2) + eps) * (1 + weight))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < D
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=in_row, other=0.0)
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=in_row, other=0.0)
        summed = (h + residual.to(tl.float32)).to(x.dtype)  # the residual stream keeps the model dtype
        tl.store(residual_out_ptr + row * D + cols, summed, mask=in_row)
        h = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = h * inv_rms * (1.0 + weight)
    else:
        out = weight * (h * inv_rms).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch one program per row; returns (out, residual_out), residual_out None without residual."""
    _check_rows(x, weight, residual)
    num_rows, hidden = x.shape
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    residual_out = None if residual is None else torch.empty_like(out)
    _rms_norm_kernel[(num_rows,)](
        x, x if residual is None else residual, out if residual_out is None else residual_out, weight, out,
        x.stride(0), 0 if residual is None else residual.stride(0), eps, hidden,
        HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK_D=triton.next_power_of_2(hidden),
    )
    return out, residual_out


def _check_rows(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x must be (T, D) with a contiguous last dim, got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: weight must be ({x.shape[1]},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
                 ) -> torch.Tensor:
    """Hugging Face Llama RMSNorm: normalise in fp32, cast back, then scale by the weight. With
    unit_offset, Gemma's: scale by (1 + weight) in fp32, then cast."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; returns (rms_norm(residual_out), residual_out)."""
    residual_out = x + residual
    return rms_norm_ref(residual_out, weight, eps, unit_offset), residual_out


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * rms-normalised r, r) with r = x + residual, or r = x (returned as None) without one.
    x (T, D); the same contract as kernels.rms_norm's references."""
    stride = cpu_native.row_stride(x, "rms_norm")
    rows, dim = x.shape
    if weight.numel() != dim or (residual is not None and residual.shape != x.shape):
        got = "" if residual is None else f", residual {tuple(residual.shape)}"
        raise ValueError(f"native rms_norm: x {tuple(x.shape)} needs a weight of {dim} and a residual of its "
                         f"shape; got weight {weight.numel()}{got}")
    out = torch.empty((rows, dim), dtype=x.dtype)
    residual_out = None
    if residual is not None:
        residual = residual.contiguous()
        residual_out = torch.empty((rows, dim), dtype=x.dtype)
    weight = weight.contiguous()
    cpu_native.kernel("rms_norm", x.dtype)(
        x.data_ptr(), stride, None if residual is None else residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), None if residual_out is None else residual_out.data_ptr(), rows, dim, eps,
        torch.get_num_threads())
    return out, residual_out
