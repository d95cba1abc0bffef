"""The only place sequences become tensors: it builds each step's flat batch, owns the paged KV
cache, runs the model and returns logits for the sequences that sample this step.

A step costs the host one sync. Its inputs (token ids, positions, KV slots, context lengths, query
offsets, block-table rows, sampled rows) are written into one pinned host buffer and uploaded with
one asynchronous copy; block tables live on the device, one persistent row per running sequence,
and change only where a sequence gained blocks (uploaded as a short list of updates). The sampled
tokens come back in the step's one device -> host copy (engine/staging.py).

Decode-only steps (every sequence one query token) run over static input buffers: on CUDA padded to
a batch-size bucket, each bucket a CUDA graph captured at start (one replay instead of ~11 kernel
launches per layer); elsewhere a plain call at the step's own size (`pad_decodes` pads there too,
which the tests use to check the padding against the eager path). `enforce_eager=True` runs every
step through the eager path, as mixed steps always are.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import operator
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.model import ModelArgs, Transformer
from engine.sampler import greedy_only
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.staging import Staging
from kernels import cpu_gemm, ops
from kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

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
    Process-wide. Returns whether it applied.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    mmap_ok = libc.mallopt(m_mmap_threshold, 1 << 30)
    return bool(mmap_ok) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))


def graphs_refused(device: torch.device, backend: str) -> str | None:
    """Why decode steps on `device` must not be CUDA graphs under kernel `backend`, or None.

    A graph replays its capture: device values are read again, host-side values stay what they were
    at capture (every context length 1, for the padding). The Triton kernels read lengths from
    device memory; the torch references plan their gathers from the host lengths, so a replay
    would attend to one key per sequence."""
    if device.type == "cuda" and backend != "triton":
        return (f"the {backend} kernels plan decode attention from host-side context lengths, which a CUDA "
                "graph would freeze at their capture values")
    return None


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to max_num_seqs (vLLM's)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


@dataclass
class _Layout:
    """Where each input of a step sits in the staged int64 buffer: per-sequence regions first, then
    per-token ones. It depends on (T, S, sampled) only, so a decode bucket's layout is fixed."""

    num_tokens: int
    num_seqs: int
    num_sampled: int

    @property
    def size(self) -> int:
        return 3 * self.num_tokens + 3 * self.num_seqs + 1 + self.num_sampled

    def slices(self) -> dict[str, slice]:
        t, s = self.num_tokens, self.num_seqs
        bounds = [("context_lens", s), ("query_start_loc", s + 1), ("rows", s),
                  ("sample", self.num_sampled), ("input_ids", t), ("positions", t), ("slots", t)]
        out, at = {}, 0
        for name, n in bounds:
            out[name] = slice(at, at + n)
            at += n
        return out

GRAPH_MEMORY_MARGIN = 1.1  # on top of the measured graph memory: allocator rounding, fragmentation


@dataclass
class DeviceMemory:
    """What the KV budget on a GPU is sized from (bytes; ModelRunner.profile_kv_budget measures it)."""

    total: int  # the device's memory
    held: int  # allocated by this process when profiling began: the weights, the caller's tensors
    activation_peak: int  # the profile step's peak above `held` (activations, sampler temporaries)
    graphs: int  # what the decode CUDA graphs will hold, measured before the KV cache is sized
    outside: int  # used outside this process's allocator: the CUDA context, other processes


def kv_budget(memory: DeviceMemory, utilization: float) -> tuple[int, str]:
    """Bytes the KV cache may take under gpu_memory_utilization, and a line saying how they were
    counted: utilization x total, less everything else that must fit beside the cache."""
    taken = memory.held + memory.activation_peak + memory.graphs + memory.outside
    gib = 1 << 30
    return int(memory.total * utilization) - taken, (
        f"gpu_memory_utilization {utilization:g} of {memory.total / gib:.1f} GiB, minus "
        f"{memory.held / gib:.2f} GiB held (weights), a {memory.activation_peak / gib:.2f} GiB activation "
        f"peak, {memory.graphs / gib:.2f} GiB for CUDA graphs and {memory.outside / gib:.2f} GiB outside "
        "torch")


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in with one call
# a private anonymous mapping (mmap.mmap(-1, n) alone is a shared one); Windows' mmap takes no flags
_PRIVATE = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
POPULATE_AHEAD_BLOCKS = 128  # KV blocks made resident past the highest block in use


