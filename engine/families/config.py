"""Reading a config.json for a family: every key it reads is remembered, every refusal names the file.

A family reads the keys that change the arithmetic through a `ConfigReader` and either handles each
one or refuses its value (`refuse`, `allow`). What is left, `unread()`, must be in NO_MATH_KEYS (keys
known not to change a forward pass); anything else is a key batchgen does not know, which the loader
reports (tests/engine/test_family_configs.py walks every supported family's transformers config class
so that no key of theirs is left in that state).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.model_args import ACTIVATIONS, ROPE_TYPES, RopeScaling


class ModelFileError(ValueError):
    """A model file or directory that cannot be loaded; the message names the file."""


# config.json keys that do not change a forward pass, each with why
NO_MATH_KEYS = frozenset({
    # bookkeeping: where the config came from, which classes transformers builds, its own version
    "_name_or_path", "architectures", "model_type", "transformers_version", "auto_map", "name_or_path",
    "_commit_hash", "_attn_implementation_autoset", "attn_implementation", "_experts_implementation",
    # the dtype the weights were saved in: the engine runs in the dtype the user asks for
    "torch_dtype", "dtype",
    # what transformers' forward returns or caches, not what it computes
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "output_router_logits", "cache_implementation", "chunk_size_feed_forward", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "tie_encoder_decoder", "pruned_heads", "tf_legacy_loss",
    "use_bfloat16",
    # classification heads and task metadata
    "id2label", "label2id", "problem_type", "num_labels", "finetuning_task", "task_specific_params",
    "prefix", "tokenizer_class", "sep_token_id", "decoder_start_token_id",
    # training only: initialisation, dropout, auxiliary losses, router noise
    "initializer_range", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
    "router_aux_loss_coef", "router_z_loss_coef", "router_jitter_noise", "gradient_checkpointing",
    # special token ids: the tokenizer and generation_config.json own them (eos ends a sequence there)
    "bos_token_id", "eos_token_id", "pad_token_id",
    # sampling defaults older transformers wrote into config.json: a job's parameters decide sampling
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
    # transformers >= 4.40 reads it nowhere: the slices of pretraining tensor parallelism
    "pretraining_tp",
})

# keys inside rope_parameters / rope_scaling, by the rope types that read them
_ROPE_KEYS = {
    "rope_type": ROPE_TYPES, "type": ROPE_TYPES, "rope_theta": ROPE_TYPES,
    "factor": ("linear", "dynamic", "yarn", "llama3"),
    "original_max_position_embeddings": ("yarn", "llama3"),
    "low_freq_factor": ("llama3",), "high_freq_factor": ("llama3",),
    "beta_fast": ("yarn",), "beta_slow": ("yarn",), "attention_factor": ("yarn",), "mscale": ("yarn",),
    "mscale_all_dim": ("yarn",), "truncate": ("yarn",), "partial_rotary_factor": ROPE_TYPES,
}
_MISSING = object()


class ConfigReader:
    """A config.json dict that records the keys read and refuses values with the file and key named."""

    def __init__(self, config: dict, source: str) -> None:
        self.config = config
        self.source = source  # the file, for messages
        self.read: set[str] = set()

    def has(self, key: str) -> bool:
        self.read.add(key)
        return self.config.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        """The value, or default where the key is missing or null."""
        self.read.add(key)
        value = self.config.get(key)
        return default if value is None else value

    def positive_int(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, default)
        if value is _MISSING:
            raise ModelFileError(f"{self.source}: missing required key {key}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelFileError(f"{self.source}: {key} must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ModelFileError(f"{self.source}: {key} must be a number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ModelFileError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value

    def aliased_positive_int(self, *keys: str) -> int:
        """One field that transformers spells several ways (its attribute_map): the value of whichever
        keys are set, refused if two of them disagree."""
        values = {key: self.get(key) for key in keys}
        given = {key: value for key, value in values.items() if value is not None}
        if len(set(given.values())) > 1:
            raise ModelFileError(f"{self.source}: {' and '.join(given)} disagree ({given})")
        return self.positive_int(next(iter(given), keys[0]))

    def refuse(self, key: str, value: Any, supported: str) -> None:
        raise ModelFileError(f"{self.source}: {key} = {value!r} is not supported ({supported})")

    def allow(self, key: str, allowed: Iterable, supported: str, default: Any = None) -> Any:
        """The value if it is one of `allowed` (missing or null reads as `default`), else a refusal."""
        value = self.get(key, default)
        if value not in tuple(allowed):
            self.refuse(key, value, supported)
        return value

    def unread(self) -> list[str]:
        """Keys neither read by the family nor known not to change the arithmetic."""
        return sorted(set(self.config) - self.read - NO_MATH_KEYS)


def read_common(cfg: ConfigReader, head_dim: int | None = None, tie_word_embeddings: bool = False) -> dict:
    """The Llama-shaped keys every family has, as ModelArgs fields, with the checks they share. The
    arguments are the family's defaults where its transformers config class differs from Llama's
    (head_dim None: hidden_size / num_attention_heads)."""
    heads = cfg.positive_int("num_attention_heads")
    hidden = cfg.positive_int("hidden_size")
    if head_dim is None:
        head_dim = hidden // heads if hidden % heads == 0 else _MISSING
    head_dim = cfg.positive_int("head_dim", head_dim)
    kv_heads = cfg.positive_int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelFileError(f"{cfg.source}: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
    cfg.allow("quantization_config", (None,), "quantized checkpoints are not supported; give the "
              "unquantized weights (bf16, fp16 or fp32 safetensors) or a GGUF file")
    return dict(
        dim=hidden, n_layers=cfg.positive_int("num_hidden_layers"), n_heads=heads, n_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=cfg.positive_int("intermediate_size"),
        vocab_size=cfg.positive_int("vocab_size"), norm_eps=cfg.number("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.positive_int("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", tie_word_embeddings),
    )


def read_activation(cfg: ConfigReader, key: str = "hidden_act", default: str = "silu") -> str:
    """The MLP gate's activation as ModelArgs names it."""
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    value = cfg.allow(key, names, f"supported: {', '.join(names)}", default)
    assert names[value] in ACTIVATIONS
    return names[value]


