"""A request's state inside the engine: tokens, progress, KV blocks, timing. No torch."""

from __future__ import annotations

import enum
import itertools

from engine.sampling_params import SamplingParams
from engine.stats import RequestStats


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued in the engine (new, or preempted and to be recomputed)
    RUNNING = "running"  # admitted: holds KV blocks, scheduled every iteration it fits the budget
    FINISHED = "finished"


_counter = itertools.count()
PLACEHOLDER = -1  # a token still being sampled on the device (asynchronous scheduling)


class Sequence:
    """One request. `num_computed_tokens` catches up with `num_tokens`; when it does, a token is sampled."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_ts: float = 0.0,
        prompt: str | None = None,
        job_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.seq_index = next(_counter)  # global admission tie-breaker: older requests have smaller indices
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.job_id = job_id
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        # asynchronous scheduling: the latest token is a placeholder (PLACEHOLDER) while the step that
        # samples it runs; this is its row in that step's tokens (engine.model_runner feeds it)
        self.pending_row: int | None = None
        self.max_num_tokens = 1 << 62  # prompt + the output tokens it may have (the engine sets it)
        self.stop_token_ids: frozenset[int] = frozenset()  # tokens that end it (EOS unless ignored, its own)
        self.decode_piece = None  # the scheduler's ScheduledSequence for its decode steps, made once
        self.table_row = -1  # its block-table row on the device (the model runner's), -1: none
        self.uploaded_blocks = -1  # blocks of its table the runner has uploaded, -1: none
        # what its parameters ask of each step, worked out once
        self.greedy_only = (params.greedy and params.logprobs is None and not params.has_penalties
                            and params.constraint is None)  # its token is the argmax, nothing more
        self.needs_host_tokens = params.has_penalties or params.constraint is not None  # see the engine
        self.plain = params.constraint is None and not params.stop  # stops are checked on token ids only
        self.block_table: list[int] = []  # physical KV block per logical block
        self.block_hashes: list[int] = []  # prefix-cache hashes of the full blocks known so far
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stop_text: str | None = None  # output text cut before a matched stop string
        self.logprobs: list[dict[int, float]] | None = None  # per output token, when asked for
        self.stats = RequestStats(arrival_ts=arrival_ts, prompt_tokens=self.num_prompt_tokens)

    # -- sizes
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def priority_key(self) -> tuple[int, float, int]:
        """Smaller runs first: priority value, then arrival, then admission order."""
        return (self.params.priority, self.stats.arrival_ts, self.seq_index)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
