"""engine.loader: HF directories, GGUF files (synthetic and the real SmolLM2), tiny-random, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.loader import (
    Checkpoint,
    ModelFileError,
    expected_shapes,
    load_checkpoint,
    load_gguf,
    load_hf_dir,
    save_hf_dir,
    tiny_random_checkpoint,
    unpermute_rope_rows,
)
from engine.registry import ResolvedModel, resolve_model
from engine.tokenizer import ByteTokenizer, Tokenizer
from tests.engine.conftest import TINY_GGUF_CONFIG, llama_cpp_permute, write_tiny_gguf

# ---------------------------------------------------------------- tiny-random


def test_tiny_random_shapes_and_config():
    ckpt = tiny_random_checkpoint()
    cfg = ckpt.config
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == \
        (128, 2, 4, 2, 32, 256, 259)
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in ckpt.weights
    assert {name: tuple(t.shape) for name, t in ckpt.weights.items()} == expected_shapes(cfg)
    assert all(t.dtype == torch.float32 for t in ckpt.weights.values())
    assert isinstance(ckpt.tokenizer, ByteTokenizer)


def test_tiny_random_is_deterministic_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = tiny_random_checkpoint(), tiny_random_checkpoint()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a.weights[name], b.weights[name]) for name in a.weights)
    assert not torch.equal(a.weights["model.embed_tokens.weight"], tiny_random_checkpoint(seed=1).weights[
        "model.embed_tokens.weight"])


def test_tiny_random_init_distribution():
    weights = tiny_random_checkpoint().weights
    assert torch.equal(weights["model.norm.weight"], torch.ones(128))
    assert torch.equal(weights["model.layers.1.input_layernorm.weight"], torch.ones(128))
    embed = weights["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.001 and abs(embed.mean().item()) < 0.001


def test_load_checkpoint_by_name_and_resolved():
    by_name = load_checkpoint(resolve_model("tiny-random"))
    by_resolved = load_checkpoint(ResolvedModel("random", None, "tiny-random"))
    assert torch.equal(by_name.weights["model.layers.0.mlp.up_proj.weight"],
                       by_resolved.weights["model.layers.0.mlp.up_proj.weight"])


# ---------------------------------------------------------------- HF directories


def test_save_and_load_hf_dir_round_trip(tmp_path):
    ckpt = tiny_random_checkpoint()
    save_hf_dir(ckpt, tmp_path)
    loaded = load_checkpoint(ResolvedModel("hf_dir", tmp_path, str(tmp_path)))
    assert loaded.config == ckpt.config
    assert set(loaded.weights) == set(ckpt.weights)
    assert all(torch.equal(loaded.weights[n], ckpt.weights[n]) for n in ckpt.weights)
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.generation_config == ckpt.generation_config


def test_sharded_bf16_safetensors_are_read_in_their_dtype(tmp_path):
    from safetensors.torch import save_file

    ckpt = tiny_random_checkpoint()
    save_hf_dir(ckpt, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    names = sorted(ckpt.weights)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for file, shard_names in shards.items():
        save_file({n: ckpt.weights[n].to(torch.bfloat16) for n in shard_names}, str(tmp_path / file))
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_hf_dir(tmp_path)
    assert all(loaded.weights[name].dtype == torch.bfloat16 for name in names)  # the model converts
    for name in names:
        assert torch.equal(loaded.weights[name], ckpt.weights[name].to(torch.bfloat16))


def test_tied_lm_head_copy_is_ignored_and_untied_is_required(tmp_path):
    from engine.families import layout, read_model_args

    ckpt = tiny_random_checkpoint()
    ckpt.weights["lm_head.weight"] = ckpt.weights["model.embed_tokens.weight"].clone()
    save_hf_dir(ckpt, tmp_path)
    tied = load_hf_dir(tmp_path)
    assert "lm_head.weight" not in {piece.source for piece in layout(tied.args)}
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    untied = load_hf_dir(tmp_path)
    assert "lm_head.weight" in {piece.source for piece in layout(read_model_args(untied.config))}
    ckpt.weights.pop("lm_head.weight")
    ckpt.config["tie_word_embeddings"] = False
    with pytest.raises(ModelFileError, match="missing tensor.*lm_head.weight"):
        save_hf_dir(ckpt, tmp_path / "untied")
        load_hf_dir(tmp_path / "untied")


@pytest.mark.parametrize("missing", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_missing_config_key_names_file_and_key(tmp_path, missing):
    save_hf_dir(tiny_random_checkpoint(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config[missing]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=rf"config\.json: missing required key {missing}"):
        load_hf_dir(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda c: {**c, "model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
    (lambda c: {**c, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    (lambda c: {**c, "hidden_size": "128"}, "hidden_size must be a positive integer"),
    (lambda c: {**c, "intermediate_size": 512}, r"mlp.gate_proj.weight has shape \(256, 128\)"),
])
def test_bad_config_values(tmp_path, edit, message):
    save_hf_dir(tiny_random_checkpoint(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ModelFileError, match=message):
        load_hf_dir(tmp_path)


def test_bad_hf_dir_files(tmp_path):
    with pytest.raises(ModelFileError, match="no config.json"):
        load_hf_dir(tmp_path)
    save_hf_dir(tiny_random_checkpoint(), tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"config\.json: not valid JSON"):
        load_hf_dir(tmp_path)
    save_hf_dir(tiny_random_checkpoint(), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelFileError, match=r"model\.safetensors: cannot read safetensors"):
        load_hf_dir(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelFileError, match="no model.safetensors"):
        load_hf_dir(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    ckpt = tiny_random_checkpoint()
    del ckpt.weights["model.layers.1.self_attn.k_proj.weight"]
    save_hf_dir(ckpt, tmp_path)
    with pytest.raises(ModelFileError, match=r"missing tensor\(s\) model.layers.1.self_attn.k_proj.weight"):
        load_hf_dir(tmp_path)


def test_hf_dir_with_real_tokenizer_needs_tokenizer_json(tmp_path, tiny_gguf):
    path, _ = tiny_gguf
    save_hf_dir(load_gguf(path), tmp_path / "model")
    assert isinstance(load_hf_dir(tmp_path / "model").tokenizer, Tokenizer)
    (tmp_path / "model" / "tokenizer.json").unlink()
    with pytest.raises(ModelFileError, match="no tokenizer.json"):
        load_hf_dir(tmp_path / "model")


# ---------------------------------------------------------------- GGUF


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in [(9, 64, 576), (3, 64, 576), (4, 16, 8), (1, 2, 3)]:
        weight = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        permuted = llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight) or head_dim == 2 and heads == 1
        assert np.array_equal(unpermute_rope_rows(permuted, heads), weight)


def test_unpermute_pairs_rows_the_way_interleaved_rope_expects():
    # one head of 4 rows: llama.cpp stores HF rows (0, 2, 1, 3), i.e. pairs (x_i, x_{i+D/2}) interleaved
    weight = np.arange(4, dtype=np.float32).reshape(4, 1)
    assert llama_cpp_permute(weight, 1).ravel().tolist() == [0, 2, 1, 3]
    stored = np.array([[0], [2], [1], [3]], dtype=np.float32)
    assert unpermute_rope_rows(stored, 1).ravel().tolist() == [0, 1, 2, 3]


def test_gguf_every_supported_type_dequantized_and_unpermuted(tiny_gguf):
    path, expected = tiny_gguf
    ckpt = load_gguf(path)
    assert set(ckpt.weights) == set(expected)
    for name, array in expected.items():
        assert ckpt.weights[name].dtype == torch.float32
        assert torch.equal(ckpt.weights[name], torch.from_numpy(array)), name


def test_gguf_config_and_tokenizer(tiny_gguf):
    path, _ = tiny_gguf
    ckpt = load_gguf(path)
    for key, value in TINY_GGUF_CONFIG.items():
        assert ckpt.config[key] == value, key
    assert ckpt.config["vocab_size"] == 3 + 256 + 6
    assert ckpt.config["tie_word_embeddings"] is True
    assert ckpt.config["architectures"] == ["LlamaForCausalLM"] and ckpt.config["torch_dtype"] == "float32"
    tok = ckpt.tokenizer
    ids = tok.encode("hello world 42<|im_end|>")
    pieces = [tok.backend.id_to_token(i) for i in ids]
    assert pieces == ["hell", "o", "Ġwor", "l", "d", "Ġ", "4", "2", "<|im_end|>"]
    assert tok.decode(ids) == "hello world 42"
    assert tok.eos_token_ids == {2} and tok.bos_token_id == 1
    assert ckpt.generation_config == {"bos_token_id": 1, "eos_token_id": [2], "pad_token_id": 2}


def test_gguf_reads_through_load_checkpoint_and_converts_to_same_hf_dir(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    direct = load_checkpoint(ResolvedModel("gguf", path, str(path)))
    save_hf_dir(direct, tmp_path / "hf")
    via_dir = load_hf_dir(tmp_path / "hf")
    assert via_dir.config == direct.config
    assert all(torch.equal(via_dir.weights[n], direct.weights[n]) for n in direct.weights)
    text = "hello  world\n\n 12 <|im_start|>"
    assert via_dir.tokenizer.encode(text) == direct.tokenizer.encode(text)
    assert via_dir.tokenizer.eos_token_ids == direct.tokenizer.eos_token_ids
    assert via_dir.tokenizer.chat_template == direct.tokenizer.chat_template


def test_gguf_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    path = tmp_path / "q5.gguf"
    types = {"attn_q": "F16", "attn_k": "F16", "attn_v": "Q5_0", "attn_output": "F32",
             "ffn_gate": "F32", "ffn_up": "F32", "ffn_down": "F32"}
    write_tiny_gguf(path, layer_types=types)
    with pytest.raises(ModelFileError, match=r"q5\.gguf: tensor blk\.0\.attn_v\.weight has type Q5_0"):
        load_gguf(path)


def test_gguf_truncated_names_file(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 64):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match=rf"cut{cut}\.gguf: (corrupt or )?truncated"):
            load_gguf(bad)


def test_gguf_bad_magic_and_missing_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(ModelFileError, match=r"model\.gguf: not a GGUF file"):
        load_gguf(bad)
    with pytest.raises(ModelFileError, match="no such GGUF file"):
        load_gguf(tmp_path / "absent.gguf")


def test_gguf_other_architecture_and_pre_tokenizer_rejected(tmp_path):
    write_tiny_gguf(tmp_path / "phi2.gguf", arch="phi2")
    with pytest.raises(ModelFileError, match=r"phi2\.gguf: general.architecture is 'phi2'; supported GGUF "
                                             r"architectures: llama, qwen2, qwen3, qwen3moe"):
        load_gguf(tmp_path / "phi2.gguf")
    write_tiny_gguf(tmp_path / "pre.gguf", pre="deepseek-coder")
    with pytest.raises(ModelFileError, match=r"pre\.gguf: pre-tokenizer tokenizer.ggml.pre='deepseek-coder'"):
        load_gguf(tmp_path / "pre.gguf")


def test_gguf_gpt2_pre_tokenizer_keeps_digit_runs_together(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", pre="gpt-2")
    write_tiny_gguf(tmp_path / "smol.gguf", pre="smollm")
    gpt2, smol = load_gguf(tmp_path / "gpt2.gguf").tokenizer, load_gguf(tmp_path / "smol.gguf").tokenizer
    # "a  1": GPT-2 splits " " + " 1"; SmolLM isolates the digit first, leaving the run "  " whole
    assert gpt2.backend.pre_tokenizer.pre_tokenize_str("a  1")[1:] == [("Ġ", (1, 2)), ("Ġ1", (2, 4))]
    assert [p for p, _ in smol.backend.pre_tokenizer.pre_tokenize_str("a  1")] == ["a", "ĠĠ", "1"]


# ---------------------------------------------------------------- transformers reads what we write


def test_transformers_loads_saved_tiny_random_and_hf_greedy_matches_manual_argmax(tmp_path):
    from tests.engine.hf_reference import hf_greedy, hf_prompt_logprobs, load_hf_model

    ckpt = tiny_random_checkpoint()
    save_hf_dir(ckpt, tmp_path)
    model = load_hf_model(str(tmp_path))
    state = model.state_dict()
    for name, tensor in ckpt.weights.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(state["lm_head.weight"], ckpt.weights["model.embed_tokens.weight"])

    prompts = [[256, 72, 101, 108, 108, 111], [256, 7]]
    results = hf_greedy(tmp_path, prompts, max_new_tokens=6, top_logprobs=3)
    for prompt, (tokens, steps) in zip(prompts, results, strict=True):
        assert len(tokens) == len(steps) and 1 <= len(tokens) <= 6
        ids = list(prompt)
        for token, top in zip(tokens, steps, strict=True):
            logprobs = hf_prompt_logprobs(tmp_path, ids)[-1]
            assert token == int(logprobs.argmax())
            assert len(top) == 3 and max(top, key=top.get) == token
            assert abs(top[token] - logprobs[token].item()) < 1e-4
            ids.append(token)
    load_hf_model.cache_clear()


# ---------------------------------------------------------------- the real SmolLM2 (slow)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_gguf() -> Checkpoint:
    from engine.registry import KNOWN_MODELS, locate_gguf

    return load_gguf(locate_gguf(KNOWN_MODELS["smollm2-135m"]))


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_gguf_loader(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    from engine.registry import KNOWN_MODELS, locate_gguf

    path = locate_gguf(KNOWN_MODELS["smollm2-135m"])
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    state = reference.state_dict()
    assert set(state) - {"lm_head.weight"} == set(smollm2_gguf.weights)
    for name, tensor in smollm2_gguf.weights.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=1e-6, msg=name)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert smollm2_gguf.config[key] == getattr(reference.config, key), key
    assert smollm2_gguf.config["rope_theta"] == reference.config.rope_parameters["rope_theta"]


@pytest.mark.slow
def test_smollm2_shapes_and_converted_dir_equal_gguf(smollm2_gguf, smollm2_dir):
    cfg = smollm2_gguf.config
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "tie_word_embeddings")
    assert tuple(cfg[key] for key in keys) == (30, 576, 9, 3, 64, 49152, True)
    converted = load_hf_dir(smollm2_dir)
    assert converted.config == smollm2_gguf.config
    for name, tensor in smollm2_gguf.weights.items():
        assert torch.equal(converted.weights[name], tensor), name


def test_the_loader_does_not_import_the_registry():
    """One direction only: the registry converts pulled GGUF files with the loader; the loader reads
    what the registry resolved and imports nothing of it (the import loop that was here)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "engine"
    for name in ("loader.py", "model_files.py", "gguf_file.py", "safetensors_file.py"):
        tree = ast.parse((root / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for alias in node.names}
        assert "engine.registry" not in imported, name
