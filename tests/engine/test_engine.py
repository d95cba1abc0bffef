"""The engine end to end on a tiny random Llama, against transformers on the same weights."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny import hf_greedy_ids, tiny_hf_checkpoint


@pytest.fixture(scope="module")
def ckpt():
    return tiny_hf_checkpoint()


def _prompts(n=12, seed=0, lo=1, hi=70, vocab=97):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


CONFIGS = {
    "roomy": dict(max_num_seqs=16, max_num_batched_tokens=512, block_size=16, num_kv_blocks=128),
    "chunked": dict(max_num_seqs=4, max_num_batched_tokens=24, block_size=4, num_kv_blocks=256),
    "preempting": dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=30),
    "no-chunking": dict(max_num_seqs=8, max_num_batched_tokens=128, block_size=8, num_kv_blocks=128,
                        enable_chunked_prefill=False, max_model_len=128),
    "prefix-cache": dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=64,
                         enable_prefix_caching=True),
    "priority": dict(max_num_seqs=3, max_num_batched_tokens=48, block_size=8, num_kv_blocks=40,
                     scheduling_policy="priority"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(ckpt, name):
    prompts = _prompts()
    if name == "prefix-cache":  # shared prefixes so the cache is actually hit
        prompts = [prompts[0][:40] + p[:20] for p in prompts]
    llm = LLM("tiny", checkpoint=ckpt, **CONFIGS[name])
    params = [SamplingParams(max_tokens=16, temperature=0.0, priority=i % 3) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy_ids(ckpt.hf_model, prompt, 16)
    stats = llm.iteration_stats
    if name == "preempting":
        assert sum(s.num_preempted for s in stats) > 0
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    if name == "chunked":
        assert any(s.num_prefill_seqs and s.num_decode_seqs for s in stats)  # mixed iterations
    if name == "prefix-cache":
        assert sum(s.prefix_cache_hit_tokens for s in stats) >= 36 * (len(prompts) - 1)


def test_iteration_stats_invariants(ckpt):
    llm = LLM("tiny", checkpoint=ckpt, **CONFIGS["preempting"])
    llm.generate(_prompts(20, seed=1), SamplingParams(max_tokens=20, temperature=0.0))
    assert [s.iteration for s in llm.iteration_stats] == list(range(len(llm.iteration_stats)))
    for s in llm.iteration_stats:
        assert s.scheduled_tokens <= s.token_budget
        assert s.num_scheduled_seqs <= s.max_num_seqs
        assert s.prefill_tokens + s.decode_tokens == s.scheduled_tokens
        assert s.num_prefill_seqs + s.num_decode_seqs == s.num_scheduled_seqs
        assert s.kv_blocks_used <= s.kv_blocks_total
        assert s.num_running <= s.max_num_seqs
    assert sum(s.num_finished for s in llm.iteration_stats) == 20


def test_seeded_sampling_same_alone_and_in_a_batch(ckpt):
    llm = LLM("tiny", checkpoint=ckpt, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64)
    target = _prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    alone = llm.generate([target], params)[0].token_ids
    others = _prompts(7, seed=6)
    batch = llm.generate(others[:3] + [target] + others[3:],
                         [SamplingParams(max_tokens=30, temperature=1.0)] * 3 + [params]
                         + [SamplingParams(max_tokens=5, temperature=0.5, seed=9)] * 4)
    assert batch[3].token_ids == alone
    different_seed = llm.generate([target], SamplingParams(max_tokens=24, temperature=0.9, seed=99))
    assert different_seed[0].token_ids != alone


def test_logprobs_include_the_chosen_token_and_top_n(ckpt):
    llm = LLM("tiny", checkpoint=ckpt, num_kv_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert token in lp and len(lp) == 3  # greedy: the chosen token is the top one
        assert max(lp.values()) == lp[token] <= 0.0


def test_bad_requests_finish_with_an_error_and_the_rest_runs(ckpt):
    llm = LLM("tiny", checkpoint=ckpt, num_kv_blocks=64, max_model_len=50)
    outs = llm.generate([[], [5] * 50, [1, 2, 500], [4, 5, 6]], SamplingParams(max_tokens=4, temperature=0))
    assert [o.finish_reason for o in outs] == ["error", "error", "error", "length"]
    assert "empty prompt" in outs[0].error
    assert "max_model_len is 50" in outs[1].error
    assert "outside the vocabulary" in outs[2].error
    assert len(outs[3].token_ids) == 4


def test_max_model_len_caps_output(ckpt):
    llm = LLM("tiny", checkpoint=ckpt, num_kv_blocks=64, max_model_len=20)
    out = llm.generate([[3] * 15], SamplingParams(max_tokens=100, temperature=0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_abort_cancels_a_running_request(ckpt):
    llm = LLM("tiny", checkpoint=ckpt, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=3, temperature=0))
    finished = {}
    for _ in range(3):
        finished.update({o.request_id: o for o in engine.step()})
    engine.abort_request(["a"])
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
    assert finished["a"].finish_reason == "cancelled" and 0 < len(finished["a"].token_ids) < 50
    assert finished["b"].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_request_timing_is_ordered(ckpt):
    llm = LLM("tiny", checkpoint=ckpt, num_kv_blocks=64, max_num_seqs=2)
    outs = llm.generate(_prompts(6), SamplingParams(max_tokens=6, temperature=0))
    for o in outs:
        m = o.metrics
        assert m.arrival_ts <= m.scheduled_ts <= m.first_token_ts <= m.finished_ts
        assert m.output_tokens == 6 and m.prompt_tokens == len(o.prompt_token_ids)
        assert m.ttft_s >= m.queue_s >= 0 and m.tpot_s >= 0


def test_greedy_steps_take_their_tokens_from_the_head_without_logits(kernel_options, monkeypatch,
                                                                     cpu_variant):
    """Where the lm_head is in panels (vocab a multiple of 64) and every sequence of a step is greedy
    without logprobs, penalties or grammar, the runner takes the picks from the head's fused argmax
    (cpu_gemm.argmax_panels): the same tokens as transformers and as with fused_argmax off. A step
    with a sampled or a logprobs request among them reads the logits as before."""
    from kernels import cpu_gemm

    ckpt = tiny_hf_checkpoint(vocab_size=128)
    llm = LLM("tiny", checkpoint=ckpt, **CONFIGS["roomy"])
    if not cpu_gemm.is_panels((llm.engine.runner.model.lm_head or llm.engine.runner.model.tied_head).weight):
        pytest.skip(f"the lm_head is not in panels in the {cpu_variant} build (no panel GEMM): steps read "
                    "the logits")
    calls = []
    real = cpu_gemm.argmax_panels
    monkeypatch.setattr(cpu_gemm, "argmax_panels", lambda x, w: calls.append(len(x)) or real(x, w))
    prompts = _prompts(6, seed=3, vocab=128)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    fused = [o.token_ids for o in llm.generate(prompts, greedy)]
    ran = sum(s.num_scheduled_seqs > 0 for s in llm.iteration_stats)  # async: the last step applies only
    assert len(calls) == ran and sum(calls) == 6 * 8
    assert fused == [hf_greedy_ids(ckpt.hf_model, p, 8) for p in prompts]
    kernel_options(fused_argmax=False)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == fused
    kernel_options(fused_argmax=True)
    calls.clear()
    mixed = [greedy] * 5 + [SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)]
    outs = llm.generate(prompts, mixed)
    assert calls == [] and [o.token_ids for o in outs] == fused


def test_an_engine_runs_the_isa_variant_its_kernel_options_name(kernel_options):
    """KernelOptions(isa=...) (a benchmark's --kernel-option isa=avx2): the engine's C kernels are that
    variant's, with the same greedy tokens; one the CPU cannot run is refused naming the option and
    the flags it lacks, before anything is packed."""
    from dataclasses import replace

    from kernels import cpu_native, options
    from kernels.options import KernelOptions

    plainest = cpu_native.runnable()[0]
    if plainest == cpu_native.NATIVE:
        pytest.skip("no ISA variant runs on this CPU (not x86-64, or no AVX2)")
    ckpt = tiny_hf_checkpoint(vocab_size=128)
    prompts = _prompts(4, seed=5, vocab=128)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    kernel_options()  # the fixture puts the process's variant back after the test
    llm = LLM("tiny", checkpoint=ckpt, num_kv_blocks=64, max_num_seqs=4,
              kernel_options=replace(options.current(), isa=plainest))
    assert cpu_native.variant() == plainest
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == [hf_greedy_ids(ckpt.hf_model, p, 6)
                                                                    for p in prompts]
    missing = [v for v in cpu_native.VARIANTS if v not in cpu_native.runnable()]
    if missing:
        with pytest.raises(ValueError, match=f"kernel option isa={missing[-1]}: this CPU cannot run"):
            LLM("tiny", checkpoint=ckpt, num_kv_blocks=64, kernel_options=KernelOptions(isa=missing[-1]))
        assert cpu_native.variant() == plainest
