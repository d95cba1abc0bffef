"""Model files -> a `Checkpoint`: a Hugging Face config dict, float32 weights under HF names, a tokenizer.

Three sources: a Hugging Face directory (config.json, *.safetensors, tokenizer.json), a GGUF
file read directly (dequantized at load; llama.cpp's q/k row permutation undone), and the tiny
random Llama that tests use. Whatever the source, the result looks like a `transformers`
LlamaForCausalLM checkpoint, so the model and the correctness reference load the same thing.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.tokenizer import BaseTokenizer, ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    from engine.registry import ResolvedModel

# config.json keys a Llama checkpoint cannot do without; the rest have LlamaConfig defaults
REQUIRED_CONFIG_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
)
CONFIG_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}
GGUF_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# A model marker in tokenizer_config.json: this directory's tokenizer is the ByteTokenizer
BYTE_TOKENIZER_CLASS = "batchgen.ByteTokenizer"


class ModelFileError(ValueError):
    """A model file or directory that cannot be loaded; the message names the file."""


@dataclass
class Checkpoint:
    config: dict  # Hugging Face LlamaConfig keys (config.json), defaults filled in
    weights: dict[str, torch.Tensor]  # HF tensor names -> float32 tensors; no lm_head when tied
    tokenizer: BaseTokenizer  # Tokenizer, or ByteTokenizer for the tiny random model
    generation_config: dict = field(default_factory=dict)  # generation_config.json: bos/eos/pad ids
    source: str = ""  # where it came from: a path or a registry name


def load_checkpoint(resolved: ResolvedModel | str) -> Checkpoint:
    """Load what `engine.registry.resolve_model` found (a name or path is resolved first)."""
    if isinstance(resolved, str):
        from engine.registry import resolve_model

        resolved = resolve_model(resolved)
    if resolved.kind == "hf_dir":
        return load_hf_dir(resolved.path)
    if resolved.kind == "gguf":
        return load_gguf(resolved.path)
    if resolved.kind == "random":
        return tiny_random_checkpoint()
    raise ValueError(f"unknown model kind {resolved.kind!r} for {resolved.name!r}")


# ---------------------------------------------------------------- Hugging Face directory

def load_hf_dir(directory: str | os.PathLike) -> Checkpoint:
    """Read config.json, model.safetensors (or a sharded index) and the tokenizer from `directory`."""
    directory = Path(directory)
    config = complete_config(_read_config(directory / "config.json"), directory / "config.json")
    weights = _read_safetensors(directory)
    check_weights(config, weights, str(directory))
    return Checkpoint(
        config=config,
        weights=weights,
        tokenizer=_read_tokenizer(directory),
        generation_config=_read_json_if_present(directory / "generation_config.json"),
        source=str(directory),
    )


def save_hf_dir(checkpoint: Checkpoint, directory: str | os.PathLike) -> None:
    """Write `checkpoint` as a directory that both `load_hf_dir` and `transformers` load."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(checkpoint.config, indent=2) + "\n")
    tensors = {name: t.contiguous() for name, t in checkpoint.weights.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    generation = json.dumps(checkpoint.generation_config, indent=2)
    (directory / "generation_config.json").write_text(generation + "\n")
    if isinstance(checkpoint.tokenizer, Tokenizer):
        checkpoint.tokenizer.save(directory)
    else:
        marker = {"tokenizer_class": BYTE_TOKENIZER_CLASS}
        (directory / "tokenizer_config.json").write_text(json.dumps(marker, indent=2) + "\n")


def complete_config(config: dict, path: Path | str) -> dict:
    """Check a Llama config.json dict and fill in LlamaConfig's defaults for the optional keys."""
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in config]
    if missing:
        raise ModelFileError(f"{path}: missing required key(s) {', '.join(missing)}")
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise ModelFileError(f"{path}: model_type {model_type!r} is not supported (only 'llama')")
    _check_positive_ints(config, REQUIRED_CONFIG_KEYS, path)
    out = dict(config)
    for key, value in CONFIG_DEFAULTS.items():
        out.setdefault(key, value)
    rope_parameters = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope_parameters:  # transformers >= 5 spelling
        out["rope_theta"] = rope_parameters["rope_theta"]
    out.setdefault("num_key_value_heads", out["num_attention_heads"])
    out.setdefault("head_dim", out["hidden_size"] // out["num_attention_heads"])
    _check_positive_ints(out, ("num_key_value_heads", "head_dim"), path)
    if out["num_attention_heads"] % out["num_key_value_heads"]:
        raise ModelFileError(f"{path}: num_attention_heads ({out['num_attention_heads']}) is not a multiple "
                             f"of num_key_value_heads ({out['num_key_value_heads']})")
    return out


def _check_positive_ints(config: dict, keys: tuple[str, ...], path: Path | str) -> None:
    for key in keys:
        value = config[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelFileError(f"{path}: {key} must be a positive integer, got {value!r}")


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint with this config holds, with its shape."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = {
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def check_weights(config: dict, weights: dict[str, torch.Tensor], source: str) -> None:
    """Every expected tensor present with its expected shape; a tied lm_head copy is dropped."""
    shapes = expected_shapes(config)
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    missing = [name for name in shapes if name not in weights]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(f"{source}: missing tensor(s) {', '.join(missing[:3])}{more}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ModelFileError(f"{source}: tensor {name} has shape {tuple(weights[name].shape)}, "
                                 f"config.json implies {shape}")
    for name in [name for name in weights if name.endswith(_IGNORED_SUFFIX)]:
        del weights[name]
    extra = sorted(set(weights) - set(shapes))
    if extra:
        raise ModelFileError(f"{source}: unexpected tensor(s) {', '.join(extra[:3])} for a Llama checkpoint")


# RoPE frequencies some older checkpoints store; they are recomputed from rope_theta
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"


def _read_config(path: Path) -> dict:
    if not path.is_file():
        raise ModelFileError(f"{path.parent}: no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return config


def _read_json_if_present(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from None


def _read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards a model.safetensors.index.json names, as float32 tensors."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_if_present(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFileError(f"{index}: no 'weight_map' object")
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelFileError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise ModelFileError(f"{path}: listed in {index.name} but missing")
        try:
            shard = load_file(str(path))
        except Exception as exc:
            raise ModelFileError(f"{path}: cannot read safetensors ({exc})") from None
        weights.update({key: value.to(torch.float32) for key, value in shard.items()})
    return weights


def _read_tokenizer(directory: Path) -> BaseTokenizer:
    config = _read_json_if_present(directory / "tokenizer_config.json")
    if config.get("tokenizer_class") == BYTE_TOKENIZER_CLASS:
        return ByteTokenizer()
    try:
        return Tokenizer.from_dir(directory)
    except (FileNotFoundError, ValueError) as exc:
        raise ModelFileError(str(exc)) from None


# ---------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def load_gguf(path: str | os.PathLike) -> Checkpoint:
    """Read a llama-architecture GGUF file: config, dequantized float32 weights, tokenizer.

    Tensor types F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are dequantized with `gguf.quants`.
    llama.cpp's converter reorders the rows of q_proj/k_proj for its interleaved RoPE; they are
    put back in Hugging Face order, so the result equals the checkpoint the file came from
    (up to quantization).
    """
    path = Path(path)
    reader = open_gguf(path)
    metadata = gguf_metadata(reader, path)
    config = gguf_config(metadata, reader, path)
    tokenizer = gguf_tokenizer(metadata, path, config)
    weights = gguf_weights(reader, config, path)
    check_weights(config, weights, str(path))
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": sorted(tokenizer.eos_token_ids),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    generation_config = {key: value for key, value in generation_config.items() if value is not None}
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer,
                      generation_config=generation_config, source=str(path))


def open_gguf(path: Path):
    """A `gguf.GGUFReader` over `path`, or a ModelFileError that names the file and what is wrong."""
    import gguf

    if not path.is_file():
        raise ModelFileError(f"{path}: no such GGUF file")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ModelFileError(f"{path}: corrupt or truncated GGUF ({_first_line(exc)})") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ModelFileError(f"{path}: truncated GGUF: tensor {tensor.name} ends at byte "
                                 f"{tensor.data_offset + tensor.n_bytes}, the file has {size}")
    return reader


def gguf_metadata(reader, path: Path) -> dict:
    """The key/value metadata of a GGUF file as plain Python values."""
    metadata = {}
    for key, value in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = value.contents()
        except Exception as exc:
            raise ModelFileError(f"{path}: metadata key {key} is unreadable ({_first_line(exc)})") from None
    return metadata


def gguf_config(metadata: dict, reader, path: Path) -> dict:
    """A Hugging Face LlamaForCausalLM config dict from the `llama.*` GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ModelFileError(f"{path}: general.architecture is {arch!r}; only 'llama' GGUF is supported")
    if metadata.get("llama.rope.scaling.type", "none") not in ("none",):
        raise ModelFileError(f"{path}: RoPE scaling {metadata['llama.rope.scaling.type']!r} is not supported")

    def need(key: str):
        if key not in metadata:
            raise ModelFileError(f"{path}: missing metadata key {key}")
        return int(metadata[key])

    hidden, heads = need("llama.embedding_length"), need("llama.attention.head_count")
    tensor_names = {tensor.name for tensor in reader.tensors}
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": need("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get("llama.attention.head_count_kv", heads)),
        "intermediate_size": need("llama.feed_forward_length"),
        "vocab_size": int(metadata.get("llama.vocab_size", len(tokens))),
        "head_dim": int(metadata.get("llama.attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(metadata.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(metadata.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": need("llama.context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
        "torch_dtype": "float32",
    }
    return complete_config(config, path)


def gguf_weights(reader, config: dict, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to float32, under its Hugging Face name and layout."""
    weights = {}
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name, path)
        array = _dequantize(tensor, path)
        if name.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, config["num_key_value_heads"])
        # copy=True: F32 tensors are views of the read-only file mapping
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32, copy=not array.flags.writeable))
    return weights


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (interleaved RoPE pairs) back to Hugging Face's (rotate-half).

    Within each head, llama.cpp interleaves the two halves of the rows: row 2i comes from HF row
    i and row 2i+1 from HF row i + head_dim/2. Reading them back as (pairs, 2) and transposing
    restores the halves.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])  # (H, D/2, 2, ...)
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _hf_tensor_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ModelFileError(f"{path}: tensor {gguf_name} has no place in a Llama checkpoint")
    return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}.weight"


