"""Scheduler and block manager on fake sequences: no model, no torch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks=64, block_size=16, policy="fcfs", prefix=False, **kw):
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, scheduling_policy=policy,
                          enable_prefix_caching=prefix, **kw)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(config, bm)


def make_seq(n_prompt, max_tokens=8, priority=0, rid=None, arrival=0.0, tokens=None):
    ids = tokens if tokens is not None else [(7 * i + 3) % 1000 for i in range(n_prompt)]
    return Sequence(rid or f"r{n_prompt}-{arrival}", ids,
                    SamplingParams(max_tokens=max_tokens, priority=priority), arrival_ts=arrival)


def step(sched: Scheduler, token: int = 1):
    """One iteration as the engine runs it, with a fake forward pass that samples `token`."""
    out = sched.schedule()
    for seq in sched.on_step_done(out):
        seq.append_token(token)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
    return out


def test_worked_example_six_decodes_and_a_250_token_chunk():
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256)
    decodes = [make_seq(10, max_tokens=100, rid=f"d{i}") for i in range(6)]
    for s in decodes:
        sched.add(s)
    step(sched)  # all six prompts prefilled (60 tokens), each samples its first token
    assert all(s.num_output_tokens == 1 for s in decodes)
    sched.add(make_seq(1000, rid="long"))
    out = sched.schedule()
    assert out.num_scheduled_tokens == 256
    assert len(out.scheduled) == 7
    assert [s.num_new_tokens for s in out.scheduled] == [1] * 6 + [250]
    assert [s.is_decode for s in out.scheduled] == [True] * 6 + [False]


def test_chunked_prefill_continues_before_new_admissions():
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    long_seq, short = make_seq(150, rid="long"), make_seq(5, rid="short")
    sched.add(long_seq)
    sched.add(short)
    sizes = []
    while long_seq.num_output_tokens == 0:
        out = step(sched)
        sizes.append([(s.seq.request_id, s.num_new_tokens) for s in out.scheduled])
    assert sizes[0] == [("long", 64)]
    assert sizes[1] == [("long", 64)]
    assert sizes[2] == [("long", 22), ("short", 5)]


def test_no_chunked_prefill_waits_for_a_whole_prompt():
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=64, enable_chunked_prefill=False,
                           max_model_len=64)
    a, b = make_seq(40, rid="a"), make_seq(40, rid="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 40)]


def test_fcfs_never_starves_an_older_request():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    big = make_seq(40, max_tokens=4, rid="big", arrival=0.0)
    sched.add(make_seq(20, max_tokens=30, rid="early", arrival=-1.0))
    step(sched)
    sched.add(big)
    for i in range(50):
        sched.add(make_seq(3, max_tokens=2, rid=f"small{i}", arrival=1.0 + i))
    for _ in range(400):
        if big.is_finished:
            break
        step(sched)
        # nothing that arrived after `big` may be admitted while it still waits
        if big.status is SequenceStatus.WAITING and big.num_computed_tokens == 0:
            assert not any(s.request_id.startswith("small") for s in sched.running)
    assert big.is_finished and big.finish_reason == "length"


def test_priority_order_and_preemption_of_the_lowest_priority():
    sched = make_scheduler(num_blocks=64, policy="priority", max_num_seqs=2, max_num_batched_tokens=512)
    for prio, rid in [(5, "low"), (0, "high"), (2, "mid")]:
        sched.add(make_seq(8, priority=prio, rid=rid))
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["high", "mid"]

    tight = make_scheduler(num_blocks=4, block_size=4, policy="priority", max_num_batched_tokens=64)
    low, high = make_seq(7, max_tokens=20, priority=9, rid="low"), make_seq(7, max_tokens=20, rid="high")
    tight.add(low)
    step(tight)
    tight.add(high)
    preempted = []
    for _ in range(40):
        preempted += [s.request_id for s in step(tight).preempted]
    assert preempted and set(preempted) == {"low"}
    assert high.is_finished and high.stats.num_preemptions == 0


def test_request_larger_than_the_whole_cache_finishes_with_error():
    sched = make_scheduler(num_blocks=4, block_size=4)
    too_long = make_seq(17, rid="prompt-too-long")
    grows = make_seq(12, max_tokens=100, rid="grows-too-long")
    ok = make_seq(3, max_tokens=2, rid="ok")
    for s in (too_long, grows, ok):
        sched.add(s)
    for _ in range(50):
        if not sched.has_unfinished():
            break
        step(sched)
    assert not sched.has_unfinished()
    assert too_long.finish_reason == "error" and "KV blocks" in too_long.error
    assert grows.finish_reason == "error" and "cannot hold" in grows.error
    assert ok.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 4


def test_preemption_step_admits_nothing_new_and_recomputes():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    a, b = make_seq(10, max_tokens=10, rid="a"), make_seq(10, max_tokens=10, rid="b")
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.add(make_seq(2, rid="late"))
    saw_preemption = False
    for _ in range(100):
        running_before = list(sched.running)
        out = step(sched)
        if out.preempted:
            saw_preemption = True
            assert all(s.seq in running_before for s in out.scheduled)  # nothing newly admitted
            assert all(p.num_computed_tokens == 0 and not p.block_table for p in out.preempted)
            assert out.preempted[0] is running_before[-1]  # FCFS: the latest admitted goes first
        if not sched.has_unfinished():
            break
    assert saw_preemption and a.stats.num_preemptions + b.stats.num_preemptions >= 1
    assert a.num_output_tokens == 10 and b.num_output_tokens == 10


def test_a_preempted_sequence_longer_than_the_budget_is_recomputed_in_chunks():
    """Without chunked prefill a preempted sequence whose prompt and outputs outgrew the token budget
    could never be scheduled whole again: it is recomputed in chunks instead of waiting forever."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=12,
                           enable_chunked_prefill=False, max_model_len=12)
    first, second = make_seq(12, 6, rid="first"), make_seq(9, 5, rid="second")
    sched.add(first)
    sched.add(second)
    preempted = []
    for _ in range(40):
        out = step(sched)
        preempted += out.preempted
        assert out.num_scheduled_tokens <= 12
        if not sched.has_unfinished():
            break
    assert [s.request_id for s in preempted] == ["second"]
    assert second.num_tokens == 9 + 5 > 12  # outgrew the budget before it came back
    assert first.finish_reason == second.finish_reason == "length"


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 40), st.integers(0, 3),
                               st.integers(0, 5)), min_size=1, max_size=24),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 200),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 4, 16]),
    policy=st.sampled_from(["fcfs", "priority"]),
    chunked=st.booleans(),
    prefix=st.booleans(),
)
def test_random_workloads_respect_caps_and_conserve_blocks(
        prompts, max_num_seqs, budget, num_blocks, block_size, policy, chunked, prefix):
    kw = {} if chunked else {"max_model_len": budget}
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, policy=policy, prefix=prefix,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           enable_chunked_prefill=chunked, **kw)
    bm = sched.block_manager
    seqs = []
    for i, (n, max_tokens, prio, arrive_at) in enumerate(prompts):
        if not chunked:
            n = min(n, budget)
        seqs.append((arrive_at, make_seq(n, max_tokens, prio, rid=f"s{i}", arrival=float(arrive_at),
                                         tokens=[(j % 7) for j in range(n)])))
    for it in range(3000):
        for arrive_at, s in seqs:
            if arrive_at == it:
                sched.add(s)
        if it > 5 and not sched.has_unfinished():
            break
        out = step(sched, token=it % 11)
        assert out.num_scheduled_tokens <= budget
        assert len(out.scheduled) <= max_num_seqs
        assert len(sched.running) <= max_num_seqs
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        held = [b for s in sched.running for b in s.block_table]
        refs = [0] * num_blocks
        for b in held:
            refs[b] += 1
        assert refs == bm.ref_counts  # every held block counted once per holder
        assert bm.num_used_blocks + bm.num_free_blocks == num_blocks
        assert bm.num_used_blocks == sum(1 for r in refs if r > 0)
    assert not sched.has_unfinished()
    for _, s in seqs:
        assert s.is_finished
        assert s.finish_reason == "error" or s.num_output_tokens == s.params.max_tokens
    assert bm.num_free_blocks == num_blocks
