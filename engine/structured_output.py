"""Structured output: a grammar per constrained request, its token mask applied in the sampler.

A request asks for JSON (`response_format` in OpenAI's shapes), text matching a regex
(`guided_regex`) or one of a list of strings (`guided_choice`); `SamplingParams.constraint` turns
that into a `Constraint`, a hashable (kind, canonical source) pair. Grammars come from xgrammar,
imported on first use only: an engine whose requests ask for none never loads it and pays nothing.

`StructuredOutputs` is the engine's side: one compiled grammar per distinct constraint (compiled
once for this tokenizer, cached), one matcher per constrained sequence. Each step it fills the
token bitmasks of the step's constrained rows into one staged buffer (one upload), and after
sampling advances each matcher by the chosen token. A matcher is always in step with its
sequence's output tokens: one that is not (a token not accepted after a failed step, or any
rollback of the output) is rebuilt from those tokens before its next mask.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch only where masks are applied: job validation and the store import this module
    import torch

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
MAX_COMPILED = 1024  # compiled grammars kept (a job with a schema per row must not grow without bound)


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match; equal constraints share one compiled grammar."""

    kind: str  # json_object | json_schema | regex | choice
    source: str  # compact JSON of the schema or the choices, the regex; "" for json_object

    def describe(self) -> str:
        return {"json_object": "JSON object", "json_schema": "JSON", "regex": "regex match",
                "choice": "choice"}[self.kind]


