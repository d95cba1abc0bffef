"""The device sampler's draws follow the filtered distribution, its filters cut what they should,
penalties follow vLLM's / OpenAI's rules, and seeded rows do not depend on their batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.sampler import Sampler, apply_penalties, uniforms
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.staging import Staging

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
PROBS = LOGITS.softmax(-1).numpy()
N = 4000


def _seqs(params: SamplingParams, n: int, seed0: int = 0, outputs: list[int] | None = None) -> list[Sequence]:
    seqs = []
    for i in range(n):
        p = dataclasses.replace(params, seed=seed0 + i)
        seq = Sequence(str(i), [1, 2], p)
        for t in outputs or []:
            seq.append_token(t)
        seqs.append(seq)
    return seqs


def _draw(params: SamplingParams, n: int = N, logits: torch.Tensor = LOGITS) -> np.ndarray:
    tokens, _ = Sampler()(logits.expand(n, -1).contiguous(), _seqs(params, n))
    return np.bincount(tokens, minlength=logits.numel())


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_draws_follow_the_softmax():
    assert _chi2(_draw(SamplingParams(temperature=1.0)), PROBS) < 30  # 7 degrees of freedom


def test_temperature_sharpens():
    want = (LOGITS / 0.5).softmax(-1).numpy()
    assert _chi2(_draw(SamplingParams(temperature=0.5)), want) < 30


def test_top_k_keeps_the_k_largest_renormalised():
    want = np.where(np.arange(8) < 3, PROBS, 0)
    assert _chi2(_draw(SamplingParams(temperature=1.0, top_k=3)), want / want.sum()) < 20


def test_top_p_keeps_the_nucleus():
    # mass before each token: 0, .40, .65, ... -> top_p 0.6 keeps tokens 0 and 1 (.65 >= .6)
    want = np.where(np.arange(8) < 2, PROBS, 0)
    assert _chi2(_draw(SamplingParams(temperature=1.0, top_p=0.6)), want / want.sum()) < 20


def test_min_p_drops_tokens_below_its_share_of_the_top():
    want = np.where(PROBS >= 0.2 * PROBS.max(), PROBS, 0)
    assert (want == 0).sum() >= 3
    assert _chi2(_draw(SamplingParams(temperature=1.0, min_p=0.2)), want / want.sum()) < 25


def test_top_k_and_top_p_mixed_rows_in_one_batch():
    kinds = [dict(temperature=1.0, top_k=2), dict(temperature=1.0, top_p=0.3), dict(temperature=0.0),
             dict(temperature=1.0)]
    seqs = [Sequence(str(i), [1], SamplingParams(**kinds[i % 4], seed=i)) for i in range(1200)]
    tokens, _ = Sampler()(LOGITS.expand(len(seqs), -1).contiguous(), seqs)
    tokens = np.array(tokens).reshape(-1, 4)
    assert set(tokens[:, 0]) == {0, 1} and set(tokens[:, 1]) == {0} and set(tokens[:, 2]) == {0}
    assert len(set(tokens[:, 3])) >= 6


def test_seeded_rows_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    alone, _ = Sampler()(LOGITS[None].clone(), [Sequence("a", [1], params)])
    crowd = [Sequence(str(i), [1], SamplingParams(temperature=0.7, seed=i)) for i in range(5)]
    batch = crowd[:3] + [Sequence("a", [1], params)] + crowd[3:]
    mixed, _ = Sampler()(LOGITS.expand(6, -1).contiguous(), batch)
    assert mixed[3] == alone[0]


def test_rows_without_filters_do_not_depend_on_a_filtered_row_in_their_batch():
    """A row without top-k / top-p draws the same token alone as beside a top-p or top-k row (it
    once drew from the sorted order whenever any row of its step was filtered)."""
    logits = LOGITS[torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])]  # not in descending order
    plain = [Sequence(str(i), [1], SamplingParams(temperature=1.0, seed=i)) for i in range(40)]
    alone, _ = Sampler()(logits.expand(40, -1).contiguous(), plain)
    for other in (SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(top_k=3, seed=2)):
        batch = plain[:20] + [Sequence("f", [1], other)] + plain[20:]
        mixed, _ = Sampler()(logits.expand(41, -1).contiguous(), batch)
        assert mixed[:20] + mixed[21:] == alone
        assert logits[mixed[20]] >= logits.sort(descending=True).values[2 if other.top_k else 7]


def test_uniforms_are_a_pure_function_of_seed_and_counter():
    seeds = np.array([0, 1, 2**63, 2**64 - 1], dtype=np.uint64)
    u = uniforms(seeds, np.zeros(4, dtype=np.uint64))
    assert ((u >= 0) & (u < 1)).all() and len(set(u.tolist())) == 4
    assert np.array_equal(u, uniforms(seeds, np.zeros(4, dtype=np.uint64)))
    assert not np.array_equal(u, uniforms(seeds, np.ones(4, dtype=np.uint64)))


def _penalised_reference(logits, prompt, output, rep, freq, pres):
    """vLLM's rules written out per token."""
    out = logits.clone()
    for v in range(len(out)):
        count = output.count(v)
        if v in prompt or count:
            out[v] = out[v] / rep if out[v] > 0 else out[v] * rep
        out[v] -= freq * count + pres * (count > 0)
    return out


def test_penalties_follow_vllm_rules():
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.1, 0.0], [0.3, 0.2, 0.1, 0.0, -0.1, -0.2]])
    seqs = [Sequence("p", [0, 1, 1], SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4,
                                                    presence_penalty=0.3)),
            Sequence("q", [5], SamplingParams())]
    for t in (3, 3, 4):
        seqs[0].append_token(t)
    seqs[1].append_token(2)
    got = apply_penalties(logits, seqs, Staging(torch.device("cpu")))
    want = _penalised_reference(logits[0], [0, 1, 1], [3, 3, 4], 1.5, 0.4, 0.3)
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], logits[1])  # a row without penalties is untouched


def test_logprobs_are_the_raw_distribution_with_the_chosen_token():
    seqs = [Sequence("a", [1], SamplingParams(temperature=0.5, seed=3, logprobs=2)),
            Sequence("b", [1], SamplingParams(temperature=0.0)),
            Sequence("c", [1], SamplingParams(temperature=0.0, logprobs=0))]
    tokens, logprobs = Sampler()(LOGITS.expand(3, -1).contiguous(), seqs)
    raw = LOGITS.log_softmax(-1)
    assert logprobs[1] is None and logprobs[2] == {0: pytest.approx(raw[0].item())}
    top2 = {0: raw[0].item(), 1: raw[1].item()}
    assert {k: v for k, v in logprobs[0].items() if k in top2} == pytest.approx(top2)
    assert logprobs[0][tokens[0]] == pytest.approx(raw[tokens[0]].item())
