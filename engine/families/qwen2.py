"""Qwen2 / Qwen2.5: Llama with biases on q/k/v (not o), and sliding-window layers from
max_window_layers on when use_sliding_window is true (transformers' Qwen2Config rule), or as
layer_types lists them."""

from __future__ import annotations

from engine.families.base import Family
from engine.families.config import ConfigReader, ModelFileError, read_activation, read_common, read_rope
from engine.model_args import FULL, SLIDING, ModelArgs


def read(cfg: ConfigReader) -> ModelArgs:
    common = read_common(cfg)
    theta, scaling = read_rope(cfg)
    return ModelArgs(**common, rope_theta=theta, rope_scaling=scaling, qkv_bias=True,
                     activation=read_activation(cfg), **qwen_layer_windows(cfg, common["n_layers"]))


def qwen_layer_windows(cfg: ConfigReader, n_layers: int) -> dict:
    """Qwen2/Qwen3's sliding layers: none unless use_sliding_window; then layer_types, or every layer
    from max_window_layers on."""
    window = cfg.get("sliding_window")  # read either way: transformers drops it unless use_sliding_window
    if not cfg.flag("use_sliding_window", False):
        window = None
    max_window_layers = cfg.get("max_window_layers", 28)
    types = cfg.get("layer_types")
    if types is None:
        types = [SLIDING if window is not None and i >= max_window_layers else FULL for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {FULL, SLIDING}:
        raise ModelFileError(f"{cfg.source}: layer_types must list {FULL!r} or {SLIDING!r} for each of the "
                             f"{n_layers} layers, got {types!r}")
    if SLIDING not in types:
        return {}
    if window is None:
        raise ModelFileError(f"{cfg.source}: layer_types has sliding layers but use_sliding_window is false "
                             "or sliding_window is null")
    return dict(sliding_window=cfg.positive_int("sliding_window"), layer_types=tuple(types))


FAMILY = Family(
    name="Qwen2", model_types=("qwen2",), read=read,
    covers="Qwen2 / Qwen2.5: q/k/v biases; sliding layers (use_sliding_window, max_window_layers)",
)
