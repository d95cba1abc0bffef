"""The model runner's step inputs: decode steps over the static buffers, padded to buckets (the
CUDA-graph path) or at their own size (CPU's default), give the eager path's tokens; device block
tables follow the sequences' tables through growth, preemption and prefix caching. (That a step reads
the device once, forward included, is checked on a pretend device: tests/engine/test_gpu_path.py.)"""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_runner import graph_buckets
from tests.engine.tiny import tiny_hf_checkpoint


@pytest.fixture(scope="module")
def ckpt():
    return tiny_hf_checkpoint(seed=1)


def _prompts(n, seed=0, lo=1, hi=60, vocab=97):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _params(n):
    """Greedy rows and seeded sampled rows (with top-k/top-p/min-p/penalties) mixed."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(SamplingParams(max_tokens=10 + i % 7, temperature=0.0))
        elif i % 3 == 1:
            out.append(SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=i))
        else:
            out.append(SamplingParams(max_tokens=9, temperature=1.1, min_p=0.05, presence_penalty=0.5,
                                      repetition_penalty=1.2, seed=100 + i, logprobs=2))
    return out


CONFIGS = {
    "roomy": dict(max_num_seqs=16, max_num_batched_tokens=256, block_size=16, num_kv_blocks=128),
    "preempting": dict(max_num_seqs=8, max_num_batched_tokens=40, block_size=4, num_kv_blocks=28),
    "prefix-cache": dict(max_num_seqs=6, max_num_batched_tokens=64, block_size=4, num_kv_blocks=80,
                         enable_prefix_caching=True),
    "odd-cap": dict(max_num_seqs=11, max_num_batched_tokens=7, block_size=8, num_kv_blocks=128),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_decode_buckets_give_the_eager_tokens(ckpt, name):
    prompts = _prompts(14, seed=3)
    if name == "prefix-cache":
        prompts = [prompts[0][:30] + p[:12] for p in prompts]
    params = _params(len(prompts))
    results = {}
    for mode in ("eager", "padded", "own size"):
        llm = LLM("tiny", checkpoint=ckpt, enforce_eager=mode == "eager", **CONFIGS[name])
        runner = llm.engine.runner
        if mode != "eager":
            assert runner.buckets == graph_buckets(min(CONFIGS[name]["max_num_seqs"],
                                                       CONFIGS[name]["max_num_batched_tokens"]))
            assert runner.pad_decodes is False  # CPU: decode steps run at their own size
            runner.pad_decodes = mode == "padded"
        rows = _decode_rows(runner)
        outs = llm.generate(prompts, params)
        results[mode] = [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]
        if mode != "eager":  # (sequences, rows the forward ran) of each decode step
            assert rows and all(r == (next(b for b in runner.buckets if b >= n) if mode == "padded" else n)
                                for n, r in rows)
        if name == "preempting":
            assert sum(s.num_preempted for s in llm.iteration_stats) > 0
    assert results["padded"] == results["eager"]
    assert results["own size"] == results["eager"]


def _decode_rows(runner) -> list[tuple[int, int]]:
    """(sequences, rows of the forward) of each of the runner's decode-path steps, as they run."""
    rows = []
    execute, forward = runner._execute_decode, runner._decode_forward

    def step(ordered, feed=None):
        rows.append((len(ordered), None))
        return execute(ordered, feed)

    def recorded(size, context_lens, seqs=None):
        assert len(context_lens) == size and (seqs is None or len(seqs) == size)
        rows[-1] = (rows[-1][0], size)
        return forward(size, context_lens, seqs)

    runner._execute_decode, runner._decode_forward = step, recorded
    return rows


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert graph_buckets(256)[-3:] == [240, 248, 256] and len(graph_buckets(256)) == 35
    assert graph_buckets(30) == [1, 2, 4, 8, 16, 24, 30]


def test_device_block_tables_follow_the_sequences(ckpt):
    """After every step, each running sequence's device row holds exactly its block table."""
    llm = LLM("tiny", checkpoint=ckpt, enable_prefix_caching=True, **CONFIGS["preempting"])
    engine = llm.engine
    base = _prompts(1, seed=9, lo=20, hi=20)[0]
    for i, p in enumerate(_prompts(10, seed=4)):
        engine.add_request(str(i), base + p[:20], SamplingParams(max_tokens=15, temperature=0.0))
    runner, checked = engine.runner, 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            row = runner._row_of.get(seq.seq_index)
            if row is None:  # admitted but not yet scheduled
                continue
            table = runner.block_tables[row, : len(seq.block_table)].tolist()
            assert table == seq.block_table
            checked += 1
        assert len(runner._row_of) <= len(engine.scheduler.running)
    assert checked > 50
    assert sum(s.num_preempted for s in llm.iteration_stats) > 0
    assert not runner._row_of and len(runner._free_rows) == engine.config.max_num_seqs


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_kv_cache_on_cpu_costs_ram_only_where_written(ckpt):
    before = _rss_bytes()
    llm = LLM("tiny", checkpoint=ckpt, kv_cache_memory_gb=1.0, max_num_seqs=8192)
    grown = _rss_bytes() - before
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 KV heads, head dim 16, fp32
    assert llm.engine.block_manager.num_blocks == (1 << 30) // per_block  # the budget, under the need
    assert grown < 200 << 20  # 1 GiB of KV would be 1 GiB of RSS if it were touched
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(out.token_ids) == 3


