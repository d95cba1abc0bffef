"""Fixtures for the engine tests: the real SmolLM2 directory, and small synthetic GGUF files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.kernels.variants import cpu_variant  # noqa: F401 (a fixture)

SMOLLM2 = "smollm2-135m"

# The synthetic GGUF's shapes: rows are multiples of 32 so every block quantization applies
TINY_GGUF_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# tensor (HF name within a layer) -> GGML type written for it: one of every type the loader reads
LAYER_TYPES = {
    "attn_q": "F16",
    "attn_k": "BF16",
    "attn_v": "Q4_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q8_0",
    "ffn_up": "F32",
    "ffn_down": "Q4_1",
}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2 directory, pulled (once) into $BATCHGEN_CACHE_DIR."""
    from engine.registry import pull

    return pull(SMOLLM2)


def byte_level_vocab() -> list[str]:
    """Special tokens, the 256 byte-level characters, then one token per merge."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return SPECIAL_TOKENS + alphabet + [merge.replace(" ", "") for merge in MERGES]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written here from its description, as the test oracle)."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, seed: int = 0, layer_types: dict[str, str] | None = None,
                    arch: str = "llama", pre: str = "smollm") -> dict[str, np.ndarray]:
    """Write a 2-layer llama GGUF with a byte-level BPE vocabulary; return the HF-layout float32 weights.

    q/k rows are permuted as llama.cpp does. The returned weights are what the file holds after
    quantization (quantize then dequantize), so a correct loader reproduces them exactly.
    """
    import gguf
    from gguf.quants import dequantize, quantize

    cfg = TINY_GGUF_CONFIG
    layer_types = layer_types or LAYER_TYPES
    tokens = byte_level_vocab()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, cfg, tokens, pre)
    expected = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], type_name: str, heads: int | None = None):
        weight = (rng.standard_normal(shape) * 0.05).astype(np.float32) if len(shape) == 2 \
            else (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[type_name]
        stored = llama_cpp_permute(weight, heads) if heads else weight
        if type_name == "F32":
            writer.add_tensor(gguf_name, stored)
            expected[hf_name] = weight
        elif type_name == "F16":
            writer.add_tensor(gguf_name, stored.astype(np.float16))
            expected[hf_name] = weight.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)
            expected[hf_name] = dequantize(quantize(weight, qtype), qtype).reshape(shape)

    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), hidden), "Q8_0")
    for layer in range(cfg["num_hidden_layers"]):
        prefix, hf = f"blk.{layer}.", f"model.layers.{layer}."
        shapes = {
            "attn_q": ("self_attn.q_proj", (heads * head_dim, hidden), heads),
            "attn_k": ("self_attn.k_proj", (kv_heads * head_dim, hidden), kv_heads),
            "attn_v": ("self_attn.v_proj", (kv_heads * head_dim, hidden), None),
            "attn_output": ("self_attn.o_proj", (hidden, heads * head_dim), None),
            "ffn_gate": ("mlp.gate_proj", (inter, hidden), None),
            "ffn_up": ("mlp.up_proj", (inter, hidden), None),
            "ffn_down": ("mlp.down_proj", (hidden, inter), None),
        }
        for gguf_name, (hf_name, shape, rope_heads) in shapes.items():
            type_name = layer_types[gguf_name]
            add(f"{prefix}{gguf_name}.weight", f"{hf}{hf_name}.weight", shape, type_name, rope_heads)
        add(f"{prefix}attn_norm.weight", f"{hf}input_layernorm.weight", (hidden,), "F32")
        add(f"{prefix}ffn_norm.weight", f"{hf}post_attention_layernorm.weight", (hidden,), "F32")
    add("output_norm.weight", "model.norm.weight", (hidden,), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def write_shape_metadata(writer, cfg: dict, rope_theta: float, vocab_size: int) -> None:
    """The `{arch}.*` keys of a model's shape, from config.json keys."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(vocab_size)


def _write_metadata(writer, cfg: dict, tokens: list[str], pre: str) -> None:
    write_shape_metadata(writer, cfg, cfg["rope_theta"], len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


@pytest.fixture
def tiny_gguf(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    """A synthetic 2-layer llama GGUF (every supported tensor type) and its expected HF weights."""
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)
