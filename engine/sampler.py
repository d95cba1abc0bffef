"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, top-N logprobs.

Each sequence draws from its own torch.Generator, seeded by its request's seed (or by the engine
seed and its admission index), so a seeded request gives the same text whatever else shares its
iteration batch. Greedy rows never touch a generator or a softmax.
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence


class Sampler:
    def __init__(self, engine_seed: int = 0) -> None:
        self.engine_seed = engine_seed
        self._generators: dict[int, torch.Generator] = {}  # seq_index -> its generator

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_index, None)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits (S, V) float32 for `seqs` -> one token id per row, and its logprobs when asked."""
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, seqs)
        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            for i, lp in zip(want, _top_logprobs(logits[want], tokens[want], params, want), strict=True):
                logprobs[i] = lp
        return token_list, logprobs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        probs = _filtered_probs(logits[rows], [seqs[i].params for i in rows])  # (R, V)
        for r, i in enumerate(rows):
            gen = self._generator(seqs[i])
            tokens[i] = torch.multinomial(probs[r], 1, generator=gen)[0]
        return tokens

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.seq_index)
        if gen is None:
            seed = seq.params.seed
            if seed is None:
                seed = hash((self.engine_seed, seq.seq_index)) & 0x7FFF_FFFF_FFFF_FFFF
            gen = torch.Generator(device="cpu").manual_seed(seed)
            self._generators[seq.seq_index] = gen
        return gen


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Temperature, then top-k, then top-p, row by row in one batch; returns probabilities (R, V)."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temps.unsqueeze(1)
    top_ks = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
    top_ps = [p.top_p for p in params]
    if min(top_ks) < logits.shape[1] or min(top_ps) < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        k = torch.tensor(top_ks, device=logits.device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor(top_ps, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))  # keeps the top token
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits.softmax(dim=-1).cpu()


def _top_logprobs(logits, tokens, params, rows) -> list[dict[int, float]]:
    """Top-N logprobs of the model's distribution (before temperature), plus the chosen token."""
    logp = logits.log_softmax(dim=-1)
    n = max(params[i].logprobs for i in rows)
    top_v, top_i = logp.topk(max(n, 1), dim=-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    out = []
    for r, i in enumerate(rows):
        k = params[i].logprobs
        entry = dict(zip(top_i[r, :k].tolist(), top_v[r, :k].tolist(), strict=True))
        entry[int(tokens[r])] = chosen[r]
        out.append(entry)
    return out