def constraint_from(response_format: dict | None = None, guided_regex: str | None = None,
                    guided_choice: list[str] | None = None) -> Constraint | None:
    """The constraint of a request's fields (at most one may be set); ValueError naming the field."""
    given = [name for name, v in (("response_format", response_format), ("guided_regex", guided_regex),
                                  ("guided_choice", guided_choice)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} are both set; a request takes one constraint")
    if response_format is not None:
        return _from_response_format(response_format)
    if guided_regex is not None:
        if not isinstance(guided_regex, str) or not guided_regex:
            raise ValueError(f"guided_regex must be a non-empty string, got {guided_regex!r}")
        return Constraint("regex", guided_regex)
    if guided_choice is not None:
        ok = isinstance(guided_choice, list | tuple) and guided_choice \
            and all(isinstance(c, str) and c for c in guided_choice)
        if not ok:
            raise ValueError("guided_choice must be a non-empty list of non-empty strings, "
                             f"got {guided_choice!r}")
        return Constraint("choice", json.dumps(list(guided_choice), ensure_ascii=False))
    return None


def _from_response_format(rf) -> Constraint | None:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError("response_format must be an object with type one of "
                         f"{', '.join(RESPONSE_FORMAT_TYPES)}, got {_short(rf)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "")
    spec = rf.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError('response_format of type json_schema needs "json_schema": {"schema": {...}} '
                         f"(an object), got {_short(rf)}")
    # compact but in the given key order: properties are generated in the schema's order
    return Constraint("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def _short(value, limit: int = 120) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@lru_cache(maxsize=256)
def grammar(constraint: Constraint):
    """The xgrammar Grammar of a constraint; ValueError (one line) if the schema or regex is refused."""
    import xgrammar as xgr

    try:
        if constraint.kind == "json_object":  # OpenAI's JSON mode: any object (not an array)
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
        if constraint.kind == "json_schema":
            return xgr.Grammar.from_json_schema(constraint.source, any_whitespace=False)
        if constraint.kind == "regex":
            return xgr.Grammar.from_regex(constraint.source)
        choices = json.loads(constraint.source)
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in choices))
    except RuntimeError as exc:
        raise ValueError(f"{constraint.describe()} constraint refused: {_xgrammar_message(exc)}") from None


def check(constraint: Constraint | None) -> None:
    """Raise ValueError if the constraint's schema/regex cannot be turned into a grammar."""
    if constraint is not None:
        grammar(constraint)


def _ebnf_string(text: str) -> str:
    """An EBNF string literal of `text` (xgrammar reads C-style escapes, \\uXXXX among them)."""
    return json.dumps(text, ensure_ascii=True)


def _xgrammar_message(exc: Exception) -> str:
    """xgrammar's message without its '[time] file.cc:line:' prefix."""
    line = next((ln for ln in str(exc).strip().splitlines() if ln.strip()), repr(exc))
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of our tokenizer (`Tokenizer` or `ByteTokenizer`), built from its vocabulary
    (no hub access): one entry per logit, special tokens as "" (xgrammar never emits those
    inside text; the eos ids end the grammar)."""
    import xgrammar as xgr

    from engine.tokenizer import ByteTokenizer

    encoded: list[str | bytes] = [""] * vocab_size
    stop = sorted(t for t in tokenizer.eos_token_ids if t < vocab_size)
    if isinstance(tokenizer, ByteTokenizer):
        encoded[:256] = [bytes([i]) for i in range(256)]
        return xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
    backend = tokenizer.backend
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            encoded[i] = text
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stop,
                             add_prefix_space=meta["add_prefix_space"])


class StructuredOutputs:
    """Compiled grammars (one per distinct constraint) and one matcher per constrained sequence."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words of one row's bitmask
        self._compiler = None
        self._compiled: dict[Constraint, object] = {}
        self._matchers: dict[int, tuple[object, int]] = {}  # seq_index -> (matcher, tokens accepted)
        self.mask_fill_s = 0.0  # time spent filling masks since the engine last read it

    def prepare(self, constraint: Constraint) -> None:
        """Compile the constraint's grammar for this tokenizer (once); ValueError if refused."""
        self._compiled_grammar(constraint)

    def _compiled_grammar(self, constraint: Constraint):
        """The compiled grammar, from the cache or compiled now (the oldest dropped past MAX_COMPILED;
        live matchers keep theirs)."""
        compiled = self._compiled.get(constraint)
        if compiled is not None:
            return compiled
        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        if self._compiler is None:
            import xgrammar as xgr

            # our cache is the one cache (xgrammar's own is unbounded by default)
            self._compiler = xgr.GrammarCompiler(tokenizer_info(self.tokenizer, self.vocab_size),
                                                 cache_enabled=False)
        compiled = self._compiled[constraint] = self._compiler.compile_grammar(grammar(constraint))
        if len(self._compiled) > MAX_COMPILED:
            del self._compiled[next(iter(self._compiled))]
        return compiled

    def release(self, seq) -> None:
        self._matchers.pop(seq.seq_index, None)

    def _matcher(self, seq, num_tokens: int):
        """The sequence's matcher over its first `num_tokens` output tokens, rebuilt from them if it is
        out of step (a token not accepted after a failed step, a rollback of the output)."""
        matcher, accepted = self._matchers.get(seq.seq_index, (None, -1))
        if accepted != num_tokens:
            import xgrammar as xgr

            matcher = xgr.GrammarMatcher(self._compiled_grammar(seq.params.constraint))
            for token in seq.output_token_ids[:num_tokens]:
                if not matcher.accept_token(token):
                    raise ValueError(f"output token {token} does not match the grammar")
            self._matchers[seq.seq_index] = (matcher, num_tokens)
        return matcher

    def apply(self, logits: torch.Tensor, seqs, rows: np.ndarray, staging, *, in_place: bool) -> torch.Tensor:
        """-inf on every token the grammar of a constrained row (rows `rows` of `logits`) refuses next.

        The masks of the step's constrained rows go into one host buffer (row i for sequence i).
        On CPU xgrammar's kernel applies them to the logits (in place when `in_place`, else to a
        copy); elsewhere they go up in one copy and are applied as one batched torch op."""
        import torch

        t0 = time.perf_counter()
        num_rows = logits.shape[0]
        host = staging.buffer("grammar_bitmask", num_rows * self.words, torch.int32)
        bitmask = torch.from_numpy(host[: num_rows * self.words]).view(num_rows, self.words)
        # one row after another: a fill costs microseconds (8 SmolLM2 rows inside a JSON string:
        # 0.06 ms), and xgrammar's threaded BatchGrammarMatcher took 1.4 ms for them on 2 busy cores
        for i in rows.tolist():
            self._matcher(seqs[i], seqs[i].num_output_tokens).fill_next_token_bitmask(bitmask, i)
        self.mask_fill_s += time.perf_counter() - t0
        if logits.device.type == "cpu":
            return apply_bitmask_cpu(logits if in_place else logits.clone(), bitmask, rows)
        words = staging.upload("grammar_bitmask", num_rows * self.words).view(num_rows, self.words)
        return apply_bitmask(logits, words, staging.put("grammar_rows", rows, torch.int64))

    def accept(self, seq, token: int) -> bool:
        """Advance the sequence's matcher by its newest token (already appended to the sequence);
        False if the grammar refuses it."""
        matcher = self._matcher(seq, seq.num_output_tokens - 1)
        if not matcher.accept_token(token):
            return False
        self._matchers[seq.seq_index] = (matcher, seq.num_output_tokens)
        return True

    def is_terminated(self, seq) -> bool:
        entry = self._matchers.get(seq.seq_index)
        return entry is not None and entry[0].is_terminated()

    def is_completed(self, seq) -> bool:
        """The output so far is a whole match of the grammar (only its stop token is still to come)."""
        entry = self._matchers.get(seq.seq_index)
        return entry is not None and entry[0].is_completed()


def apply_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """xgrammar's CPU kernel, in place on rows `rows` (3-4x the torch ops below on CPU)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows.tolist())
    return logits


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of logits (S, V) masked by their bitmask rows of words (S, W), as torch ops on
    any device; a new tensor."""
    allowed = unpack_bitmask(words.index_select(0, index), logits.shape[1])  # (R, V)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 bitmask (bit b of word w = token 32w + b) -> (R, vocab_size) bool."""
    import torch

    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # (R, W, 32)
    return bits.view(words.shape[0], -1)[:, :vocab_size].bool()
