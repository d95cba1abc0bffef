"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, and an MLP of num_experts experts of which
each token takes num_experts_per_tok, weighted by the softmax of the router's logits over all
experts (renormalised over the chosen ones when norm_topk_prob). Layers in mlp_only_layers, or off
the decoder_sparse_step grid, keep a dense MLP of intermediate_size."""

from __future__ import annotations

from engine.families.base import Family
from engine.families.config import ConfigReader, read_activation, read_common, read_rope
from engine.families.layout import TensorNames
from engine.families.mistral import every_layer_window
from engine.model_args import ModelArgs


def read(cfg: ConfigReader) -> ModelArgs:
    common = read_common(cfg)
    theta, scaling = read_rope(cfg)
    bias = cfg.flag("attention_bias", False)
    experts = cfg.aliased_positive_int("num_experts", "num_local_experts")  # transformers' attribute_map
    step = cfg.positive_int("decoder_sparse_step", 1)
    mlp_only = cfg.get("mlp_only_layers", [])
    dense = tuple(i for i in range(common["n_layers"]) if i in mlp_only or (i + 1) % step)
    windows = every_layer_window(cfg, common["n_layers"])  # sliding_window read either way
    if not cfg.flag("use_sliding_window", False):
        windows = {}  # transformers drops sliding_window unless use_sliding_window
    return ModelArgs(**common, rope_theta=theta, rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
                     qk_norm=True, activation=read_activation(cfg), num_experts=experts,
                     num_experts_per_tok=cfg.positive_int("num_experts_per_tok"),
                     moe_intermediate_size=cfg.positive_int("moe_intermediate_size"),
                     norm_topk_prob=cfg.flag("norm_topk_prob", False), dense_layers=dense, **windows)


FAMILY = Family(
    name="Qwen3-MoE", model_types=("qwen3_moe",), read=read,
    covers="Qwen3-MoE: top-k softmax routing (norm_topk_prob), mlp_only_layers, decoder_sparse_step",
    names=TensorNames(),
)
