"""Llama 2 and 3.x (and the checkpoints built on it: SmolLM2, TinyLlama, ...): the base decoder.

Rope scaling: default, linear, dynamic (within max_position_embeddings), yarn and llama3, spelled as
rope_scaling + rope_theta or as transformers >= 5's rope_parameters. attention_bias puts biases on
q/k/v and o, mlp_bias on gate/up/down.
"""

from __future__ import annotations

from engine.families.base import Family
from engine.families.config import ConfigReader, read_activation, read_common, read_rope
from engine.model_args import ModelArgs


def read(cfg: ConfigReader) -> ModelArgs:
    theta, scaling = read_rope(cfg)
    bias = cfg.flag("attention_bias", False)
    return ModelArgs(**read_common(cfg), rope_theta=theta, rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
                     mlp_bias=cfg.flag("mlp_bias", False), activation=read_activation(cfg))


FAMILY = Family(
    name="Llama", model_types=("llama",), read=read,
    covers="Llama 2 / 3.x, SmolLM2: rope default, linear, dynamic, yarn, llama3; attention_bias, mlp_bias",
)
