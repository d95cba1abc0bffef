"""A request whose step raises fails alone: the engine re-runs the step in halves down to the
request at fault, finishes it with finish_reason 'error', and everyone else gets the tokens a clean
run gives."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny import tiny_hf_checkpoint

CONFIG = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=96)


@pytest.fixture(scope="module")
def ckpt():
    return tiny_hf_checkpoint(seed=2)


def _prompts(n, seed=0, vocab=90):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def _poison(llm, token: int) -> None:
    """Make the model raise whenever `token` is among its input ids (a stand-in for a request that
    breaks a kernel: an out-of-range value, a shape the kernel refuses)."""
    model = llm.engine.runner.model
    real = model.forward

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == token).any()):
            raise RuntimeError(f"kernel refused token {token}")
        return real(input_ids, *args, **kwargs)

    model.forward = forward


@pytest.mark.parametrize("eager", [True, False])
def test_the_request_at_fault_fails_alone(ckpt, eager):
    prompts = _prompts(12, seed=1)
    params = [SamplingParams(max_tokens=8, temperature=0.0) if i % 2 else
              SamplingParams(max_tokens=8, temperature=0.9, seed=i) for i in range(len(prompts))]
    clean = [o.token_ids for o in LLM("tiny", checkpoint=ckpt, enforce_eager=eager, **CONFIG)
             .generate(prompts, params)]
    poison = 95  # outside every prompt (ids < 90)
    assert all(poison not in toks for toks in clean)
    prompts[5] = prompts[5][:3] + [poison] + prompts[5][3:]
    llm = LLM("tiny", checkpoint=ckpt, enforce_eager=eager, **CONFIG)
    _poison(llm, poison)
    outs = llm.generate(prompts, params)
    assert outs[5].finish_reason == "error" and "kernel refused token 95" in outs[5].error
    for i, out in enumerate(outs):
        if i != 5:
            assert out.finish_reason == "length" and out.token_ids == clean[i], i
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert sum(s.num_finished for s in llm.iteration_stats) == len(prompts)


def test_a_failure_in_the_stop_check_fails_only_its_request(ckpt, monkeypatch):
    llm = LLM("tiny", checkpoint=ckpt, **CONFIG)
    engine = llm.engine
    real = engine._stop_reason

    def stop_reason(seq, token):
        if seq.request_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(seq, token)

    monkeypatch.setattr(engine, "_stop_reason", stop_reason)
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("good", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0.0))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    assert done["bad"].finish_reason == "error" and "invalid start byte" in done["bad"].error
    assert done["good"].finish_reason == "length" and len(done["good"].token_ids) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
