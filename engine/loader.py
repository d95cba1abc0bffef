"""Model files -> a `Checkpoint`: a Hugging Face config dict, the weights under HF names, a tokenizer.

Three sources: a Hugging Face directory (config.json, *.safetensors, tokenizer.json), a GGUF file
(engine/gguf_file.py: dequantized on reading, llama.cpp's q/k row order undone, stacked experts
split), and the tiny random Llama that tests use. Whatever the source, the result looks like a
`transformers` checkpoint of its family, so the model and the correctness reference load the same
thing. Weights are read when the model asks for them, one tensor at a time, in the dtype they are
stored in: safetensors through memory maps whose pages are dropped once a tensor is copied, so
loading holds about one tensor in host memory beyond the model itself (on a GPU: beyond nothing).
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine import gguf_file
from engine.families import ModelFileError, check_weights, layout, read_model_args
from engine.gguf_file import unpermute_rope_rows
from engine.model_args import ModelArgs
from engine.model_files import (
    BYTE_TOKENIZER_CLASS,
    ModelLocation,
    read_config_file,
    read_json_if_present,
    read_tokenizer,
)
from engine.safetensors_file import TensorEntry, read_index
from engine.tokenizer import BaseTokenizer, ByteTokenizer, Tokenizer

__all__ = ["BYTE_TOKENIZER_CLASS", "Checkpoint", "ModelFileError", "expected_shapes", "load_checkpoint",
           "load_gguf", "load_hf_dir", "random_weights", "save_hf_dir", "tiny_random_checkpoint",
           "unpermute_rope_rows"]

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class Checkpoint:
    config: dict  # config.json as written (a GGUF's: built from its metadata)
    weights: Mapping[str, torch.Tensor]  # HF tensor names -> tensors in their stored dtype, read on access
    tokenizer: BaseTokenizer  # Tokenizer, or ByteTokenizer for the tiny random model
    generation_config: dict = field(default_factory=dict)  # generation_config.json: bos/eos/pad ids
    source: str = ""  # where it came from: a path or a registry name
    args: ModelArgs | None = None  # the config as its family read it (None: not read yet)


def load_checkpoint(resolved: ModelLocation) -> Checkpoint:
    """Load what `engine.registry.resolve_model` found."""
    if resolved.kind == "hf_dir":
        return load_hf_dir(resolved.path)
    if resolved.kind == "gguf":
        return load_gguf(resolved.path)
    if resolved.kind == "random":
        return tiny_random_checkpoint()
    raise ValueError(f"unknown model kind {resolved.kind!r}")


# ---------------------------------------------------------------- Hugging Face directory

def load_hf_dir(directory: str | os.PathLike) -> Checkpoint:
    """config.json read by its family, the safetensors files' tensors (checked against it, read on
    access), and the tokenizer of `directory`."""
    directory = Path(directory)
    config = read_config_file(directory / "config.json")
    args = read_model_args(config, str(directory / "config.json"))
    weights = SafetensorsWeights(read_index(directory))
    check_weights(args, weights.shapes, str(directory))
    return Checkpoint(
        config=config, weights=weights, tokenizer=read_tokenizer(directory),
        generation_config=read_json_if_present(directory / "generation_config.json"),
        source=str(directory), args=args,
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


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint with this config holds (its family's names), with its shape."""
    return {piece.source: piece.shape for piece in layout(read_model_args(config))}


class SafetensorsWeights(Mapping):
    """A directory's safetensors tensors by name, each read on access as a view of its file's memory
    map (in the stored dtype; nothing is copied until the model copies it into place). Reading a
    tensor drops the pages of the one read before from this process's memory (MADV_DONTNEED: they
    are read again from the file if that tensor is touched again), so resident memory holds about
    one tensor of the files at a time, however large the model."""

    def __init__(self, entries: dict[str, TensorEntry]) -> None:
        self.entries = entries
        self.shapes = {name: entry.shape for name, entry in entries.items()}
        self._maps: dict[Path, mmap.mmap] = {}
        self._last: TensorEntry | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if entry.dtype not in _TORCH_DTYPES:
            raise ModelFileError(f"{entry.file}: tensor {name} is {entry.dtype}; supported: "
                                 f"{', '.join(_TORCH_DTYPES)}")
        self._release_last()
        dtype = _TORCH_DTYPES[entry.dtype]
        count = (entry.end - entry.start) // dtype.itemsize
        flat = torch.frombuffer(self._map(entry.file), dtype=dtype, count=count, offset=entry.start)
        self._last = entry
        return flat.view(entry.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def _map(self, path: Path) -> mmap.mmap:
        """The file mapped copy-on-write (a writable buffer: torch.frombuffer warns on read-only ones;
        nothing writes to it)."""
        if path not in self._maps:
            with open(path, "rb") as handle:
                self._maps[path] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[path]

    def _release_last(self) -> None:
        last, self._last = self._last, None
        if last is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = last.start // mmap.PAGESIZE * mmap.PAGESIZE
        self._maps[last.file].madvise(mmap.MADV_DONTNEED, start, last.end - start)


# ---------------------------------------------------------------- GGUF

def load_gguf(path: str | os.PathLike) -> Checkpoint:
    """A GGUF file of a supported architecture (engine/gguf_file.ARCHS): config from its metadata,
    its tensors under Hugging Face names (dequantized on access), its tokenizer.

    Tensor types F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are dequantized with `gguf.quants`;
    llama.cpp's converter reorders the rows of q_proj/k_proj of llama-architecture files for its
    interleaved RoPE, and they are put back in Hugging Face order, so the result equals the
    checkpoint the file came from (up to quantization).
    """
    path = Path(path)
    file = gguf_file.read_gguf(path)
    tokenizer = gguf_file.gguf_tokenizer(file.metadata, path, file.config)
    generation_config = {
        "bos_token_id": file.config["bos_token_id"],
        "eos_token_id": sorted(tokenizer.eos_token_ids),
        "pad_token_id": file.metadata.get("tokenizer.ggml.padding_token_id"),
    }
    generation_config = {key: value for key, value in generation_config.items() if value is not None}
    return Checkpoint(config=file.config, weights=GGUFWeights(file.sources, path), tokenizer=tokenizer,
                      generation_config=generation_config, source=str(path), args=file.args)


class GGUFWeights(Mapping):
    """A GGUF file's tensors under Hugging Face names, dequantized to float32 on access (F16 and BF16
    widened). The last stacked-experts tensor dequantized is kept, so reading its experts one by one
    dequantizes it once."""

    def __init__(self, sources: dict[str, gguf_file.TensorSource], path: Path) -> None:
        self.sources, self.path = sources, path
        self.shapes = {name: source.shape for name, source in sources.items()}
        self._stacked: tuple[str, np.ndarray] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self.sources[name]
        if source.expert is None:
            array = gguf_file.read_tensor(source, self.path)
        else:
            if self._stacked is None or self._stacked[0] != source.tensor.name:
                self._stacked = (source.tensor.name, gguf_file.read_tensor(
                    gguf_file.TensorSource(source.tensor, source.shape), self.path))
            array = self._stacked[1][source.expert]
        # copy: F32 tensors are views of the read-only file mapping
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=not array.flags.writeable))

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


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
