"""Engine level: greedy generation through the Triton kernels (interpreted on CPU) equals the torch
path on a tiny random Llama, token for token."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from kernels import ops
from tests.engine.tiny import tiny_hf_checkpoint

pytest.importorskip("triton", reason="the Triton kernels need the triton package")


@pytest.fixture
def backend():
    yield ops.set_backend
    ops.set_backend(None)


def test_triton_engine_matches_torch_engine(backend):
    ckpt = tiny_hf_checkpoint(seed=3, num_attention_heads=4, num_key_value_heads=1)
    prompts = [[5, 6, 7], list(range(1, 20)), [9] * 33, [40, 41]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    config = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=16, num_kv_blocks=16)
    results = {}
    for name in ("torch", "triton"):
        backend(name)
        llm = LLM("tiny", checkpoint=ckpt, **config)
        outs = llm.generate(prompts, params)
        results[name] = [o.token_ids for o in outs]
        assert any(s.num_prefill_seqs and s.num_decode_seqs for s in llm.iteration_stats)
    assert results["triton"] == results["torch"]