class KVPopulator:
    """Makes the CPU KV cache's pages resident ahead of use, many at a time.

    The cache is one anonymous mapping whose pages the kernel hands out on first write. Taken one
    page-fault at a time that cost ~8 us a page on these VMs: a decode step of 64 sequences writes
    into ~360 new pages (3.8 ms of a 105 ms step went to store_kv_cache), and a prefill of 10k
    prompt tokens ~57k. MADV_POPULATE_WRITE makes a whole range resident in one call (~2 us a page).
    Fresh blocks are handed out in increasing id order (freed ones are reused first), so keeping
    everything below the highest block in use plus POPULATE_AHEAD_BLOCKS resident means writes
    find their pages present. RAM still follows use: at most the ahead margin is taken early.
    Where madvise refuses (an older kernel), it says so once in the log and pages fault in as before."""

    def __init__(self, flat: torch.Tensor, regions: int, num_blocks: int, ahead: int = POPULATE_AHEAD_BLOCKS):
        self.base, self.regions, self.num_blocks, self.ahead = flat.data_ptr(), regions, num_blocks, ahead
        self.block_bytes = flat[0][0].numel() * flat.element_size()
        self.populated = 0  # blocks [0, populated) of every region are resident
        self.page = mmap.PAGESIZE
        self.madvise = _libc_madvise()

    def ensure(self, highest_block: int) -> None:
        """Make blocks [0, highest_block + 1 + ahead) of every layer's K and V resident."""
        if self.madvise is None or highest_block < self.populated:
            return
        end = min(self.num_blocks, highest_block + 1 + self.ahead)
        for r in range(self.regions):
            region = self.base + r * self.num_blocks * self.block_bytes
            lo = (region + self.populated * self.block_bytes) // self.page * self.page
            hi = region + end * self.block_bytes
            if self.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                log.info("KV cache pages fault in one at a time: madvise(MADV_POPULATE_WRITE) failed "
                         "(%s)", os.strerror(err))
                self.madvise = None
                return
        self.populated = end


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


