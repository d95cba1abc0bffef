"""Per-request sampling and stopping parameters (vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16  # new tokens at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 or -1 = no top-k cut
    seed: int | None = None  # same seed -> same text whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings, trimmed from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # top-N logprobs per output token
    priority: int = 0  # lower value runs first under scheduling_policy="priority"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive count, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
