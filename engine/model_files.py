"""Reading and checking a model's files without their weights' data (no torch).

`check_model_files` is what a job's submission runs on the model it names: the config read by its
family (refusing what batchgen does not implement), every tensor the config implies present with
its shape (from the safetensors headers or the GGUF's tensor table), no shard missing or truncated,
and the tokenizer loadable. A bad checkpoint is refused there, naming the file, before any worker
starts on it. engine/loader.py reads the same files, then the data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from engine.families import ModelFileError, layout, read_model_args
from engine.model_args import ModelArgs
from engine.safetensors_file import WEIGHT_DTYPES, read_index
from engine.tokenizer import BaseTokenizer, ByteTokenizer, Tokenizer

# A model marker in tokenizer_config.json: this directory's tokenizer is the ByteTokenizer
BYTE_TOKENIZER_CLASS = "batchgen.ByteTokenizer"
# RoPE frequencies some older checkpoints store; they are recomputed from the config
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


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
        from engine import gguf_file

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


def check_weights(args: ModelArgs, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Every tensor the args imply present with its shape, and nothing else (a tied lm_head's copy and
    stored rotary frequencies aside): the config and the tensors agree."""
    expected = {piece.source: piece.shape for piece in layout(args)}
    missing = [name for name in expected if name not in shapes]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(f"{source}: missing tensor(s) {', '.join(missing[:3])}{more}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ModelFileError(f"{source}: tensor {name} has shape {tuple(shapes[name])}, "
                                 f"config.json implies {shape}")
    ignored = {"lm_head.weight"} if args.tie_word_embeddings else set()
    extra = sorted(name for name in shapes if name not in expected and name not in ignored
                   and not name.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ModelFileError(f"{source}: unexpected tensor(s) {', '.join(extra[:3])} for a {args.family} "
                             "checkpoint with this config.json")
