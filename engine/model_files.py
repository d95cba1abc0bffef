"""Reading and checking a model's files without their weights' data (no torch).

`check_model_files` is what a job's submission runs on the model it names: the config read by its
family (refusing what batchgen does not implement), every tensor the config implies present with
its shape (from the safetensors headers or the GGUF's tensor table), no shard missing or truncated,
and the tokenizer loadable. A bad checkpoint is refused there, naming the file, before any worker
starts on it. engine/loader.py reads the same files, then the data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from engine.families import ModelFileError, check_weights, layout, read_model_args
from engine.safetensors_file import WEIGHT_DTYPES, read_index
from engine.tokenizer import BaseTokenizer, ByteTokenizer, Tokenizer

# A model marker in tokenizer_config.json: this directory's tokenizer is the ByteTokenizer
BYTE_TOKENIZER_CLASS = "batchgen.ByteTokenizer"


class ModelLocation(Protocol):
    """What engine.registry.resolve_model answers (a ResolvedModel)."""

    kind: str  # "hf_dir" | "gguf" | "random"
    path: Path | None


def check_model_files(resolved: ModelLocation) -> None:
    """Refuse (ModelFileError naming the file) a model whose files the engine could not load."""
    if resolved.kind == "hf_dir":
        directory = Path(resolved.path)
        args = read_model_args(read_config_file(directory / "config.json"), str(directory / "config.json"))
        entries = read_index(directory)
        check_weights(args, {name: e.shape for name, e in entries.items()}, str(directory))
        for piece in layout(args):
            entry = entries[piece.source]
            if entry.dtype not in WEIGHT_DTYPES:
                raise ModelFileError(f"{entry.file}: tensor {piece.source} is {entry.dtype}; supported: "
                                     f"{', '.join(WEIGHT_DTYPES)}")
        read_tokenizer(directory)
        read_json_if_present(directory / "generation_config.json")
    elif resolved.kind == "gguf":
        from engine import gguf_file  # the gguf package is imported only for a GGUF file

        gguf_file.check(Path(resolved.path))


def read_config_file(path: Path) -> dict:
    if not path.is_file():
        raise ModelFileError(f"{path.parent}: no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return config


def read_json_if_present(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from None


def read_tokenizer(directory: Path) -> BaseTokenizer:
    config = read_json_if_present(directory / "tokenizer_config.json")
    if config.get("tokenizer_class") == BYTE_TOKENIZER_CLASS:
        return ByteTokenizer()
    try:
        return Tokenizer.from_dir(directory)
    except (FileNotFoundError, ValueError) as exc:
        raise ModelFileError(str(exc)) from None

