"""Per-request sampling and stopping parameters (vLLM names and semantics)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from engine.structured_output import Constraint, constraint_from


@dataclass
class SamplingParams:
    max_tokens: int = 16  # new tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 or -1 = no top-k cut
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top token's, [0, 1]
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output so far
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt or output (CTRL / HF rule)
    seed: int | None = None  # same seed -> same text whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings, trimmed from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # top-N logprobs per output token
    priority: int = 0  # lower value runs first under scheduling_policy="priority"
    # structured output, at most one of: OpenAI's {"type": "json_object"} or {"type": "json_schema",
    # "json_schema": {"schema": {...}}} ({"type": "text"} = none), a regex, a list of strings
    response_format: dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # derived from the three above: the grammar the output must match (None = unconstrained)
    constraint: Constraint | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_float("temperature", self.temperature, 0.0, math.inf, hi_open=True)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=-1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True,
                     hi_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(1 << 63), hi=(1 << 64) - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=1024)
        _check_int("priority", self.priority, lo=-(1 << 63), hi=(1 << 63) - 1)
        self.constraint = constraint_from(self.response_format, self.guided_regex, self.guided_choice)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= lo \
        and (hi is None or value <= hi)
    if not ok:
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {span}, got {value!r}")


def _check_float(name: str, value, lo: float, hi: float, *, lo_open: bool = False,
                 hi_open: bool = False) -> None:
    """A finite number in the range (NaN fails every comparison, so it is refused here too)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        span = ("(" if lo_open else "[") + f"{lo:g}, {hi:g}" + (")" if hi_open else "]")
        raise ValueError(f"{name} must be a finite number in {span}, got {value!r}")
