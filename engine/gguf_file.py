"""A GGUF file (llama.cpp's format) as a Hugging Face checkpoint: its config, tensor names and tokenizer.

llama.cpp writes each family under its own `general.architecture` with `{arch}.*` metadata keys and
its own tensor names (`blk.N.attn_q`, `blk.N.ffn_gate_exps`, ...). `ARCHS` says which architectures
are read and as which config.json model_type; `gguf_config` turns the metadata into that config, and
`tensor_sources` names every tensor as the family's checkpoints do (an MoE layer's stacked experts
become one tensor per expert, llama.cpp's reordered q/k rows are put back). engine/loader.py reads
the data through these; `check` is the submission's check of a GGUF file. No torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.families import ModelFileError, check_weights, family_of, read_model_args
from engine.families.layout import TensorNames
from engine.model_args import ModelArgs
from engine.tokenizer import Tokenizer

GGUF_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


@dataclass(frozen=True)
class Arch:
    """How llama.cpp writes one family."""

    model_type: str  # the config.json model_type it reads as (llama with experts: mixtral)
    permuted_qk: bool  # q/k rows reordered for llama.cpp's interleaved rotary (undone on reading)


ARCHS = {
    "llama": Arch("llama", permuted_qk=True),  # Llama, Mistral (+ sliding window), Mixtral (+ experts)
    "qwen2": Arch("qwen2", permuted_qk=False),
    "qwen3": Arch("qwen3", permuted_qk=False),
    "qwen3moe": Arch("qwen3_moe", permuted_qk=False),
}
# GGUF files read as a model_type other than their architecture's, and what in them says so
_READ_AS = {"mixtral": ("llama", "with experts"), "mistral": ("llama", "with a sliding window")}


def gguf_archs_of(model_type: str) -> list[str]:
    """The GGUF architectures (general.architecture) read as `model_type`, for `batchgen models list`."""
    archs = [arch for arch, spec in ARCHS.items() if spec.model_type == model_type]
    if model_type in _READ_AS:
        arch, how = _READ_AS[model_type]
        archs.append(f"{arch} {how}")
    return archs


# config.json's architectures entry of each model_type a GGUF file reads as
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# GGUF tensor name within blk.N -> the TensorNames field (and part index) it is
_LAYER_TENSORS = {
    "attn_q": ("qkv", 0), "attn_k": ("qkv", 1), "attn_v": ("qkv", 2), "attn_output": ("o", None),
    "ffn_gate": ("gate_up", 0), "ffn_up": ("gate_up", 1), "ffn_down": ("down", None),
    "attn_norm": ("input_norm", None), "ffn_norm": ("pre_mlp_norm", None),
    "attn_q_norm": ("q_norm", None), "attn_k_norm": ("k_norm", None), "ffn_gate_inp": ("router", None),
}
_EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": None}  # expert_gate_up index
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class TensorSource:
    """Where a Hugging Face tensor is in the file."""

    tensor: object  # the gguf ReaderTensor
    shape: tuple[int, ...]  # its shape as the checkpoint's tensor (an expert's slice for stacked experts)
    expert: int | None = None  # the index into the stacked experts
    rope_heads: int | None = None  # undo llama.cpp's q/k row order over this many heads


@dataclass
class GGUFFile:
    """A GGUF file read and checked up to its tensors' data."""

    reader: object  # gguf.GGUFReader
    metadata: dict  # its key/value metadata
    config: dict  # the config.json it amounts to
    args: ModelArgs  # that config as its family read it
    sources: dict[str, TensorSource]  # Hugging Face tensor name -> where it is in the file


def read_gguf(path: Path) -> GGUFFile:
    """Everything of a GGUF file but its tensors' data, checked: header, architecture, config, tensor
    names, shapes and types (ModelFileError naming the file for the first thing wrong)."""
    reader = open_gguf(path)
    metadata = gguf_metadata(reader, path)
    config = gguf_config(metadata, reader, path)
    args = read_model_args(config, str(path))
    sources = tensor_sources(reader, metadata["general.architecture"], config, path)
    check_weights(args, {name: source.shape for name, source in sources.items()}, str(path))
    for source in sources.values():
        _check_type(source.tensor, path)
    return GGUFFile(reader, metadata, config, args, sources)


