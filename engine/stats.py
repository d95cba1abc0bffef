"""Per-iteration and per-request telemetry.

The field names of `IterationStats` and `RequestStats` are the column names of the `iterations`
and `requests` DuckDB views: keep them in step. Both are zero-default
dataclasses so a consumer can build an empty row and fill what it knows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class IterationStats:
    """What one engine step scheduled and what the engine looked like after it."""

    worker_id: str = ""  # set by the worker runtime; the engine leaves it empty
    iteration: int = 0  # step counter of this engine, from 0
    ts: float = 0.0  # wall-clock (epoch seconds) when the step started
    duration_s: float = 0.0  # schedule + forward + sample + bookkeeping
    num_running: int = 0  # running sequences after scheduling (admitted, holding KV)
    num_waiting: int = 0  # queue depth inside the engine after scheduling
    num_scheduled_seqs: int = 0  # sequences in this iteration batch
    num_prefill_seqs: int = 0  # ... of which compute prompt tokens (a chunk or the whole prompt)
    num_decode_seqs: int = 0  # ... of which decode one new token
    prefill_tokens: int = 0  # prompt tokens computed this step
    decode_tokens: int = 0  # decode tokens computed this step
    scheduled_tokens: int = 0  # prefill_tokens + decode_tokens
    token_budget: int = 0  # max_num_batched_tokens in force
    max_num_seqs: int = 0  # the sequence cap in force
    kv_blocks_used: int = 0  # KV blocks held after the step
    kv_blocks_total: int = 0  # KV blocks in the cache
    num_preempted: int = 0  # running sequences preempted (recompute) this step
    num_finished: int = 0  # sequences that finished this step
    prefix_cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache this step
    job_ids: list[str] = field(default_factory=list)  # tags of the requests this step served
    num_constrained_seqs: int = 0  # scheduled sequences with structured output (a grammar)
    mask_fill_s: float = 0.0  # time filling the grammar token masks of this step (structured output)

    def as_row(self) -> dict:
        return asdict(self)


@dataclass
class RequestStats:
    """Timing of one request through the engine (epoch seconds; 0.0 = did not happen)."""

    arrival_ts: float = 0.0  # add_request time
    scheduled_ts: float = 0.0  # first time it was in an iteration batch
    first_token_ts: float = 0.0  # first output token sampled
    finished_ts: float = 0.0  # finished (any reason)
    num_preemptions: int = 0  # times it was preempted and recomputed
    prompt_tokens: int = 0
    output_tokens: int = 0
    # the limit on new tokens in force: its max_tokens, clamped to the room max_model_len leaves after
    # the prompt (as vLLM does); 0 for a request that could not run
    max_tokens: int = 0

    @property
    def queue_s(self) -> float:
        return max(self.scheduled_ts - self.arrival_ts, 0.0) if self.scheduled_ts else 0.0

    @property
    def ttft_s(self) -> float:
        return max(self.first_token_ts - self.arrival_ts, 0.0) if self.first_token_ts else 0.0

    @property
    def e2e_s(self) -> float:
        return max(self.finished_ts - self.arrival_ts, 0.0) if self.finished_ts else 0.0

    @property
    def tpot_s(self) -> float:
        """Mean inter-token latency after the first token."""
        if self.output_tokens < 2 or not self.first_token_ts:
            return 0.0
        return max(self.finished_ts - self.first_token_ts, 0.0) / (self.output_tokens - 1)

    def as_row(self) -> dict:
        row = {f.name: getattr(self, f.name) for f in fields(self)}
        row.update(queue_s=self.queue_s, ttft_s=self.ttft_s, e2e_s=self.e2e_s, tpot_s=self.tpot_s)
        return row
