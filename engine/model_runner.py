"""The only place sequences become tensors: it builds each step's flat batch, owns the paged KV
cache, runs the model and returns logits for the sequences that sample this step."""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from engine.model import ModelArgs, Transformer
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from kernels.metadata import build_attention_metadata

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_block_bytes(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V, all layers, for one block."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * args.n_layers * block_size * args.n_kv_heads * args.head_dim * elem


def keep_freed_memory_mapped() -> bool:
    """Stop glibc from handing large freed blocks back to the OS (and page-faulting them in again).

    Every step allocates activations of the same few sizes (MBs each); by default glibc mmaps and
    unmaps each one, so every op on fresh memory first takes thousands of page faults. Raising the
    mmap and trim thresholds keeps those blocks in the heap for reuse, as tcmalloc/jemalloc would.
    Process-wide; off with BATCHGEN_MALLOPT=0. Returns whether it applied.
    """
    if os.environ.get("BATCHGEN_MALLOPT", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    mmap_ok = libc.mallopt(m_mmap_threshold, 1 << 30)
    return bool(mmap_ok) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.model = model
        self.args = model.args
        self.block_size = block_size
        w = model.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        if self.device.type == "cpu":
            keep_freed_memory_mapped()
            model.pack_weights()  # oneDNN's packed fp32 GEMMs: ~2x MKL's on AMD (kernels/cpu_gemm.py)
        shape = (num_blocks, block_size, self.args.n_kv_heads, self.args.head_dim)  # (N, B, Hkv, D)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.args.n_layers)
        ]
        model.init_rope(max_model_len)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one iteration batch; return logits (S, V) for the sequences that catch up, and them."""
        input_ids, positions, meta, sample_rows, sample_seqs = self.prepare(sched)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # (T, dim)
        if not sample_seqs:
            return hidden.new_empty((0, self.args.vocab_size)), []
        logits = self.model.compute_logits(hidden[sample_rows])  # (S_sample, V)
        return logits, sample_seqs

    def prepare(self, sched: SchedulerOutput):
        """Flatten the scheduled pieces, decodes first: token ids, positions, attention metadata and
        the rows whose hidden state is a sequence's last computed token (those sample)."""
        ordered = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)  # stable: q_len 1 first
        ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables = [], [], []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for s in ordered:
            seq, n = s.seq, s.num_new_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            tables.append(seq.block_table)
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        meta = build_attention_metadata(query_lens, context_lens, tables, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return input_ids, pos, meta, sample_rows, sample_seqs
