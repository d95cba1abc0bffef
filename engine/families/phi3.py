"""Phi-3 (mini, small-context medium) and Phi-4 without partial rotary: Llama with q/k/v stored as
one qkv_proj and gate/up as one gate_up_proj, and sliding_window (when set) on every layer. LongRoPE
(the 128k variants) and partial rotary (Phi-4-mini) are refused."""

from __future__ import annotations

from engine.families.base import Family
from engine.families.config import ConfigReader, read_activation, read_common, read_rope
from engine.families.layout import TensorNames
from engine.families.mistral import every_layer_window
from engine.model_args import ModelArgs


def read(cfg: ConfigReader) -> ModelArgs:
    common = read_common(cfg)
    theta, scaling = read_rope(cfg)
    return ModelArgs(**common, rope_theta=theta, rope_scaling=scaling, activation=read_activation(cfg),
                     **every_layer_window(cfg, common["n_layers"]))


FAMILY = Family(
    name="Phi-3", model_types=("phi3",), read=read,
    covers="Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, sliding_window; no longrope, no partial rotary",
    names=TensorNames(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)),
)