def check(path: Path) -> None:
    """Refuse (ModelFileError naming the file) a GGUF file the engine could not load, without
    dequantizing it: read_gguf's checks and its tokenizer."""
    file = read_gguf(path)
    gguf_tokenizer(file.metadata, path, file.config)


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
    """The Hugging Face config.json dict the `{arch}.*` metadata describes."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHS:
        raise ModelFileError(f"{path}: general.architecture is {arch!r}; supported GGUF architectures: "
                             f"{', '.join(ARCHS)}")
    names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelFileError(f"{path}: tensor rope_freqs.weight (Llama 3.1-style rope scaling as stored "
                             "frequency factors) is not supported in GGUF; load the Hugging Face directory")

    def need(key: str) -> int:
        if f"{arch}.{key}" not in metadata:
            raise ModelFileError(f"{path}: missing metadata key {arch}.{key}")
        return int(metadata[f"{arch}.{key}"])

    def get(key: str, default=None):
        return metadata.get(f"{arch}.{key}", default)

    hidden, heads = need("embedding_length"), need("attention.head_count")
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    config = {
        "architectures": [], "model_type": ARCHS[arch].model_type,
        "hidden_size": hidden, "num_hidden_layers": need("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "intermediate_size": need("feed_forward_length"), "vocab_size": int(get("vocab_size", len(tokens))),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)), "max_position_embeddings": need("context_length"),
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu",
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"), "rope_scaling": None,
        "torch_dtype": "float32",
    }
    config.update(_rope_scaling(arch, metadata, path))
    config.update(_experts(arch, metadata, names, config["num_hidden_layers"]))
    if get("attention.sliding_window"):
        if arch != "llama":
            raise ModelFileError(f"{path}: {arch}.attention.sliding_window is not supported for {arch}")
        config.update(model_type="mistral", sliding_window=int(get("attention.sliding_window")))
    if config["model_type"] == "llama":  # the keys converted SmolLM2 directories have
        config.update(attention_bias=False, mlp_bias=False)
    config["architectures"] = [_CLASSES[config["model_type"]]]
    return config


def _rope_scaling(arch: str, metadata: dict, path: Path) -> dict:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind == "none":
        return {}
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": _f32(factor)}}
    if kind == "yarn":
        tuned = sorted(key for key in metadata if key.startswith(f"{arch}.rope.scaling.yarn_")
                       or key == f"{arch}.rope.scaling.attn_factor")
        if tuned:
            raise ModelFileError(f"{path}: {', '.join(tuned)} not supported (yarn with its default betas and "
                                 "attention factor)")
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        return {"rope_scaling": {"rope_type": "yarn", "factor": _f32(factor),
                                 "original_max_position_embeddings": int(original)}}
    raise ModelFileError(f"{path}: {arch}.rope.scaling.type {kind!r} is not supported (none, linear, yarn)")


def _experts(arch: str, metadata: dict, names: set[str], n_layers: int) -> dict:
    """The MoE keys: llama with experts is Mixtral; Qwen3-MoE's layers without stacked experts are
    dense (mlp_only_layers). llama.cpp renormalises the top-k weights of both."""
    count = int(metadata.get(f"{arch}.expert_count", 0))
    if not count:
        return {}
    used = int(metadata.get(f"{arch}.expert_used_count", 0))
    if arch == "llama":
        return {"model_type": "mixtral", "num_local_experts": count, "num_experts_per_tok": used}
    dense = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_exps.weight" not in names]
    return {"num_experts": count, "num_experts_per_tok": used, "mlp_only_layers": dense,
            "moe_intermediate_size": int(metadata.get(f"{arch}.expert_feed_forward_length", 0)),
            "norm_topk_prob": bool(metadata.get(f"{arch}.expert_weights_norm", True))}


def tensor_sources(reader, arch: str, config: dict, path: Path) -> dict[str, TensorSource]:
    """Every tensor of the file under its Hugging Face name (the family's TensorNames)."""
    names, family = family_of(config, str(path)).names, config["model_type"]
    permuted = ARCHS[arch].permuted_qk
    heads = {0: config["num_attention_heads"], 1: config["num_key_value_heads"]}
    sources: dict[str, TensorSource] = {}
    for tensor in reader.tensors:
        shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF lists dims innermost first
        if tensor.name in _GLOBAL_TENSORS:
            sources[_GLOBAL_TENSORS[tensor.name]] = TensorSource(tensor, shape)
            continue
        match = _LAYER_RE.fullmatch(tensor.name)
        if match is None:
            raise ModelFileError(f"{path}: tensor {tensor.name} has no place in a {family} checkpoint")
        layer, role, kind = match.groups()
        prefix = f"model.layers.{layer}."
        if role in _EXPERT_TENSORS and kind == "weight":
            for e in range(shape[0]):
                sources[prefix + _expert_name(names, role, e)] = TensorSource(tensor, shape[1:], expert=e)
            continue
        if role not in _LAYER_TENSORS:
            raise ModelFileError(f"{path}: tensor {tensor.name} has no place in a {family} checkpoint")
        field, part = _LAYER_TENSORS[role]
        name = getattr(names, field)
        permute = permuted and field == "qkv" and part in heads and kind == "weight"
        rope_heads = heads[part] if permute else None
        sources[f"{prefix}{name[part] if part is not None else name}.{kind}"] = TensorSource(tensor, shape,
                                                                                             rope_heads=rope_heads)
    return sources


def _expert_name(names: TensorNames, role: str, expert: int) -> str:
    part = _EXPERT_TENSORS[role]
    leaf = names.expert_down if part is None else names.expert_gate_up[part]
    return f"{names.expert.format(e=expert)}.{leaf}.weight"


def read_tensor(source: TensorSource, path: Path) -> np.ndarray:
    """One Hugging Face tensor's values: dequantized (float32; F16/BF16/F32 as stored, widened to
    float32), an expert's slice of stacked experts, q/k rows in Hugging Face order."""
    array = _dequantize(source.tensor, path)
    if source.expert is not None:
        array = array[source.expert]
    if source.rope_heads is not None:
        array = unpermute_rope_rows(array, source.rope_heads)
    return array


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


def _check_type(tensor, path: Path) -> None:
    type_name = tensor.tensor_type.name
    if type_name not in GGUF_SUPPORTED_TYPES:
        raise ModelFileError(f"{path}: tensor {tensor.name} has type {type_name}; supported: "
                             f"{', '.join(GGUF_SUPPORTED_TYPES)}")


def _dequantize(tensor, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    _check_type(tensor, path)
    shape = tuple(reversed([int(dim) for dim in tensor.shape]))  # GGUF lists dims innermost first
    try:
        return dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except Exception as exc:
        raise ModelFileError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) cannot be "
                             f"dequantized ({_first_line(exc)})") from None


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
# ... and these their own split expression, then the byte-level mapping (no regex of its own): Llama 3's
# keeps runs of up to three digits, Qwen2's (Qwen2, Qwen2.5, Qwen3) splits every digit apart
_CONTRACTIONS_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_PUNCTUATION_SPACES = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLITS = {
    "llama-bpe": _CONTRACTIONS_LETTERS + r"\p{N}{1,3}" + _PUNCTUATION_SPACES,
    "llama3": _CONTRACTIONS_LETTERS + r"\p{N}{1,3}" + _PUNCTUATION_SPACES,
    "qwen2": _CONTRACTIONS_LETTERS + r"\p{N}" + _PUNCTUATION_SPACES,
}


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
    from tokenizers import Regex

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2:
        return byte_level
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ModelFileError(f"{path}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
                         f"(supported: {', '.join(_DIGITS_THEN_GPT2 + _GPT2 + tuple(_SPLITS))})")


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
