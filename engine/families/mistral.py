"""Mistral: Llama with an explicit head_dim and, when sliding_window is set, a sliding window on
every layer (each query sees sliding_window keys, itself included)."""

from __future__ import annotations

from engine.families.base import Family
from engine.families.config import ConfigReader, read_activation, read_common, read_rope
from engine.model_args import SLIDING, ModelArgs


def read(cfg: ConfigReader) -> ModelArgs:
    common = read_common(cfg)
    theta, scaling = read_rope(cfg)
    cfg.get("layer_types")  # transformers' Mistral warns and ignores it (Ministral reads it)
    return ModelArgs(**common, rope_theta=theta, rope_scaling=scaling, activation=read_activation(cfg),
                     **every_layer_window(cfg, common["n_layers"]))


def every_layer_window(cfg: ConfigReader, n_layers: int) -> dict:
    """sliding_window, when set, on every layer (Mistral, Mixtral, Phi-3, Qwen3-MoE)."""
    window = cfg.get("sliding_window")
    if window is None:
        return {}
    window = cfg.positive_int("sliding_window")
    return dict(sliding_window=window, layer_types=(SLIDING,) * n_layers)


FAMILY = Family(
    name="Mistral", model_types=("mistral",), read=read,
    covers="Mistral 7B / Nemo / Small: sliding_window when set; rope as Llama",
)