class ModelRunner:
    def __init__(self, model: Transformer, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, enforce_eager: bool = False) -> None:
        self.model = model
        self.args = model.args
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        w = model.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Triton launches on the current device
        else:
            keep_freed_memory_mapped()
            model.pack_weights()  # packed GEMMs: ~2x MKL's fp32 on AMD (kernels/cpu_gemm.py)
            log.info("CPU projections (%s): %s", self.dtype, cpu_gemm.packing_summary(model))
        model.init_rope(max_model_len)
        self.enforce_eager = enforce_eager
        refused = graphs_refused(self.device, ops.get_backend(w))
        if refused and not enforce_eager:
            log.warning("decode steps run eagerly, without CUDA graphs: %s", refused)
        self.buckets = ([] if enforce_eager or refused
                        else graph_buckets(min(max_num_seqs, max_num_batched_tokens)))
        # a bucket's padding buys a CUDA graph; elsewhere it is only rows computed for nothing (on CPU
        # up to 7 of every decode step's GEMM rows), so decode steps there run at their own size
        self.pad_decodes = self.device.type == "cuda"
        self.max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.staging = Staging(self.device)
        self.staging.buffer("step", 3 * self.max_tokens + 4 * max_num_seqs + 1, torch.int64)  # never grows
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # one row per running sequence; the last row stays all zeros for the padding of decode buckets
        self.block_tables = torch.zeros((max_num_seqs + 1, self.max_blocks_per_seq), dtype=torch.int32,
                                        device=self.device)
        self._pad_row = max_num_seqs
        self._arange = np.arange(max_num_seqs + 2, dtype=np.int64)
        self._arange_list = self._arange.tolist()
        self._row_of: dict[int, int] = {}  # seq_index -> its block-table row
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_populator: KVPopulator | None = None  # CPU: the KV pages made resident ahead of use
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_capture_s = 0.0
        self.graph_memory_estimate = 0  # bytes the graphs were expected to hold when the KV cache was sized
        self.graph_memory = 0  # bytes their capture took

    # -- KV cache and graphs (called once by the engine, in this order)
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """K and V caches (num_blocks, block_size, Hkv, D) per layer, zeroed. On the CPU they are views
        of one anonymous mapping: zero pages that take memory only once a block is written, so a
        generous KV budget costs RAM only as far as sequences really fill it."""
        shape = (num_blocks, self.block_size, self.args.n_kv_heads, self.args.head_dim)  # (N, B, Hkv, D)
        count = 2 * self.args.n_layers
        if self.device.type == "cpu":
            flat = _zero_pages(count * math.prod(shape), self.dtype).view(count, *shape)
            self.kv_populator = KVPopulator(flat, count, num_blocks)
        else:
            flat = torch.zeros((count, *shape), dtype=self.dtype, device=self.device)
        self.kv_caches = [(flat[2 * i], flat[2 * i + 1]) for i in range(self.args.n_layers)]

    @torch.inference_mode()
    def profile_kv_budget(self, utilization: float, sampler) -> tuple[int, str]:
        """CUDA: bytes left for the KV cache, and how they were counted (kv_budget).

        A profile step runs max_num_batched_tokens prompt tokens over up to max_num_seqs sequences
        (with a small scratch KV cache) and samples every sequence with top-p, so its peak holds the
        largest activations and sampler temporaries a real step makes; then the largest decode
        graph is captured over the same scratch cache, to measure what the graphs will hold before
        the KV cache takes the rest. Whatever this process holds on the device when profiling
        starts counts as taken: the model's weights, and any the caller still keeps alive."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        held = torch.cuda.memory_allocated(self.device)
        seqs = self._profile_sequences()
        self.allocate_kv_cache(sum(len(s.seq.block_table) for s in seqs))
        try:
            logits, sample_seqs = self.execute(SchedulerOutput(scheduled=seqs))
            sampler(logits, sample_seqs)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.graph_memory_estimate = self._graph_memory_estimate() if self.buckets else 0
        finally:
            for s in seqs:
                self.release(s.seq)
                sampler.release(s.seq)
            self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        memory = DeviceMemory(total=total, held=held, activation_peak=peak - held,
                              graphs=self.graph_memory_estimate,
                              outside=total - free - torch.cuda.memory_reserved(self.device))
        return kv_budget(memory, utilization)

    def _graph_memory_estimate(self) -> int:
        """Bytes the decode graphs will hold: the largest bucket's capture, measured (its private
        pool: the activations every smaller bucket reuses, and its logits), plus the (S, V) float32
        logits each smaller bucket's graph keeps, with GRAPH_MEMORY_MARGIN for the pool's rounding."""
        largest = max(self.buckets)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        graph = self._capture(largest, None)
        torch.cuda.synchronize(self.device)
        measured = torch.cuda.memory_reserved(self.device) - before
        del graph
        kept = sum(size * self.args.vocab_size * 4 for size in self.buckets if size != largest)
        return int((measured + kept) * GRAPH_MEMORY_MARGIN)

    def _profile_sequences(self) -> list[ScheduledSequence]:
        """Dummy prompts filling the token budget over up to max_num_seqs sequences, each with its
        own scratch blocks, scheduled whole (for the profile step)."""
        tokens = min(self.max_tokens, self.max_num_seqs * (self.max_model_len - 1))
        num_seqs = max(1, min(self.max_num_seqs, tokens))
        lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
        pieces, next_block = [], 0
        for i, n in enumerate(lens):
            seq = Sequence(f"profile-{i}", [0] * n, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9))
            blocks = -(-n // self.block_size)
            seq.block_table = list(range(next_block, next_block + blocks))
            next_block += blocks
            pieces.append(ScheduledSequence(seq, n, False))
        return pieces

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture one CUDA graph per decode bucket, largest first, sharing one memory pool."""
        if self.device.type != "cuda" or not self.buckets:
            return
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        pool = None
        for size in sorted(self.buckets, reverse=True):
            self.graphs[size] = self._capture(size, pool)
            pool = self.graphs[size][0].pool()
        torch.cuda.synchronize(self.device)
        self.graph_capture_s = time.perf_counter() - t0
        self.graph_memory = torch.cuda.memory_reserved(self.device) - before
        log.info("captured %d CUDA graphs (decode batch sizes %s..%s) in %.1f s: %.2f GiB (%.2f GiB "
                 "expected when the KV cache was sized)", len(self.graphs), min(self.graphs),
                 max(self.graphs), self.graph_capture_s, self.graph_memory / (1 << 30),
                 self.graph_memory_estimate / (1 << 30))

    def _capture(self, size: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One decode bucket's graph over its padding inputs (in `pool`, None for a new one) and the
        logits it writes."""
        self._stage_padding(size)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up: Triton compiles outside the capture
            for _ in range(2):
                self._decode_forward(size, [1] * size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._decode_forward(size, [1] * size)
        return graph, logits

    def _stage_padding(self, size: int) -> None:
        """Fill the staged inputs of a decode bucket with padding only (for warm-up and capture)."""
        layout = _Layout(size, size, size)
        buf = self.staging.buffer("step", layout.size, torch.int64)
        self._pad(buf, layout.slices(), 0, size)
        self.staging.upload("step", layout.size)

    # -- sequences leaving the running set
    def release(self, seq: Sequence) -> None:
        """Give back a finished or preempted sequence's block-table row."""
        row = self._row_of.pop(seq.seq_index, None)
        seq.table_row = seq.uploaded_blocks = -1
        if row is not None:
            self._free_rows.append(row)

    # -- one step
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, feed: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one iteration batch; return logits (S, V) for the sequences that catch up, and them.

        `feed`: the tokens (S',) of the step before, still on the device (asynchronous scheduling):
        a sequence whose latest token is a placeholder (`pending_row` set) takes it from there."""
        scheduled = sched.scheduled
        decodes_only = all(map(_IS_DECODE, scheduled))  # the common step: no sort, no sums
        ordered = scheduled if decodes_only else sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        self._update_block_tables([s.seq for s in ordered])  # stable sort above: q_len 1 first
        if self.buckets and len(ordered) <= self.buckets[-1] and (
                decodes_only or all(map(_samples_one_token, ordered))):
            return self._execute_decode(ordered, feed)
        return self._execute_eager(ordered, sum(s.num_new_tokens for s in ordered), feed)

    def _feed(self, input_ids: torch.Tensor, ordered, feed: torch.Tensor | None) -> None:
        """Input ids still being sampled by the step before (placeholders on the host) are copied in
        from its tokens on the device. Only decode rows (first in `ordered`, one token each) can
        have one: a placeholder is always its sequence's latest token."""
        rows = list(map(_PENDING_ROW, map(_SEQ, ordered)))
        if feed is None:
            if rows.count(None) != len(rows):
                raise RuntimeError("a placeholder token without the step that samples it")
            return
        n = len(rows)
        if n <= len(feed) and rows == self._arange_list[:n]:  # a decode run: the same rows as the step before
            input_ids[:n].copy_(feed[:n])
            return
        pairs = [(i, row) for i, row in enumerate(rows) if row is not None]
        if not pairs:
            return
        if ordered[pairs[-1][0]].num_new_tokens != 1:  # decode rows come first
            raise RuntimeError("a placeholder token outside a decode row")
        index = self.staging.put("feed", pairs, torch.int64).view(-1, 2)
        input_ids.index_copy_(0, index[:, 0], feed.index_select(0, index[:, 1]))

    def _execute_eager(self, ordered, num_tokens: int, feed: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, list[Sequence]]:
        sample_seqs = [s.seq for s in ordered if _catches_up(s)]
        layout = _Layout(num_tokens, len(ordered), len(sample_seqs))
        query_lens, context_lens = self._stage(ordered, layout)
        self._feed(self.staging.device_buffer("step")[layout.slices()["input_ids"]], ordered, feed)
        meta, inputs = self._inputs(layout, query_lens, context_lens)
        hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches, meta)  # (T, dim)
        if not sample_seqs:
            return hidden.new_empty((0, self.args.vocab_size)), []
        return self._head(hidden.index_select(0, inputs["sample"]), sample_seqs), sample_seqs

    def _execute_decode(self, ordered, feed: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, list[Sequence]]:
        """A decode-only step over the static inputs, padded to its bucket (pad_decodes) and replayed as
        a graph on CUDA, a plain call at its own size elsewhere."""
        num_seqs = len(ordered)
        size = next(b for b in self.buckets if b >= num_seqs) if self.pad_decodes else num_seqs
        layout = _Layout(size, size, size)
        slices = layout.slices()
        buf = self.staging.buffer("step", layout.size, torch.int64)
        _, context_lens = self._fill(buf, slices, ordered, sample_rows=False)
        self._pad(buf, slices, num_seqs, size)
        self.staging.upload("step", layout.size)
        self._feed(self.staging.device_buffer("step")[slices["input_ids"]], ordered, feed)
        seqs = [s.seq for s in ordered]
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
        else:
            logits = self._decode_forward(size, context_lens + [1] * (size - num_seqs),
                                          seqs if size == num_seqs else None)
        return logits[:num_seqs], seqs

    def _decode_forward(self, size: int, context_lens: list[int], seqs: list[Sequence] | None = None
                        ) -> torch.Tensor:
        """Model + logits over a decode bucket's static inputs (what a CUDA graph captures); with the
        bucket's sequences (unpadded), their picks where _head can make them."""
        layout = _Layout(size, size, size)
        meta, inputs = self._inputs(layout, [1] * size, context_lens)
        hidden = self.model(inputs["input_ids"], inputs["positions"], self.kv_caches, meta)
        return self.model.compute_logits(hidden) if seqs is None else self._head(hidden, seqs)

    def _head(self, hidden: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The sampled rows' logits (S, V) float32; or, where every one of `seqs` takes its argmax and
        nothing else (engine.sampler.greedy_only), their token ids (S,) int64 from the model's head directly
        (Transformer.greedy_tokens: the logits are never written), which the sampler passes through."""
        if greedy_only(seqs):
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                return tokens
        return self.model.compute_logits(hidden)

    # -- inputs
    def _stage(self, ordered, layout: _Layout) -> tuple[list[int], list[int]]:
        buf = self.staging.buffer("step", layout.size, torch.int64)
        query_lens, context_lens = self._fill(buf, layout.slices(), ordered, sample_rows=True)
        self.staging.upload("step", layout.size)
        return query_lens, context_lens

    def _fill(self, buf: np.ndarray, slices: dict[str, slice], ordered, sample_rows: bool
              ) -> tuple[list[int], list[int]]:
        """Write the step's token ids, positions, slots, lengths and rows into the host buffer.
        Decodes (first in `ordered`) go in as whole lists; prefill chunks one numpy slice each."""
        bs = self.block_size
        seqs = [s.seq for s in ordered]
        if not sample_rows and all(map(_IS_DECODE, ordered)):
            return self._fill_decodes(buf, slices, seqs)
        nd = next((i for i, s in enumerate(ordered) if s.num_new_tokens != 1), len(ordered))
        starts = [seq.num_computed_tokens for seq in seqs]
        query_lens = [s.num_new_tokens for s in ordered]
        context_lens = [a + n for a, n in zip(starts, query_lens, strict=True)]
        ids, pos, slots = buf[slices["input_ids"]], buf[slices["positions"]], buf[slices["slots"]]
        decodes = list(zip(seqs[:nd], starts, strict=False))
        ids[:nd] = [seq.token_ids[a] for seq, a in decodes]
        pos[:nd] = starts[:nd]
        slots[:nd] = [seq.block_table[a // bs] * bs + a % bs for seq, a in decodes]
        at = nd
        for seq, start, n in zip(seqs[nd:], starts[nd:], query_lens[nd:], strict=True):
            ids[at:at + n] = seq.token_ids[start:start + n]
            positions = np.arange(start, start + n)
            pos[at:at + n] = positions
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots[at:at + n] = table[positions // bs] * bs + positions % bs
            at += n
        buf[slices["context_lens"]][: len(ordered)] = context_lens
        qsl = buf[slices["query_start_loc"]]
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1: len(ordered) + 1])
        buf[slices["rows"]][: len(ordered)] = [seq.table_row for seq in seqs]
        if sample_rows:  # the last token of each piece that catches its sequence up
            ends = qsl[1: len(ordered) + 1].tolist()
            buf[slices["sample"]] = [e - 1 for e, seq, c in zip(ends, seqs, context_lens, strict=True)
                                     if c == seq.num_tokens]
        return query_lens, context_lens

    def _fill_decodes(self, buf: np.ndarray, slices: dict[str, slice], seqs: list[Sequence]
                      ) -> tuple[list[int], list[int]]:
        """_fill for a step of decodes only (each sequence's latest token, at position computed)."""
        bs, n = self.block_size, len(seqs)
        starts = [seq.num_computed_tokens for seq in seqs]
        buf[slices["input_ids"]][:n] = [seq.token_ids[-1] for seq in seqs]
        pos = buf[slices["positions"]][:n]
        pos[:] = starts
        slots = buf[slices["slots"]][:n]
        slots[:] = [seq.block_table[a // bs] for seq, a in zip(seqs, starts, strict=True)]
        slots *= bs
        slots += pos % bs
        ctx = buf[slices["context_lens"]][:n]
        np.add(pos, 1, out=ctx)
        buf[slices["query_start_loc"]][: n + 1] = self._arange[: n + 1]
        buf[slices["rows"]][:n] = [seq.table_row for seq in seqs]
        return [1] * n, ctx.tolist()

    def _pad(self, buf: np.ndarray, slices: dict[str, slice], start: int, size: int) -> None:
        """Padding sequences start..size-1 of a decode bucket: one token at position 0 that stores
        nothing (slot -1) and attends to one key of the all-zeros padding row; never sampled."""
        pad = slice(start, size)
        buf[slices["input_ids"]][pad] = 0
        buf[slices["positions"]][pad] = 0
        buf[slices["slots"]][pad] = -1
        buf[slices["context_lens"]][pad] = 1
        buf[slices["rows"]][pad] = self._pad_row
        buf[slices["query_start_loc"]][start + 1: size + 1] = np.arange(start + 1, size + 1)

    def _inputs(self, layout: _Layout, query_lens: list[int], context_lens: list[int]
                ) -> tuple[AttentionMetadata, dict[str, torch.Tensor]]:
        """Device views of the staged step and its attention metadata (all device-side work: when a
        graph captures this, replays recompute it from the static buffer)."""
        dev = self.staging.device_buffer("step")
        views = {name: dev[sl] for name, sl in layout.slices().items()}
        rows = views["rows"]
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        meta = AttentionMetadata(
            slot_mapping=views["slots"],
            query_start_loc=views["query_start_loc"].to(torch.int32),
            context_lens=views["context_lens"].to(torch.int32),
            block_tables=self.block_tables.index_select(0, rows),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
            query_lens_cpu=list(query_lens),
            context_lens_cpu=list(context_lens),
        )
        return meta, views

    def _update_block_tables(self, seqs: list[Sequence]) -> None:
        """Give new sequences a row, and upload the block ids each sequence gained since last time
        (a sequence's count of uploaded blocks says whether it did: one comparison each)."""
        changed = [seq for seq in seqs if len(seq.block_table) != seq.uploaded_blocks]
        if not changed:
            return
        rows, cols, blocks = [], [], []
        for seq in changed:
            if seq.uploaded_blocks < 0:
                seq.table_row = self._row_of[seq.seq_index] = self._free_rows.pop()
                seq.uploaded_blocks = 0
            done, table = seq.uploaded_blocks, seq.block_table
            rows += [seq.table_row] * (len(table) - done)
            cols += range(done, len(table))
            blocks += table[done:]
            seq.uploaded_blocks = len(table)
        if rows:
            if self.kv_populator is not None:
                self.kv_populator.ensure(max(blocks))
            update = self.staging.put("block_table_updates", [rows, cols, blocks], torch.int64).view(3, -1)
            self.block_tables[update[0], update[1]] = update[2].to(torch.int32)


_IS_DECODE = operator.attrgetter("is_decode")
_SEQ = operator.attrgetter("seq")
_PENDING_ROW = operator.attrgetter("pending_row")


def _catches_up(s) -> bool:
    """Whether a scheduled piece computes its sequence's last token (so the step samples for it)."""
    return s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens


def _samples_one_token(s) -> bool:
    """A decode-bucket row: one query token, which is the sequence's last."""
    return s.num_new_tokens == 1 and _catches_up(s)


def _zero_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on its own private anonymous mapping: the kernel hands out zero pages on
    first touch, so untouched parts cost no RAM. The tensor keeps the mapping alive. Private, not
    Python's default shared mapping (shmem): a child forked later copies it on write instead of
    sharing it, and making its pages resident took half the time (KVPopulator: 1.0-1.3 against
    2.2 s for a 128-request bench run's blocks on a 2-core Xeon VM). Huge pages (MADV_HUGEPAGE) were
    tried there: decode ~1% faster, but making them resident took 2.1-2.3 s."""
    nbytes = max(numel * torch.empty(0, dtype=dtype).element_size(), 1)
    buf = mmap.mmap(-1, nbytes, **_PRIVATE)
    return torch.frombuffer(buf, dtype=dtype, count=numel)
