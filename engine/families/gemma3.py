"""Gemma 3 text (gemma3_text; the 1B, and the language model of the larger ones saved on its own).

Its differences from Llama, each a ModelArgs field: sliding-window layers alternating with global
ones (layer_types, or every sliding_window_pattern-th layer global) with their own rope bases
(rope_local_base_freq for the sliding ones), RMSNorms that scale by (1 + w) in fp32, norms on the
attention and MLP outputs before each residual add, a per-head RMSNorm of q and k, embeddings
scaled by sqrt(hidden_size), a GELU-tanh gate, and softmax scale query_pre_attn_scalar^-0.5.
Logit soft-capping (Gemma 2's) and bidirectional attention are refused.
"""

from __future__ import annotations

from engine.families.base import Family
from engine.families.config import ConfigReader, ModelFileError, read_activation, read_common, read_rope
from engine.families.layout import TensorNames
from engine.model_args import FULL, SLIDING, ModelArgs

# Gemma3TextConfig's own defaults where they differ from Llama's
DEFAULT_HEAD_DIM, DEFAULT_WINDOW, DEFAULT_PATTERN = 256, 4096, 6
DEFAULT_THETA, DEFAULT_LOCAL_THETA, DEFAULT_QUERY_SCALAR = 1_000_000.0, 10_000.0, 256


def read(cfg: ConfigReader) -> ModelArgs:
    common = read_common(cfg, head_dim=DEFAULT_HEAD_DIM, tie_word_embeddings=True)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cfg.allow(key, (None,), "logit soft-capping is not implemented (Gemma 3 sets none)")
    cfg.allow("use_bidirectional_attention", (False,), "only causal attention", default=False)
    cfg.get("hidden_act")  # transformers' Gemma 3 reads hidden_activation; an older hidden_act is unused
    theta, scaling, local_theta = _ropes(cfg)
    bias = cfg.flag("attention_bias", False)
    return ModelArgs(
        **common, rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
        qkv_bias=bias, o_bias=bias, qk_norm=True, norm_unit_offset=True, sandwich_norms=True,
        activation=read_activation(cfg, "hidden_activation", "gelu_pytorch_tanh"),
        embed_scale=common["dim"] ** 0.5,
        attn_scale=cfg.number("query_pre_attn_scalar", DEFAULT_QUERY_SCALAR) ** -0.5,
        sliding_window=cfg.positive_int("sliding_window", DEFAULT_WINDOW),
        layer_types=_layer_types(cfg, common["n_layers"]),
    )


def _layer_types(cfg: ConfigReader, n_layers: int) -> tuple[str, ...]:
    """layer_types, else every pattern-th layer global (transformers' rule for older files)."""
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", DEFAULT_PATTERN))
    if types is None:
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {FULL, SLIDING}:
        raise ModelFileError(f"{cfg.source}: layer_types must list {FULL!r} or {SLIDING!r} for each of the "
                             f"{n_layers} layers, got {types!r}")
    return tuple(types)


def _ropes(cfg: ConfigReader) -> tuple[float, object, float]:
    """(global theta, global scaling, sliding layers' theta): a rope_parameters dict per layer type
    (transformers >= 5), or rope_theta / rope_scaling for the global layers and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        theta, scaling = read_rope(cfg, dict(params.get(FULL) or {}), DEFAULT_THETA)
        local_theta, local_scaling = read_rope(cfg, dict(params.get(SLIDING) or {}), DEFAULT_LOCAL_THETA)
        if local_scaling is not None:
            cfg.refuse("rope_parameters.sliding_attention.rope_type", local_scaling.type,
                       "the sliding layers' rotary embedding is plain (rope_type default)")
        return theta, scaling, local_theta
    theta, scaling = read_rope(cfg, default_theta=DEFAULT_THETA)
    return theta, scaling, cfg.number("rope_local_base_freq", DEFAULT_LOCAL_THETA)


FAMILY = Family(
    name="Gemma 3", model_types=("gemma3_text",), read=read,
    covers="Gemma 3 text: sliding/global layers and their rope bases, (1 + w) sandwich norms, q/k norms, "
           "scaled embeddings, GELU-tanh, query_pre_attn_scalar; no soft-capping",
    names=TensorNames(pre_mlp_norm="pre_feedforward_layernorm", attn_output_norm="post_attention_layernorm",
                      mlp_output_norm="post_feedforward_layernorm"),
)
