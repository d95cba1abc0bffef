"""Qwen3: Qwen2's layer windows with an RMSNorm over each head of q and k before the rotary, an
explicit head_dim, and biases only with attention_bias (then on q/k/v and o)."""

from __future__ import annotations

from engine.families.base import Family
from engine.families.config import ConfigReader, read_activation, read_common, read_rope
from engine.families.qwen2 import qwen_layer_windows
from engine.model_args import ModelArgs


def read(cfg: ConfigReader) -> ModelArgs:
    common = read_common(cfg)
    theta, scaling = read_rope(cfg)
    bias = cfg.flag("attention_bias", False)
    return ModelArgs(**common, rope_theta=theta, rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
                     qk_norm=True, activation=read_activation(cfg),
                     **qwen_layer_windows(cfg, common["n_layers"]))


FAMILY = Family(
    name="Qwen3", model_types=("qwen3",), read=read,
    covers="Qwen3 dense: q/k RMSNorm, explicit head_dim, attention_bias; sliding layers as Qwen2",
)
