"""Token sampling on the logits' device: greedy, penalties, temperature, min-p, top-k, top-p,
per-request seeds, top-N logprobs; one device -> host copy per step.

Every row draws with one uniform number per token, computed on the host from (seed, index of the
token being drawn) by a counter-based hash: a seeded request gives the same text whatever else
shares its iteration batch, on any step it runs, preempted or not. A request without a seed gets
one from the engine seed and its admission index. The draw is an inverse-CDF lookup in the
filtered distribution (`searchsorted` over the cumulative probabilities), vectorised over rows:
no per-row loop, no host sync until the step's tokens (and logprobs) come back in one copy.

Order of processing, as in vLLM: penalties on the raw logits, the grammar masks of constrained
rows (structured output: tokens the row's grammar refuses get -inf; rows without a constraint
are not touched and a step without constrained rows does no mask work), temperature, min-p,
top-k, top-p. Logprobs are the model's own distribution (raw logits, before any of these).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import numpy as np
import torch

from engine.sequence import Sequence
from engine.staging import Staging
from engine.structured_output import StructuredOutputs
from kernels import ops

_MASK64 = (1 << 64) - 1


def greedy_only(seqs: list[Sequence]) -> bool:
    """Whether every row's token is its logits' argmax and nothing else is read from them: greedy,
    no logprobs, penalties or grammar (Sequence.greedy_only)."""
    return all(map(_GREEDY_ONLY, seqs))


_GREEDY_ONLY = operator.attrgetter("greedy_only")
_NEEDS_HOST_TOKENS = operator.attrgetter("needs_host_tokens")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic): a well-mixed 64-bit hash."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per row from uint64 seeds and token indices (float64, 53 bits)."""
    x = splitmix64(seeds ^ splitmix64(counters.astype(np.uint64)))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass
class Sampled:
    """One step's sampling, queued on the device: `tokens` (S,) int64 (what the next step's inputs
    may take the new tokens from before the host has them), `fetched` (the tokens, or float64
    tokens + logprobs packed) for the one device -> host copy."""

    tokens: torch.Tensor
    fetched: torch.Tensor
    num_rows: int
    want: np.ndarray | None = None  # rows that asked for logprobs
    asked: np.ndarray | None = None  # top-N asked per row (-1: none)


@dataclass
class _Rows:
    """Host-side per-row parameters of one step (numpy, one entry per sampled sequence)."""

    greedy: np.ndarray  # bool
    temperature: np.ndarray  # float32, 1 for greedy rows
    top_k: np.ndarray  # int64, 0 = off
    top_p: np.ndarray  # float32, 1 = off
    min_p: np.ndarray  # float32, 0 = off
    u: np.ndarray  # float64 uniforms
    logprobs: np.ndarray  # int64 top-N per row, -1 = not asked


