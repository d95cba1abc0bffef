"""The per-step attention metadata that the model runner builds once and every layer shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where this step's query tokens sit in the paged KV cache.

    Sequences are ordered decodes first: the first `num_decodes` sequences contribute exactly one
    query token each, the rest are prefill chunks. A chunk of `q_len` new tokens holds positions
    `context_len - q_len .. context_len - 1` and attends causally to everything before it.
    """

    slot_mapping: torch.Tensor  # (T,) int64, block_id*block_size+offset per new token; -1 = do not store
    query_start_loc: torch.Tensor  # (S+1,) int32, prefix sums of query tokens per sequence (cu_seqlens_q)
    context_lens: torch.Tensor  # (S,) int32, tokens in the KV cache per sequence after this step's store
    block_tables: torch.Tensor  # (S, max_blocks_per_seq) int32, padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one query token each
    num_decode_tokens: int  # == num_decodes
    max_query_len: int  # longest query (chunk) length in this step
    max_context_len: int  # longest context length in this step
    query_lens_cpu: list[int]  # host copy of the query lengths: the CPU path never reads tensors
    context_lens_cpu: list[int]  # host copy of context_lens
    # the torch path's decode plan (grouping, gather indices, masks): built by the first layer that
    # needs it and reused by every other layer of the step, since they share this metadata
    torch_decode_plan: list | None = field(default=None, repr=False, compare=False)
    window_plans: dict = field(default_factory=dict, repr=False, compare=False)  # the same per sliding window
    _prefill_qsl: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _prefill_rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        """Sequences in this step (decodes and prefill chunks)."""
        return len(self.query_lens_cpu)

    @property
    def prefill_query_start_loc(self) -> torch.Tensor:
        """(S - num_decodes + 1,) int32: query_start_loc of the prefill chunks alone, from 0."""
        if self._prefill_qsl is None:
            nd = self.num_decodes
            self._prefill_qsl = self.query_start_loc[nd:] - nd  # decodes hold one row each
        return self._prefill_qsl

    def prefill_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill chunks' query tokens as sequences of one query each, what a decode kernel
        takes: (T_prefill, W) int32 block tables (each token's sequence's row) and (T_prefill,)
        int32 context lengths (each token sees the keys up to its own position). Built once per
        step, on the first call, and shared by every layer."""
        if self._prefill_rows is None:
            nd = self.num_decodes
            seqs, lens = [], []
            for s, (q_len, ctx_len) in enumerate(zip(self.query_lens_cpu[nd:], self.context_lens_cpu[nd:],
                                                     strict=True)):
                seqs += [nd + s] * q_len
                lens += range(ctx_len - q_len + 1, ctx_len + 1)
            device = self.block_tables.device
            rows = torch.tensor(seqs, dtype=torch.int64, device=device)
            self._prefill_rows = (self.block_tables.index_select(0, rows),
                                  torch.tensor(lens, dtype=torch.int32, device=device))
        return self._prefill_rows


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    num_decodes: int | None = None,
) -> AttentionMetadata:
    """AttentionMetadata for sequences given as host lists (decodes first).

    query_lens[s] new tokens of sequence s sit at positions context_lens[s] - query_lens[s] ..
    context_lens[s] - 1; block_tables[s] lists its KV blocks in order. num_decodes defaults to
    the number of leading sequences with one query token.
    """
    _check_lengths(query_lens, context_lens, block_tables, block_size)
    if num_decodes is None:
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    slots = [
        table[pos // block_size] * block_size + pos % block_size
        for q_len, ctx_len, table in zip(query_lens, context_lens, block_tables, strict=True)
        for pos in range(ctx_len - q_len, ctx_len)
    ]
    width = max((len(t) for t in block_tables), default=0) or 1
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(len(padded), width),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
        query_lens_cpu=list(query_lens),
        context_lens_cpu=list(context_lens),
    )


def _check_lengths(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> None:
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError(
            f"query_lens ({len(query_lens)}), context_lens ({len(context_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    for s, (q_len, ctx_len, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
        if not 1 <= q_len <= ctx_len:
            raise ValueError(f"sequence {s}: need 1 <= query_len <= context_len, got {q_len} and {ctx_len}")
        if len(table) * block_size < ctx_len:
            raise ValueError(
                f"sequence {s}: {len(table)} blocks of {block_size} cannot hold context_len {ctx_len}"
            )
