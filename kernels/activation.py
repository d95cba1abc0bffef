"""SiLU-and-multiply (the SwiGLU gate of the Llama MLP): Triton kernel, launcher, torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> silu(gate) * up, (T, I)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