class Sampler:
    def __init__(self, engine_seed: int = 0, staging: Staging | None = None,
                 structured: StructuredOutputs | None = None) -> None:
        self.engine_seed = engine_seed
        self.staging = staging
        self.structured = structured  # grammars and matchers of constrained rows (the engine's)
        self._seeds: dict[int, int] = {}  # seq_index -> its seed (uint64)
        self._batch: list[Sequence] = []  # the sequences of the latest step that sampled, and ...
        self._static: _Rows | None = None  # ... their parameters (u holds their seeds)
        self._prompt_lens = np.zeros(0, dtype=np.int64)

    def release(self, seq: Sequence) -> None:
        self._seeds.pop(seq.seq_index, None)

    def _seed(self, seq: Sequence) -> int:
        seed = self._seeds.get(seq.seq_index)
        if seed is None:
            seed = seq.params.seed
            if seed is None:
                seed = hash((self.engine_seed, seq.seq_index))
            seed &= _MASK64
            self._seeds[seq.seq_index] = seed
        return seed

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits (S, V) float32 for `seqs` -> one token id per row, and its logprobs when asked; or
        (S,) int64 token ids the runner picked already (where greedy_only holds). sample() and
        collect() with the fetch between them."""
        staging = self.staging or Staging(logits.device)
        sampled = self.sample(logits, seqs, staging)
        return self.collect(sampled, staging.fetch(sampled.fetched))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], staging: Staging | None = None) -> Sampled:
        """The step's tokens on the device, and what to fetch for them: every op is queued, nothing
        is read back (the engine fetches `fetched` once and hands it to collect())."""
        staging = staging or self.staging or Staging(logits.device)
        if logits.dim() == 1:  # the runner's picks already (greedy_only: the model's head took the argmax)
            return Sampled(logits, logits, len(seqs))
        if greedy_only(seqs):  # the common batch case: an argmax and one copy
            tokens = ops.argmax(logits)
            return Sampled(tokens, tokens, len(seqs))
        params = [s.params for s in seqs]
        constrained = np.flatnonzero([p.constraint is not None for p in params])
        rows = self._rows(seqs)
        raw = logits
        if any(map(_NEEDS_HOST_TOKENS, seqs)) and any(p.has_penalties for p in params):
            logits = apply_penalties(logits, seqs, staging)
        if constrained.size:
            logits = self._apply_grammars(logits, raw, seqs, constrained, staging)
        tokens = ops.argmax(logits)
        sampled = np.flatnonzero(~rows.greedy)
        if sampled.size:
            index = staging.put("sample_rows", sampled, torch.int64)
            drawn = sample_rows(logits.index_select(0, index), rows, sampled, staging)
            tokens = tokens.index_copy(0, index, drawn)
        want = np.flatnonzero(rows.logprobs >= 0)
        if not want.size:
            return Sampled(tokens, tokens, len(seqs))
        packed = torch.cat([tokens.double(), top_logprobs(raw, tokens, want, rows, staging)])
        return Sampled(tokens, packed, len(seqs), want, rows.logprobs)

    @staticmethod
    def collect(sampled: Sampled, host: np.ndarray) -> tuple[list[int], list[dict[int, float] | None]]:
        """The fetched values of a sample() -> token ids, and logprobs where asked."""
        if sampled.want is None:
            return host.tolist(), [None] * sampled.num_rows
        return _unpack(host, sampled.num_rows, sampled.want, sampled.asked)

    def _apply_grammars(self, logits: torch.Tensor, raw: torch.Tensor, seqs: list[Sequence],
                        rows: np.ndarray, staging: Staging) -> torch.Tensor:
        """-inf on every token the grammar of a constrained row refuses next (rows `rows`); the raw
        logits (the model's, kept for logprobs) are never changed."""
        if self.structured is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        in_place = logits is not raw or all(s.params.logprobs is None for s in seqs)
        return self.structured.apply(logits, seqs, rows, staging, in_place=in_place)

    def _rows(self, seqs: list[Sequence]) -> _Rows:
        """The step's per-row parameters. They are read from the sequences' parameters only when
        the batch is not the step before's (a decode run keeps its batch for many steps); the
        uniforms follow each row's count of output tokens."""
        if seqs != self._batch:  # element identity: one C-level pass
            params = [s.params for s in seqs]
            self._batch = list(seqs)
            self._static = _Rows(
                greedy=np.array([p.greedy for p in params], dtype=bool),
                temperature=np.array([1.0 if p.greedy else p.temperature for p in params], dtype=np.float32),
                top_k=np.array([max(p.top_k, 0) for p in params], dtype=np.int64),
                top_p=np.array([p.top_p for p in params], dtype=np.float32),
                min_p=np.array([p.min_p for p in params], dtype=np.float32),
                u=np.array([self._seed(s) for s in seqs], dtype=np.uint64),  # the seeds, here
                logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int64),
            )
            self._prompt_lens = np.array([s.num_prompt_tokens for s in seqs], dtype=np.int64)
        counters = np.fromiter(map(len, map(_TOKEN_IDS, seqs)), np.int64, len(seqs)) - self._prompt_lens
        return dataclasses.replace(self._static, u=uniforms(self._static.u, counters.astype(np.uint64)))


_TOKEN_IDS = operator.attrgetter("token_ids")


def sample_rows(logits: torch.Tensor, rows: _Rows, sampled: np.ndarray, staging: Staging) -> torch.Tensor:
    """Draw one token per row of logits (R, V), the rows `sampled` of the step."""
    temp = staging.put("temperature", rows.temperature[sampled], torch.float32)
    logits = logits / temp.unsqueeze(1)
    min_p = rows.min_p[sampled]
    if (min_p > 0).any():  # keep p >= min_p * p_max, i.e. logit >= max logit + log(min_p)
        log_min_p = staging.put("log_min_p", np.log(np.maximum(min_p, 1e-30)) * (min_p > 0)
                                - 1e30 * (min_p <= 0), torch.float32)
        floor = logits.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    top_k, top_p = rows.top_k[sampled], rows.top_p[sampled]
    filtered = (top_k > 0) | (top_p < 1.0)
    if not filtered.any():
        return _inverse_cdf(logits, staging.put("uniforms", rows.u[sampled], torch.float64))
    if filtered.all():
        return _draw_filtered(logits, top_k, top_p, staging.put("uniforms", rows.u[sampled], torch.float64),
                              staging)
    # rows without top-k / top-p draw in vocabulary order, as they would in a batch without filtered
    # rows: a row's token never depends on what else shares its step
    cut = np.flatnonzero(filtered)
    u = staging.put("uniforms", np.concatenate([rows.u[sampled], rows.u[sampled][cut]]), torch.float64)
    tokens = _inverse_cdf(logits, u[: len(sampled)])
    index = staging.put("filtered_rows", cut, torch.int64)
    drawn = _draw_filtered(logits.index_select(0, index), top_k[cut], top_p[cut], u[len(sampled):], staging)
    return tokens.index_copy(0, index, drawn)


