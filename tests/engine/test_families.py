"""Every supported family, loaded with LLM(model=DIR) from a tiny random checkpoint that transformers
built and saved, generates greedily what transformers' own generate does on the same weights, under
chunked prefill, mixed prefill/decode steps and preemption, on the CPU's default kernels, the torch
references and the Triton kernels (interpreted), in float32 and bfloat16.

The comparison rule. float32: every token equal. bfloat16 (transformers in bfloat16 on the same
weights is the reference): two implementations that round in different places (a fused norm, another
accumulation order in a GEMM or the attention) produce logits that differ by bf16 noise (~1e-2
relative), so where a step's two best logits are that close, either pick is right and the sequences
part there. The rule (vLLM's check_logprobs_close): tokens equal up to the first difference, and at
it each side's token must be among the other side's top 5 (a near tie, not a wrong model); after it
the sequences are no longer comparable. A wrong model fails that at once: its tokens part from the
reference's where no near tie explains it (test_the_bf16_rule_catches_a_wrong_model).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import ops
from tests.engine.families import CASES, build_checkpoint, hf_generate
from tests.engine.hf_reference import check_logprobs_close

# prompts longer than the sliding windows of the cases (6 and 8 tokens), token ids of the byte range
PROMPTS = [[72, 105, 33], [200 - 7 * i for i in range(11)], [(31 * i) % 256 for i in range(19)],
           [(97 + 13 * i) % 256 for i in range(26)]]
MAX_NEW = 8
# three sequences at a time, 12 tokens a step (prompts chunked, steps mixed), 12 blocks of 4 tokens:
# too few for three sequences at full length, so the scheduler preempts
REGIME = dict(max_num_seqs=3, max_num_batched_tokens=12, block_size=4, num_kv_blocks=12)
# the Triton interpreter is slow: its cases are the ones whose kernels differ (windows, norms, GELU,
# biases, experts), on two prompts
TRITON_CASES = ["llama", "llama-llama3", "qwen2-window", "qwen3", "gemma3", "qwen3_moe"]
TRITON_PROMPTS = [PROMPTS[1], PROMPTS[2]]
TRITON_MAX_NEW = 4
TRITON_REGIME = dict(max_num_seqs=2, max_num_batched_tokens=8, block_size=4, num_kv_blocks=16)


class _Store:
    """Checkpoints and transformers' outputs, built once per (case, dtype) for the module."""

    def __init__(self, root) -> None:
        self.root, self.dirs, self.refs = root, {}, {}

    def directory(self, case: str, dtype: str):
        if (case, dtype) not in self.dirs:
            directory = self.root / f"{case}-{dtype}"
            self.dirs[case, dtype] = build_checkpoint(CASES[case], directory, getattr(torch, dtype))
        return self.dirs[case, dtype]

    def reference(self, case: str, dtype: str, prompts=PROMPTS, max_new: int = MAX_NEW):
        key = (case, dtype, str(prompts), max_new)
        if key not in self.refs:
            self.refs[key] = hf_generate(self.directory(case, dtype), prompts, max_new, getattr(torch, dtype))
        return self.refs[key]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return _Store(tmp_path_factory.mktemp("families"))


@pytest.fixture
def backend():
    yield ops.set_backend
    ops.set_backend(None)


def _generate(directory, dtype: str, prompts, regime, max_new: int = MAX_NEW) -> tuple[list, LLM]:
    llm = LLM(str(directory), dtype=dtype, **regime)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=5))
    return [(o.token_ids, o.logprobs) for o in outs], llm


def _check(reference, ours, dtype: str) -> None:
    if dtype == "float32":
        assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in reference]
    else:
        check_logprobs_close(reference, ours, "transformers", "batchgen")


@pytest.mark.parametrize("kernels, dtype", [("cpu-native", "float32"), ("torch", "float32"),
                                            ("torch", "bfloat16")])
@pytest.mark.parametrize("case", list(CASES))
def test_family_equals_transformers(store, backend, case, kernels, dtype):
    backend(kernels)
    ours, llm = _generate(store.directory(case, dtype), dtype, PROMPTS, REGIME)
    _check(store.reference(case, dtype), ours, dtype)
    stats = llm.iteration_stats
    assert sum(s.num_preempted for s in stats) > 0
    assert any(s.num_prefill_seqs and s.num_decode_seqs for s in stats)  # mixed steps
    assert any(s.prefill_tokens == REGIME["max_num_batched_tokens"] for s in stats)  # a prompt chunked


@pytest.mark.parametrize("case", TRITON_CASES)
def test_family_equals_transformers_on_triton_kernels(store, backend, case):
    pytest.importorskip("triton", reason="the Triton kernels need the triton package")
    backend("triton")
    ours, llm = _generate(store.directory(case, "float32"), "float32", TRITON_PROMPTS, TRITON_REGIME,
                          TRITON_MAX_NEW)
    _check(store.reference(case, "float32", TRITON_PROMPTS, TRITON_MAX_NEW), ours, "float32")
    assert any(s.num_prefill_seqs and s.num_decode_seqs for s in llm.iteration_stats)


def _variant(store, case: str, tmp_path, edit) -> list[list[int]]:
    """The engine's tokens on the same weights under an edited config.json."""
    directory = tmp_path / f"{case}-edited"
    shutil.copytree(store.directory(case, "float32"), directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    return [tokens for tokens, _ in _generate(directory, "float32", PROMPTS, REGIME)[0]]


@pytest.mark.parametrize("case, edit", [
    ("llama-llama3", lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("llama-yarn", lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("llama-linear", lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    ("mistral-window", lambda c: c.update(sliding_window=None)),
    ("qwen2-window", lambda c: c.update(use_sliding_window=False, layer_types=None)),
    ("gemma3", lambda c: c.update(sliding_window=512)),
    ("qwen3_moe", lambda c: c.update(norm_topk_prob=False)),
], ids=["llama3-rope", "yarn-rope", "linear-rope", "mistral-window", "qwen2-window", "gemma3-window",
        "moe-renormalisation"])
def test_each_difference_changes_the_tokens(store, tmp_path, case, edit):
    """The equality tests above are not vacuous: undo the difference the case exists for and the
    tokens change (the old loader ignored rope_parameters and gave exactly the edited tokens)."""
    reference = [tokens for tokens, _ in store.reference(case, "float32")]
    assert _variant(store, case, tmp_path, edit) != reference


def test_the_bf16_rule_catches_a_wrong_model(store, backend, tmp_path):
    """A Llama 3 checkpoint run without its rope scaling (what the old loader did), in bfloat16: the
    bf16 comparison rule refuses it."""
    backend("torch")
    directory = tmp_path / "wrong"
    shutil.copytree(store.directory("llama-llama3", "bfloat16"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (directory / "config.json").write_text(json.dumps(config))
    ours, _ = _generate(directory, "bfloat16", PROMPTS, REGIME)
    with pytest.raises(AssertionError, match="not in"):
        check_logprobs_close(store.reference("llama-llama3", "bfloat16"), ours, "transformers", "batchgen")