def _resident_pages(addr: int, nbytes: int) -> list[bool]:
    """mincore(2) over [addr, addr + nbytes), addr page-aligned: which pages are in RAM."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def _kv_mapping(regions=4, blocks=64, block_elems=3 * 1024):  # 12 KiB fp32 blocks: 3 pages each
    from engine.model_runner import _zero_pages

    return _zero_pages(regions * blocks * block_elems, torch.float32).view(regions, blocks, block_elems)


def test_kv_populator_makes_blocks_resident_ahead_of_use_in_every_layer():
    from engine.model_runner import KVPopulator

    flat = _kv_mapping()
    pop = KVPopulator(flat, regions=4, num_blocks=64, ahead=2)
    if pop.madvise is None:
        pytest.skip("no madvise on this platform")
    block = 12 * 1024
    pop.ensure(5)  # blocks 0..5 in use: 0..7 resident
    assert pop.populated == 8
    for r in range(4):
        pages = _resident_pages(flat[r].data_ptr(), 64 * block)
        assert all(pages[: 8 * 3]), r  # every page of blocks 0..7
        assert not any(pages[8 * 3:]), r  # nothing past them: RAM still follows use
    pop.ensure(3)  # below what is resident: nothing to do
    assert pop.populated == 8
    pop.ensure(63)  # clipped to the cache
    assert pop.populated == 64
    assert all(_resident_pages(flat[3].data_ptr(), 64 * block))
    assert flat.abs().sum().item() == 0  # made resident, still zeros


@pytest.mark.skipif(
    not hasattr(os, "fork"), reason="needs fork() to tell a private mapping from a shared one"
)
def test_the_kv_mapping_is_private_so_a_forked_child_copies_it():
    """A shared mapping (Python's mmap default) would let a child process's KV writes land in the
    parent's cache; a private one is copied on write."""
    flat = _kv_mapping(regions=1, blocks=4)
    flat[0, 0, 0] = 1.0
    pid = os.fork()
    if pid == 0:  # the child writes and leaves at once, without pytest's teardown
        flat[0, 0, 0] = 7.0
        flat[0, 3, 5] = 9.0
        os._exit(0 if flat[0, 0, 0].item() == 7.0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert flat[0, 0, 0].item() == 1.0 and flat[0, 3, 5].item() == 0.0


def test_kv_populator_falls_back_to_page_faults_when_madvise_refuses(caplog):
    import ctypes

    from engine.model_runner import KVPopulator

    flat = _kv_mapping()
    pop = KVPopulator(flat, regions=4, num_blocks=64, ahead=2)
    calls = []

    def refuse(addr, length, advice):
        calls.append(advice)
        ctypes.set_errno(22)
        return -1

    pop.madvise = refuse
    with caplog.at_level("INFO", logger="engine.model_runner"):
        pop.ensure(5)
        pop.ensure(40)
    assert calls == [23] and pop.madvise is None and pop.populated == 0  # asked once, then never again
    assert "fault in one at a time" in caplog.text and "Invalid argument" in caplog.text
    flat[2, 40] = 1.0  # the cache still works: its pages fault in on write
    assert flat[2, 40].sum().item() == 3 * 1024


def test_a_run_keeps_the_kv_blocks_it_writes_resident(ckpt):
    llm = LLM("tiny", checkpoint=ckpt, num_kv_blocks=512, block_size=16)
    llm.generate([[1, 2, 3] * 20, [4, 5] * 7], SamplingParams(max_tokens=40, temperature=0.0))
    pop = llm.engine.runner.kv_populator
    if pop.madvise is None:
        pytest.skip("no MADV_POPULATE_WRITE on this kernel")
    used = 5 + 4  # (60 + 40) / 16 and (14 + 40) / 16 blocks, rounded up
    assert used <= pop.populated <= used + pop.ahead  # the first prefill's blocks plus the margin
    for k_cache, v_cache in llm.engine.runner.kv_caches:
        for cache in (k_cache, v_cache):
            start = cache.data_ptr() // 4096 * 4096
            end = cache.data_ptr() + pop.populated * pop.block_bytes
            assert all(_resident_pages(start, end - start))
