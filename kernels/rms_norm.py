"""RMSNorm and the fused residual-add RMSNorm: Triton kernel, launcher, torch reference."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Llama RMSNorm: normalise in fp32, cast back, then scale by the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; returns (rms_norm(residual_out), residual_out)."""
    residual_out = x + residual
    return rms_norm_ref(residual_out, weight, eps), residual_out
