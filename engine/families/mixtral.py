"""Mixtral: Mistral's attention, and an MLP of num_local_experts experts (w1 gate, w3 up, w2 down) of
which each token takes num_experts_per_tok, weighted by the softmax of the router's logits over all
experts, always renormalised over the chosen ones."""

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
                     num_experts=cfg.aliased_positive_int("num_local_experts", "num_experts"),
                     num_experts_per_tok=cfg.positive_int("num_experts_per_tok"),
                     moe_intermediate_size=common["intermediate_size"], norm_topk_prob=True,
                     **every_layer_window(cfg, common["n_layers"]))


FAMILY = Family(
    name="Mixtral", model_types=("mixtral",), read=read,
    covers="Mixtral 8x7B / 8x22B: top-k softmax routing, renormalised; sliding_window when set",
    names=TensorNames(router="block_sparse_moe.gate", expert="block_sparse_moe.experts.{e}",
                      expert_gate_up=("w1", "w3"), expert_down="w2"),
)
