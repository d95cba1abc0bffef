"""What the engine hands back for a finished (or streaming) request."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.stats import RequestStats


@dataclass
class RequestOutput:
    request_id: str  # the caller's id (or the engine's counter as a string)
    prompt: str | None  # prompt text when given as text
    prompt_token_ids: list[int]
    text: str  # detokenized output, stop string trimmed
    token_ids: list[int]  # output token ids
    finished: bool = False
    finish_reason: str | None = None  # stop | length | error | cancelled
    error: str | None = None  # why, when finish_reason == "error"
    # per output token: {token_id: logprob} over the top-N (plus the chosen token)
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestStats = field(default_factory=RequestStats)
    job_id: str | None = None  # tag given at add_request