def read_rope(cfg: ConfigReader, params: dict | None = None, default_theta: float = 10000.0
              ) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from rope_parameters (transformers >= 5) or rope_theta + rope_scaling (older
    files), or from `params` (one layer type's entry of a nested rope_parameters). Unknown rope
    types, partial rotary and keys no supported type reads are refused."""
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
    cfg.get("original_max_position_embeddings")  # Phi-3's, for the scaled types (read in _scaling)
    where = f"{cfg.source}: rope_parameters"
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelFileError(f"{where}: rope_type {rope_type!r} is not supported "
                             f"(supported: {', '.join(ROPE_TYPES)})")
    unknown = sorted(key for key, value in params.items() if value is not None and key not in _ROPE_KEYS)
    if unknown:
        raise ModelFileError(f"{where}: {', '.join(unknown)} not supported "
                             f"(known keys: {', '.join(_ROPE_KEYS)})")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelFileError(f"{where}: partial_rotary_factor {partial} is not supported (the rotary "
                             "embedding covers the whole head: 1.0)")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta", default_theta))
    if rope_type == "default":
        return theta, None
    return theta, _scaling(cfg, params, rope_type, where)


def _scaling(cfg: ConfigReader, params: dict, rope_type: str, where: str) -> RopeScaling:
    def need(key: str):
        if params.get(key) is None:
            raise ModelFileError(f"{where}: rope_type {rope_type!r} needs {key}")
        return params[key]

    # transformers gives Phi-3's top-level original_max_position_embeddings priority
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings")
    fields = dict(type=rope_type, original_max_position_embeddings=original)
    if rope_type == "llama3":
        fields.update(factor=need("factor"), low_freq_factor=need("low_freq_factor"),
                      high_freq_factor=need("high_freq_factor"))
    elif rope_type == "yarn":
        factor = params.get("factor")
        fields.update(factor=cfg.get("max_position_embeddings") / original if factor is None else factor,
                      beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
                      attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
                      mscale_all_dim=params.get("mscale_all_dim"), truncate=params.get("truncate", True))
    else:  # linear, dynamic
        fields.update(factor=need("factor"))
    return RopeScaling(**fields)