def _dequantize(tensor, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    type_name = tensor.tensor_type.name
    if type_name not in GGUF_SUPPORTED_TYPES:
        raise ModelFileError(f"{path}: tensor {tensor.name} has type {type_name}; supported: "
                             f"{', '.join(GGUF_SUPPORTED_TYPES)}")
    shape = tuple(reversed([int(dim) for dim in tensor.shape]))  # GGUF lists dims innermost first
    try:
        return dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except Exception as exc:
        raise ModelFileError(f"{path}: tensor {tensor.name} ({type_name}) cannot be dequantized "
                             f"({_first_line(exc)})") from None


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


# ---------------------------------------------------------------- GGUF tokenizer

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) whose split we can rebuild exactly:
# these split every digit apart, then apply the GPT-2 regex (the SmolLM / StarCoder tokenizers)
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
# ... and these apply the GPT-2 regex alone
_GPT2 = ("gpt-2", "gpt2", "mpt", "olmo", "jais")


def gguf_tokenizer(metadata: dict, path: Path, config: dict) -> Tokenizer:
    """The `tokenizers` BPE tokenizer a GGUF file describes (vocabulary, merges, split rules, specials)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelFileError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' BPE)")
    tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelFileError(f"{path}: missing metadata key tokenizer.ggml.tokens")
    merges = [_split_merge(merge, path) for merge in metadata.get("tokenizer.ggml.merges") or []]
    backend = Backend(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
                                 fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre"), path, pre_tokenizers)
    backend.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == 3])  # 3 = CONTROL
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(types) if kind == 4])  # 4 = USER_DEFINED

    def token(key: str) -> str | None:
        token_id = metadata.get(key)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos = token("tokenizer.ggml.bos_token_id")
    backend.post_processor = _post_processor(bool(metadata.get("tokenizer.ggml.add_bos_token")), bos,
                                             metadata.get("tokenizer.ggml.bos_token_id"), processors)
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=token("tokenizer.ggml.eos_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        extra_eos_token_ids=[],
        model_max_length=config["max_position_embeddings"],
    )


def _gguf_pre_tokenizer(pre: str | None, path: Path, pre_tokenizers):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2:
        return byte_level
    raise ModelFileError(f"{path}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
                         f"(supported: {', '.join(_DIGITS_THEN_GPT2 + _GPT2)})")


def _post_processor(add_bos: bool, bos: str | None, bos_id: int | None, processors):
    if add_bos and bos is not None:
        return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                             special_tokens=[(bos, bos_id)])
    return processors.ByteLevel(trim_offsets=False)


def _split_merge(merge: str, path: Path) -> tuple[str, str]:
    parts = merge.split(" ")
    if len(parts) != 2:
        raise ModelFileError(f"{path}: tokenizer merge {merge!r} is not two tokens separated by a space")
    return parts[0], parts[1]


# ---------------------------------------------------------------- tiny random model

TINY_RANDOM_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 259,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "bos_token_id": ByteTokenizer.BOS,
    "eos_token_id": ByteTokenizer.EOS,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": None,
    "torch_dtype": "float32",
}


def random_weights(config: dict, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a Llama with this config: normal(0, 0.02), norms = 1, from a private generator
    seeded with `seed` (the global torch RNG is left alone), filled in `expected_shapes` order on
    `device`, so every call returns the same tensors. Benchmarks build GPU-sized models this way
    without downloading anything."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            values = torch.empty(shape, device=device).normal_(0.0, 0.02, generator=generator)
            weights[name] = values.to(dtype)
    return weights


def tiny_random_checkpoint(seed: int = 0) -> Checkpoint:
    """A 2-layer Llama with random_weights (normal(0, 0.02), norms = 1) and the ByteTokenizer."""
    config = dict(TINY_RANDOM_CONFIG)
    generation_config = {"bos_token_id": ByteTokenizer.BOS, "eos_token_id": [ByteTokenizer.EOS],
                         "pad_token_id": ByteTokenizer.PAD}
    return Checkpoint(config=config, weights=random_weights(config, seed), tokenizer=ByteTokenizer(),
                      generation_config=generation_config, source="tiny-random")
