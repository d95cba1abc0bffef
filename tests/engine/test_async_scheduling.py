"""Asynchronous scheduling (EngineConfig.async_scheduling) gives the tokens the synchronous engine
gives: greedy and seeded sampling, logprobs, stop tokens and stop strings, max_tokens and
max_model_len, penalties (whose steps are applied at once), chunked prefill, preemption, prefix
caching, a request that fails in the step, an abort while a token is being sampled."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.sequence import PLACEHOLDER
from engine.tokenizer import ByteTokenizer
from tests.engine.tiny import tiny_hf_checkpoint

CONFIGS = {
    "roomy": dict(max_num_seqs=16, max_num_batched_tokens=512, block_size=16, num_kv_blocks=128),
    "chunked": dict(max_num_seqs=6, max_num_batched_tokens=24, block_size=4, num_kv_blocks=256),
    "preempting": dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=34),
    "prefix-cache": dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=96,
                         enable_prefix_caching=True),
    "short-model-len": dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=96,
                            max_model_len=40),
}
POISON = 250  # a prompt holding this token at position 3 makes the model raise (a request's fault)


@pytest.fixture(scope="module")
def ckpt():
    ckpt = tiny_hf_checkpoint(seed=11, vocab_size=259)
    ckpt.tokenizer = ByteTokenizer()
    return ckpt


def _requests(n: int, seed: int, stops: dict[int, str], shared_prefix: bool):
    """Prompts of printable bytes, and a mix of every kind of request."""
    rng = random.Random(seed)
    head = [rng.randrange(32, 127) for _ in range(12)] if shared_prefix else []
    prompts = [head + [rng.randrange(32, 127) for _ in range(rng.randint(5, 30))] for _ in range(n)]
    kinds = [
        lambda i: SamplingParams(max_tokens=12, temperature=0.0),
        lambda i: SamplingParams(max_tokens=14, temperature=0.8, top_k=40, top_p=0.9, seed=i),
        lambda i: SamplingParams(max_tokens=9, temperature=0.0, logprobs=3),
        lambda i: SamplingParams(max_tokens=16, temperature=1.0, min_p=0.02, seed=100 + i,
                                 stop_token_ids=[101]),
        lambda i: SamplingParams(max_tokens=15, temperature=0.0, stop=[stops.get(i, "zz")]),
        lambda i: SamplingParams(max_tokens=11, temperature=0.7, seed=7, logprobs=1, ignore_eos=True),
        lambda i: (SamplingParams(max_tokens=4, temperature=0.9, repetition_penalty=1.3, seed=3 + i) if i < 8
                   else SamplingParams(max_tokens=10, temperature=0.9, seed=3 + i)),  # steps applied at once
        lambda i: SamplingParams(max_tokens=1, temperature=0.0),
    ]
    return prompts, [kinds[i % len(kinds)](i) for i in range(n)]


def _poison(llm: LLM) -> None:
    model = llm.engine.runner.model
    real = model.forward

    def forward(input_ids, positions, *args, **kwargs):
        if ((input_ids == POISON) & (positions == 3)).any():
            raise RuntimeError(f"kernel refused token {POISON}")
        return real(input_ids, positions, *args, **kwargs)

    model.forward = forward


def _run(ckpt, config: dict, prompts, params, async_scheduling: bool):
    llm = LLM("tiny", checkpoint=ckpt, **config, async_scheduling=async_scheduling)
    _poison(llm)
    overlapped = []
    llm.engine.stat_loggers.append(lambda stats: overlapped.append(llm.engine._in_flight is not None))
    outs = llm.generate(prompts, params)
    return [(o.token_ids, o.finish_reason, o.text, o.logprobs, o.error) for o in outs], llm, sum(overlapped)


def _stops(ckpt, prompts) -> dict[int, str]:
    """A stop string for the stop-string requests: two characters their greedy output reaches."""
    llm = LLM("tiny", checkpoint=ckpt, **CONFIGS["roomy"], async_scheduling=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=15, temperature=0.0))
    return {i: o.text[4:6] for i, o in enumerate(outs) if i % 8 == 4 and len(o.text) >= 6}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_asynchronous_scheduling_gives_the_synchronous_tokens(ckpt, name):
    config = CONFIGS[name]
    prompts, _ = _requests(24, seed=5, stops={}, shared_prefix=name == "prefix-cache")
    prompts[9][3] = POISON  # fails in its prefill: an error row
    prompts, params = _requests(24, seed=5, stops=_stops(ckpt, prompts), shared_prefix=name == "prefix-cache")
    prompts[9][3] = POISON
    sync, _, none = _run(ckpt, config, prompts, params, async_scheduling=False)
    asynchronous, llm, overlapped = _run(ckpt, config, prompts, params, async_scheduling=True)
    assert none == 0 and overlapped > 5  # the asynchronous run really left steps in flight
    for i, (a, b) in enumerate(zip(sync, asynchronous, strict=True)):
        assert a == b, (i, params[i])
    reasons = [r[1] for r in sync]
    assert reasons[9] == "error" and reasons.count("error") == 1
    assert "stop" in reasons and "length" in reasons
    assert any(r[1] == "stop" and params[i].stop for i, r in enumerate(sync))  # a stop string matched
    stats = llm.iteration_stats
    if name == "preempting":
        assert sum(s.num_preempted for s in stats) > 0
    if name == "chunked":
        assert any(s.num_prefill_seqs and s.num_decode_seqs for s in stats)
    if name == "prefix-cache":
        assert sum(s.prefix_cache_hit_tokens for s in stats) > 0
    if name == "short-model-len":
        assert any(len(p) + len(r[0]) == 40 for p, r in zip(prompts, sync, strict=True))


def test_an_abort_while_a_token_is_in_flight_drops_it_and_the_rest_is_unchanged(ckpt):
    """A request aborted between steps, its next token still being sampled: cancelled with the
    tokens applied so far (no placeholder), every other request as in a synchronous run."""
    prompts, params = _requests(8, seed=2, stops={}, shared_prefix=False)
    params = [SamplingParams(max_tokens=12, temperature=0.6, seed=i) for i in range(8)]
    results = {}
    for async_scheduling in (False, True):
        llm = LLM("tiny", checkpoint=ckpt, **CONFIGS["roomy"], async_scheduling=async_scheduling)
        engine, outs = llm.engine, {}
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), p, sp)
        for _ in range(4):
            outs.update((o.request_id, o) for o in engine.step())
        if async_scheduling:
            assert engine._in_flight is not None and engine._seqs["3"].pending_row is not None
        engine.abort_request(["3"])
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step())
        results[async_scheduling] = outs
    cancelled = results[True]["3"]
    assert cancelled.finish_reason == "cancelled" and PLACEHOLDER not in cancelled.token_ids
    assert cancelled.token_ids == results[False]["3"].token_ids[: len(cancelled.token_ids)]
    assert len(cancelled.token_ids) == 3  # 4 steps: one prefill, then 3 tokens applied, 1 dropped
    for rid in map(str, (0, 1, 2, 4, 5, 6, 7)):
        assert results[True][rid].token_ids == results[False][rid].token_ids


def test_steps_with_penalties_are_applied_at_once(ckpt):
    """A step holding a request with penalties needs its tokens on the host to build the next one:
    it is never left in flight; a batch without such requests is."""
    prompts, _ = _requests(4, seed=3, stops={}, shared_prefix=False)
    for params, left in ((SamplingParams(max_tokens=6, temperature=0.5, presence_penalty=0.5, seed=1), 0),
                         (SamplingParams(max_tokens=6, temperature=0.5, seed=1), 6)):
        _, llm, in_flight = _run(ckpt, CONFIGS["roomy"], prompts, [params] * len(prompts), True)
        assert in_flight == left


def test_drain_applies_the_step_in_flight_and_the_tokens_stay_the_same(ckpt):
    """drain() (gpu-check's graph comparison needs real input tokens) leaves no placeholder, and the
    run goes on to the synchronous tokens."""
    prompts, _ = _requests(6, seed=4, stops={}, shared_prefix=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = [o.token_ids for o in LLM("tiny", checkpoint=ckpt, **CONFIGS["roomy"],
                                          async_scheduling=False).generate(prompts, params)]
    engine = LLM("tiny", checkpoint=ckpt, **CONFIGS["roomy"]).engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    for _ in range(3):
        outs.update((o.request_id, o) for o in engine.step())
    assert any(s.pending_row is not None for s in engine.scheduler.running)
    engine.drain()
    assert engine._in_flight is None
    assert all(s.pending_row is None and PLACEHOLDER not in s.token_ids for s in engine.scheduler.running)
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert [outs[str(i)].token_ids for i in range(len(prompts))] == reference
