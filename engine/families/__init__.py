"""The model families batchgen serves, chosen by config.json's `model_type`.

A family is one file in this package: a `Family` that reads its config.json into `ModelArgs` (the
decoder of engine/model.py with the family's named differences switched on), refusing every value
it does not implement, and names its checkpoint tensors (`TensorNames`). Adding a family is that
file and its line in FAMILIES. No torch here: `batchgen models list` and the checks at job
submission read configs without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from engine.families import gemma3, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe
from engine.families.base import Family
from engine.families.config import ConfigReader, ModelFileError
from engine.families.layout import Piece, checkpoint_layout
from engine.model_args import ModelArgs

__all__ = ["FAMILIES", "Family", "ModelFileError", "Piece", "ReadConfig", "check_weights", "family_of",
           "layout", "read_config", "read_model_args"]

log = logging.getLogger(__name__)


# the registry: one line per family
FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY,
                                mixtral.FAMILY, gemma3.FAMILY, phi3.FAMILY)
_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


@dataclass
class ReadConfig:
    """What a config.json says, as read by its family."""

    family: Family
    args: ModelArgs
    unknown_keys: list[str]  # keys no family reads and none known not to change the arithmetic


def family_of(config: dict, source: str) -> Family:
    model_type = config.get("model_type", "llama")
    if model_type not in _BY_MODEL_TYPE:
        raise ModelFileError(f"{source}: model_type {model_type!r} is not supported (supported: "
                             f"{', '.join(sorted(_BY_MODEL_TYPE))})")
    return _BY_MODEL_TYPE[model_type]


def read_config(config: dict, source: str) -> ReadConfig:
    """The family and ModelArgs of a config.json dict; a ModelFileError naming `source` and the key for
    anything that changes the arithmetic and is not implemented."""
    if not isinstance(config, dict):
        raise ModelFileError(f"{source}: expected a JSON object")
    family = family_of(config, source)
    reader = ConfigReader(config, source)
    try:
        args = family.read(reader)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelFileError):
            raise
        raise ModelFileError(f"{source}: {exc}") from None
    args.family = family.model_types[0]
    return ReadConfig(family, args, reader.unread())


def read_model_args(config: dict, source: str = "config.json") -> ModelArgs:
    """read_config's args; keys batchgen does not know are logged (once per load) as a warning."""
    read = read_config(config, source)
    if read.unknown_keys:
        log.warning("%s: keys batchgen does not know, taken not to change the arithmetic: %s", source,
                    ", ".join(read.unknown_keys))
    return read.args


def layout(args: ModelArgs) -> list[Piece]:
    """The checkpoint tensors of a model with these args (engine.families.layout)."""
    return checkpoint_layout(args, _BY_MODEL_TYPE[args.family].names)


# RoPE frequencies some older checkpoints store; they are recomputed from the config
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


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