def _draw_filtered(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray, u: torch.Tensor,
                   staging: Staging) -> torch.Tensor:
    """Rows cut by top-k or top-p draw from their candidates in descending order: top-k rows from
    the k_max largest (a partial sort), the others from a full sort."""
    vocab = logits.shape[1]
    k_max = int(top_k.max()) if (top_k > 0).all() else vocab
    values, order = (logits.topk(min(k_max, vocab), dim=-1) if k_max < vocab
                     else logits.sort(dim=-1, descending=True))
    k = staging.put("top_k", np.where(top_k > 0, top_k, vocab), torch.int64)
    p = staging.put("top_p", top_p, torch.float32)
    ranks = torch.arange(values.shape[1], device=values.device)
    values = values.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    values = values.masked_fill(mass_before >= p.unsqueeze(1), float("-inf"))  # keeps the top token
    return order.gather(1, _inverse_cdf(values, u).unsqueeze(1)).squeeze(1)


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index per row where the cumulative probability first exceeds u * total (-inf logits never)."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)  # (R, V)
    target = (u.unsqueeze(1) * cdf[:, -1:].double()).to(cdf.dtype)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return picked.clamp_(max=logits.shape[1] - 1)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], staging: Staging) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties,
    with vLLM's / OpenAI's rules, for the rows that ask for them; other rows are untouched."""
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    vocab = logits.shape[1]
    out_counts = _token_counts([seqs[i].output_token_ids for i in rows], vocab, logits.device, staging, "out")
    in_prompt = _token_counts([seqs[i].prompt_token_ids for i in rows], vocab, logits.device, staging,
                              "prompt") > 0
    params = np.array([[seqs[i].params.repetition_penalty, seqs[i].params.frequency_penalty,
                        seqs[i].params.presence_penalty] for i in rows], dtype=np.float32)
    rep, freq, pres = staging.put("penalties", params, torch.float32).view(-1, 3).unbind(1)
    index = staging.put("penalty_rows", rows, torch.int64)
    sub = logits.index_select(0, index)
    seen = in_prompt | (out_counts > 0)
    rep = rep.unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq.unsqueeze(1) * out_counts - pres.unsqueeze(1) * (out_counts > 0)
    return logits.index_copy(0, index, sub)


def _token_counts(token_lists: list[list[int]], vocab: int, device, staging: Staging,
                  name: str) -> torch.Tensor:
    """(R, V) float32 occurrences of each token id in each row's list, built on the device."""
    width = max((len(t) for t in token_lists), default=0) + 1
    padded = np.full((len(token_lists), width), vocab, dtype=np.int64)  # id `vocab`: padding
    for r, tokens in enumerate(token_lists):
        padded[r, : len(tokens)] = tokens
    ids = staging.put(f"{name}_tokens", padded, torch.int64).view(len(token_lists), width)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def top_logprobs(raw: torch.Tensor, tokens: torch.Tensor, want: np.ndarray, rows: _Rows,
                 staging: Staging) -> torch.Tensor:
    """Flat float64 [chosen logprob (R) | top-N values (R x N) | top-N ids (R x N)] for rows `want`."""
    n = max(int(rows.logprobs[want].max()), 1)
    index = staging.put("logprob_rows", want, torch.int64)
    logp = raw.index_select(0, index).log_softmax(dim=-1)
    top_v, top_i = logp.topk(n, dim=-1)
    chosen = logp.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1)
    return torch.cat([chosen.double(), top_v.double().flatten(), top_i.double().flatten()])


def _unpack(host: np.ndarray, num_rows: int, want: np.ndarray, asked: np.ndarray
            ) -> tuple[list[int], list[dict[int, float] | None]]:
    tokens = host[:num_rows].astype(np.int64).tolist()
    r = len(want)
    n = (len(host) - num_rows - r) // (2 * r)
    chosen = host[num_rows: num_rows + r].tolist()
    top_v = host[num_rows + r: num_rows + r + r * n].reshape(r, n)
    top_i = host[num_rows + r + r * n:].reshape(r, n).astype(np.int64)
    out: list[dict[int, float] | None] = [None] * num_rows
    for j, i in enumerate(want.tolist()):
        k = int(asked[i])
        entry = dict(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist(), strict=True))
        entry[tokens[i]] = chosen[j]
        out[i] = entry
    return tokens, out
