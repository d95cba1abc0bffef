"""Never silently wrong: every key of every supported family's transformers config class is read by
its family (handled, or refused where its value is not implemented) or is one of the keys known not
to change the arithmetic (engine/families/config.py NO_MATH_KEYS); a value batchgen does not
implement is refused when the model loads, naming the file, the key and what is supported."""

from __future__ import annotations

import json
import logging

import pytest

from engine.families import FAMILIES, ModelFileError, read_config, read_model_args
from engine.families.config import NO_MATH_KEYS

# model_type -> the transformers config class of the family
CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                  "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig",
                  "gemma3_text": "Gemma3TextConfig", "phi3": "Phi3Config"}
# values that switch on each config class's optional parts, so that their keys are read too
RICH = {
    "llama": dict(attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}),
    "mistral": dict(sliding_window=4096),
    "qwen2": dict(use_sliding_window=True, sliding_window=4096, max_window_layers=2),
    "qwen3": dict(use_sliding_window=True, sliding_window=4096, max_window_layers=2, attention_bias=True),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=4096, mlp_only_layers=[0],
                      decoder_sparse_step=2, norm_topk_prob=True),
    "mixtral": dict(sliding_window=4096),
    "gemma3_text": dict(attention_bias=True),
    "phi3": dict(sliding_window=2047),
}


def _config_class(model_type: str):
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, CONFIG_CLASSES[model_type])


def test_every_family_has_its_transformers_config_class():
    assert {family.model_types[0] for family in FAMILIES} == set(CONFIG_CLASSES)


@pytest.mark.parametrize("variant", ["defaults", "rich"])
@pytest.mark.parametrize("model_type", list(CONFIG_CLASSES))
def test_every_config_key_is_handled_refused_or_known_not_to_change_the_math(model_type, variant):
    cls = _config_class(model_type)
    config = cls(**(RICH[model_type] if variant == "rich" else {})).to_dict()
    keys = set(config) | set(cls.attribute_map)  # num_experts / num_local_experts spell one field
    for key in keys - set(config):
        config[key] = config.get(cls.attribute_map[key])
    read = read_config(config, f"{model_type}/config.json")
    assert read.unknown_keys == [], f"{model_type}: keys neither read by its family nor in NO_MATH_KEYS"


def test_an_unknown_key_is_reported_when_the_model_loads(caplog):
    config = _config_class("llama")().to_dict()
    config["use_qk_clip"] = True
    assert read_config(config, "x/config.json").unknown_keys == ["use_qk_clip"]
    with caplog.at_level(logging.WARNING, logger="engine.families"):
        read_model_args(config, "x/config.json")
    assert "x/config.json: keys batchgen does not know" in caplog.text and "use_qk_clip" in caplog.text


def test_no_math_keys_are_not_ones_a_family_reads():
    """A key the families read must not also be waved through as arithmetic-free."""
    read_keys = set()
    for model_type in CONFIG_CLASSES:
        cls = _config_class(model_type)
        for variant in ({}, RICH[model_type]):
            config = cls(**variant).to_dict()
            read_keys |= set(config) - set(read_config(config, "c").unknown_keys) - NO_MATH_KEYS
    assert not read_keys & NO_MATH_KEYS


def _llama(**changes) -> dict:
    config = _config_class("llama")(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, vocab_size=100).to_dict()
    config.update(changes)
    return config


@pytest.mark.parametrize("model_type, changes, message", [
    ("llama", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                    "long_factor": [1.0] * 8}),
     r"rope_parameters: rope_type 'longrope' is not supported "
     r"\(supported: default, linear, dynamic, yarn, llama3\)"),
    ("llama", dict(rope_parameters=None, rope_scaling={"type": "su", "factor": 2.0}, rope_theta=1e4),
     r"rope_type 'su' is not supported"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2]}),
     r"rope_parameters: mrope_section not supported"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     r"rope_type 'llama3' needs low_freq_factor"),
    ("llama", dict(partial_rotary_factor=0.5), r"partial_rotary_factor 0.5 is not supported"),
    ("llama", dict(hidden_act="gelu"), r"hidden_act = 'gelu' is not supported \(supported: silu, swish, "
                                       r"gelu_pytorch_tanh\)"),
    ("llama", dict(quantization_config={"quant_method": "awq"}),
     r"quantization_config = .*\(quantized checkpoints are not supported"),
    ("llama", dict(model_type="gpt_neox"),
     r"model_type 'gpt_neox' is not supported \(supported: gemma3_text, llama, mistral, mixtral, phi3, "
     r"qwen2, qwen3, qwen3_moe\)"),
    ("llama", dict(num_key_value_heads=3),
     r"num_attention_heads \(4\) is not a multiple of num_key_value_heads"),
    ("llama", dict(hidden_size="64"), r"hidden_size must be a positive integer"),
    ("gemma3_text", dict(final_logit_softcapping=30.0), r"final_logit_softcapping = 30.0 is not supported "
                                                        r"\(logit soft-capping"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), r"attn_logit_softcapping = 50.0 is not supported"),
    ("gemma3_text", dict(use_bidirectional_attention=True), r"use_bidirectional_attention = True"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                          "full_attention": {"rope_type": "default"}}),
     r"rope_parameters.sliding_attention.rope_type = 'linear' is not supported"),
    ("qwen2", dict(use_sliding_window=False, layer_types=["full_attention", "sliding_attention"]),
     r"layer_types has sliding layers but use_sliding_window is false"),
    ("qwen2", dict(layer_types=["full_attention"]), r"layer_types must list"),
    ("qwen3_moe", dict(num_experts=4, num_local_experts=8), r"num_experts and num_local_experts disagree"),
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                   "long_factor": [1.0] * 8}),
     r"rope_type 'longrope' is not supported"),
])
def test_unimplemented_values_are_refused_naming_file_and_key(model_type, changes, message):
    cls = _config_class(model_type)
    config = cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=100, head_dim=16).to_dict()
    config.update(changes)
    with pytest.raises(ModelFileError, match=r"^m/config\.json: .*" + message):
        read_config(config, "m/config.json")


def test_a_refused_config_stops_llm_naming_the_file(tmp_path):
    from engine import LLM
    from engine.loader import save_hf_dir, tiny_random_checkpoint

    save_hf_dir(tiny_random_checkpoint(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = rf"{tmp_path}/config\.json: rope_parameters: rope_type 'longrope'"
    with pytest.raises(ModelFileError, match=message):
        LLM(str(tmp_path), num_kv_blocks=8)


def test_llama3_config_is_read_with_its_scaling():
    """The silent failure this work started from: a Llama 3.1 config.json (transformers >= 5 spelling)."""
    args = read_model_args(_llama(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}))
    assert args.rope_theta == 500000.0 and args.rope_scaling.type == "llama3"
    assert (args.rope_scaling.factor, args.rope_scaling.original_max_position_embeddings) == (8.0, 8192)
    assert not args.plain_llama or args.rope_scaling is not None  # the fast CPU path keeps rope tables


def test_models_list_names_every_family_and_what_it_covers():
    from click.testing import CliRunner

    from jobs.cli import cli

    listed = CliRunner().invoke(cli, ["models", "list"])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    columns = ["FAMILY", "MODEL_TYPE", "GGUF", "COVERS"]
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == columns)
    rows = {}
    for family in FAMILIES:
        rows[family.name] = next(line for line in lines[header + 1:] if line.startswith(family.name + " "))
        assert family.model_types[0] in rows[family.name] and family.covers in rows[family.name]
    assert "llama with experts" in rows["Mixtral"] and "qwen3moe" in rows["Qwen3-MoE"]
