"""The rotary embedding's cos/sin table for each rope_scaling type a Llama-style checkpoint uses.

`cos_sin_table` gives the (max_pos, head_dim) table the rotary kernels read: cos(pos * f_i) * a in
the first head_dim/2 columns, sin(pos * f_i) * a in the last, with f_i the inverse frequencies of
the checkpoint's rope type and a its attention factor (1 except for yarn). The arithmetic is done in
float32 in the order Hugging Face transformers does it, so the table equals the cos/sin that
transformers computes for the same config before both are cast to the model's dtype.

- default: f_i = theta^(-2i/D).
- linear: f_i / factor (positions interpolated).
- dynamic (NTK): theta grows once a sequence passes max_position_embeddings; within it the
  frequencies are default's, and the engine serves no longer sequences (max_model_len is capped
  there), so the table is default's.
- llama3: wavelengths 2*pi/f_i longer than original/low_freq_factor are divided by factor, shorter
  than original/high_freq_factor kept, and those between blended smoothly.
- yarn: each dimension blends interpolated (f_i / factor) and extrapolated (f_i) frequencies by a
  linear ramp between the correction dimensions of beta_fast and beta_slow rotations over the
  original context, and cos/sin are scaled by the attention factor (0.1 ln(factor) + 1 by default).
"""

from __future__ import annotations

import math

import torch

from engine.model_args import RopeScaling


def cos_sin_table(head_dim: int, max_pos: int, theta: float, scaling: RopeScaling | None,
                  dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """(max_pos, head_dim) in dtype: [cos | sin] of every position's angles, times the attention factor."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    scaling = scaling or RopeScaling()
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_pos, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)  # (max_pos, D/2)
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat([cos, sin], dim=-1).to(dtype=dtype, device=device)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """(head_dim/2,) float32 inverse frequencies and the cos/sin factor of one rope type."""
    if scaling.type == "yarn":
        return _yarn(head_dim, theta, scaling)
    inv_freq = _default(head_dim, theta)
    if scaling.type == "linear":
        inv_freq /= scaling.factor
    elif scaling.type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq, 1.0  # default, and dynamic within max_position_embeddings


def _default(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponents)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    original = s.original_max_position_embeddings
    low_freq_wavelen = original / s.low_freq_factor
    high_freq_wavelen = original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    factor, original = s.factor, s.original_max_position_embeddings
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(s, head_dim, theta, original)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # (D/2,) 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, _yarn_attention_factor(s)


def _yarn_correction_range(s: RopeScaling, dim: int, theta: float, original: int) -> tuple[float, float]:
    """The dimensions where beta_fast and beta_slow full rotations fit in the original context."""
    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)
