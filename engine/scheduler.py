"""Iteration-level scheduler: decides, each step, which tokens of which sequences are computed.

Invariant of every iteration: scheduled tokens <= max_num_batched_tokens (the token budget) and
scheduled sequences <= max_num_seqs; a sequence is scheduled only if its KV blocks are allocated.
There are no prefill or decode phases: each sequence's num_computed_tokens catches up with its
num_tokens, one budget-sized piece at a time. No torch.
"""

from __future__ import annotations

import heapq
import operator
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this iteration (1 for a decode)
    is_decode: bool  # the one new token is its latest sampled token (not prompt or recompute work)


_NUM_NEW_TOKENS = operator.attrgetter("num_new_tokens")


@dataclass
class SchedulerOutput:
    """The iteration batch, as the model runner needs it and telemetry reports it."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # preempted (recompute) this step
    rejected: list[Sequence] = field(default_factory=list)  # finished with an error: can never fit
    prefix_cache_hit_tokens: int = 0  # prompt tokens taken from the prefix cache on admission

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(map(_NUM_NEW_TOKENS, self.scheduled))


class FcfsQueue:
    """Waiting sequences in arrival order; a preempted one goes back to the front."""

    def __init__(self) -> None:
        self._fifo: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._fifo)

    def __iter__(self):
        return iter(self._fifo)

    def add(self, seq: Sequence) -> None:
        self._fifo.append(seq)

    def add_front(self, seq: Sequence) -> None:
        """A preempted sequence resumes before anything that arrived after it."""
        self._fifo.appendleft(seq)

    def peek(self) -> Sequence:
        return self._fifo[0]

    def pop(self) -> Sequence:
        return self._fifo.popleft()

    def remove(self, seq: Sequence) -> None:
        self._fifo.remove(seq)

    def victim(self, running: list[Sequence]) -> Sequence:
        """Whom to preempt when blocks run out: the latest admitted."""
        return running[-1]


class PriorityQueue:
    """Waiting sequences by (priority, arrival, admission order), smallest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Sequence]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (s for _, s in sorted(self._heap))

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.priority_key, seq))

    add_front = add  # a preempted sequence simply takes its place by priority again

    def peek(self) -> Sequence:
        return self._heap[0][1]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def remove(self, seq: Sequence) -> None:
        self._heap = [(k, s) for k, s in self._heap if s is not seq]
        heapq.heapify(self._heap)

    def victim(self, running: list[Sequence]) -> Sequence:
        """Whom to preempt when blocks run out: the lowest priority (latest among equals)."""
        return max(running, key=lambda s: s.priority_key)


WAITING_QUEUES = {"fcfs": FcfsQueue, "priority": PriorityQueue}


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.token_budget = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.waiting = WAITING_QUEUES[config.scheduling_policy]()
        self.running: list[Sequence] = []  # admission order

    # -- requests in and out
    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Finish a sequence wherever it is (running, waiting) and release its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq, reason, error)

    def _release(self, seq: Sequence, reason: str, error: str | None) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error

    # -- the budget loop
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.token_budget)
        if not out.preempted:  # a step that preempted admits nothing new
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        pieces, budget = self._plan_running(out, budget)
        out.scheduled += pieces
        return budget

    def _plan_running(self, out: SchedulerOutput, budget: int) -> tuple[list[ScheduledSequence], int]:
        """The running sequences this step computes, in admission order, with their token counts
        within the budget, and the budget left; the KV blocks they need are allocated: victims are
        preempted (or a sequence alone that can never fit is rejected) before anything is.

        One pass over the running sequences with nothing but counters per sequence: a decoding
        sequence's piece is made once and reused, and only sequences that cross into a new block
        are handed to the block manager. A sequence whose latest token is its last allowed one
        (being sampled, under asynchronous scheduling) has nothing left to compute."""
        bm = self.block_manager
        bs = bm.block_size
        while True:
            pieces, grow, need, left = [], [], 0, budget
            for seq in self.running:
                if left <= 0:
                    break
                total = len(seq.token_ids)
                if total >= seq.max_num_tokens:
                    continue
                computed = seq.num_computed_tokens
                n = total - computed
                if n == 1 and total > seq.num_prompt_tokens:  # a decode
                    piece = seq.decode_piece
                    if piece is None:
                        piece = seq.decode_piece = ScheduledSequence(seq, 1, True)
                else:
                    n = min(n, left)
                    piece = ScheduledSequence(seq, n, _is_decode(seq, n))
                pieces.append(piece)
                short = computed + n - len(seq.block_table) * bs
                if short > 0:
                    need += -(-short // bs)
                    grow.append(piece)
                left -= n
            if need <= bm.num_free_blocks:
                for piece in grow:
                    bm.allocate(piece.seq, piece.num_new_tokens)
                return pieces, left
            if len(self.running) == 1:  # alone and still too big: the whole cache cannot hold it
                seq, n = pieces[0].seq, pieces[0].num_new_tokens
                self._reject(seq, out, "the KV cache cannot hold this sequence: "
                             f"{bm.blocks_needed(seq, n) + len(seq.block_table)} blocks needed, "
                             f"{bm.num_blocks} in the cache")
                return [], budget
            self._preempt(self.waiting.victim(self.running), out)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.stats.num_preemptions += 1
        self.waiting.add_front(seq)
        out.preempted.append(seq)

    def _reject(self, seq: Sequence, out: SchedulerOutput, why: str) -> None:
        """Finish a sequence that no amount of waiting would let fit (already out of its queue)."""
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq, "error", why)
        out.rejected.append(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            if -(-seq.num_tokens // bm.block_size) > bm.num_blocks:
                self.waiting.pop()
                self._reject(seq, out, f"prompt needs {-(-seq.num_tokens // bm.block_size)} KV blocks, "
                             f"the cache has {bm.num_blocks}")
                continue
            hit = bm.match_prefix(seq)
            seq.num_computed_tokens = hit
            n = min(seq.num_uncomputed_tokens, budget)
            # without chunked prefill a prompt waits until it fits one step whole, unless it never can: a
            # preempted sequence whose prompt and outputs outgrew the budget is recomputed in chunks
            waits_whole = not self.chunked_prefill and seq.num_uncomputed_tokens <= self.token_budget
            if (waits_whole and n < seq.num_uncomputed_tokens) or not bm.can_allocate(seq, n):
                bm.free(seq)  # give back matched prefix blocks; they stay cached
                seq.num_computed_tokens = 0
                break  # head of the queue waits: nothing behind it jumps ahead
            bm.allocate(seq, n)
            self.waiting.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n, _is_decode(seq, n)))
            out.prefix_cache_hit_tokens += hit
            budget -= n

    # -- after the forward pass
    def on_step_done(self, out: SchedulerOutput) -> list[Sequence]:
        """Advance computed counts; return sequences that caught up and so get a sampled token. A
        sequence finished meanwhile (asynchronous scheduling: a stop in the step before) is left."""
        sampled = []
        caching = self.block_manager.enable_prefix_caching
        finished = SequenceStatus.FINISHED
        for s in out.scheduled:
            seq = s.seq
            if seq.status is finished:
                continue
            seq.num_computed_tokens += s.num_new_tokens
            if caching:
                self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens == len(seq.token_ids):
                sampled.append(seq)
        return sampled


def _is_decode(seq: Sequence, n: int) -> bool:
    return n == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens + 1 == seq.num_tokens
