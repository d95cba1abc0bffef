"""`Family`: what one file of engine/families says about a model family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.families.config import ConfigReader
from engine.families.layout import TensorNames
from engine.model_args import ModelArgs


@dataclass(frozen=True)
class Family:
    name: str  # as users know it: "Llama", "Qwen3-MoE"
    model_types: tuple[str, ...]  # config.json model_type values it reads (the first is its key)
    covers: str  # one line for `batchgen models list`: what of the family is implemented
    read: Callable[[ConfigReader], ModelArgs]  # config.json -> args; refuses what it does not implement
    names: TensorNames = field(default_factory=TensorNames)  # its checkpoint tensors' names
