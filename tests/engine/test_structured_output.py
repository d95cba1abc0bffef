"""Structured output: grammar masks in the sampler, on the tiny random model (ByteTokenizer).

The random model has no idea of JSON; the mask alone makes its output match the schema, so every
finished output must parse and validate.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import tiny_random_checkpoint
from engine.staging import Staging
from engine.structured_output import (
    Constraint,
    StructuredOutputs,
    apply_bitmask,
    apply_bitmask_cpu,
    check,
    tokenizer_info,
    unpack_bitmask,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {"type": "object", "required": ["id", "ok"],
                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                 "ok": {"type": "boolean"}}},
        "nick": {"type": "string", "pattern": "^[A-Z]{2}$"},  # optional
    },
    "required": ["name", "kind", "age", "score", "tags", "owner"],
}
POINTS = {"type": "array", "minItems": 1, "maxItems": 2,
          "items": {"type": "object", "required": ["x", "y"],
                    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                   "y": {"enum": [True, None, "up"]}}}}
ROOMY = dict(max_num_seqs=8, max_num_batched_tokens=256, block_size=8, num_kv_blocks=256)


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


@pytest.fixture(scope="module")
def ckpt():
    return tiny_random_checkpoint()


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM("tiny-random", checkpoint=ckpt, **ROOMY)


def _constrained(n: int, schema: dict, max_tokens: int = 160) -> list[SamplingParams]:
    """Greedy and seeded rows alike; seeds give different outputs."""
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0 if i == 0 else 1.0, seed=i,
                           response_format=json_schema(schema)) for i in range(n)]


@pytest.mark.parametrize("schema", [PERSON, POINTS], ids=["nested-object", "array-of-objects"])
def test_every_output_parses_and_validates(llm, schema):
    outs = llm.generate(["hello"] * 3, _constrained(3, schema))
    for out in outs:
        assert (out.finish_reason, out.error) == ("stop", None), out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outs}) > 1  # the mask constrains, it does not dictate one output


def test_regex_choice_and_json_object(llm):
    email_regex, choices = r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)", ["yes", "no", "maybe so"]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=1, guided_regex=email_regex),
              SamplingParams(max_tokens=10, guided_choice=choices),
              SamplingParams(max_tokens=10, temperature=1.0, seed=2, guided_choice=choices),
              SamplingParams(max_tokens=200, temperature=1.0, seed=5,
                             response_format={"type": "json_object"}),
              SamplingParams(max_tokens=5, response_format={"type": "text"})]
    email, choice1, choice2, obj, text = llm.generate(["q"] * len(params), params)
    assert email.finish_reason == "stop" and re.fullmatch(email_regex, email.text)
    assert {choice1.text, choice2.text} <= set(choices)
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    assert text.finish_reason == "length" and text.error is None  # type text: no constraint


def test_unconstrained_greedy_rows_unchanged_beside_constrained_rows(ckpt):
    prompts = ["alpha", "beta gamma", "delta", "epsilon zeta eta"]
    plain = [SamplingParams(max_tokens=24, temperature=0.0) for _ in prompts]
    alone = LLM("tiny-random", checkpoint=ckpt, **ROOMY).generate(prompts, plain)
    mixed = LLM("tiny-random", checkpoint=ckpt, **ROOMY).generate(
        prompts + ["x", "y", "z"], plain + _constrained(3, POINTS))
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    for out in mixed[4:]:
        jsonschema.validate(json.loads(out.text), POINTS)


def test_max_tokens_before_the_json_is_complete_is_length_with_an_error(llm):
    out, = llm.generate(["hello"], _constrained(1, PERSON, max_tokens=12))
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert out.error == "max_tokens reached before the JSON output was complete: the output is incomplete"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_a_refused_schema_fails_its_row_only(llm):
    bad = SamplingParams(max_tokens=8, response_format=json_schema({"type": "object",
                                                                    "properties": {"a": {"$ref": "#/nope"}}}))
    outs = llm.generate(["a", "b"], [bad, _constrained(1, POINTS)[0]])
    assert outs[0].finish_reason == "error"
    assert outs[0].error.startswith("JSON constraint refused: ") and "nope" in outs[0].error
    assert outs[1].finish_reason == "stop"


@pytest.mark.parametrize("config", [
    dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=24),  # preempts
    dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=256,
         enable_prefix_caching=True),
], ids=["preempting", "prefix-cache"])
def test_preemption_and_prefix_caching_keep_the_grammar(ckpt, llm, config):
    prompts = ["shared prefix of the rows " + str(i) for i in range(4)]
    params = _constrained(4, POINTS)
    want = llm.generate(prompts, params)
    small = LLM("tiny-random", checkpoint=ckpt, **config)
    got = small.generate(prompts, params)
    assert [o.text for o in got] == [o.text for o in want]
    stats = small.iteration_stats
    if "enable_prefix_caching" in config:
        assert sum(s.prefix_cache_hit_tokens for s in stats) > 0
    else:
        assert sum(s.num_preempted for s in stats) > 0


def test_iteration_stats_count_constrained_rows_and_mask_time(ckpt):
    llm = LLM("tiny-random", checkpoint=ckpt, **ROOMY)
    llm.generate(["a", "b", "c"], [SamplingParams(max_tokens=4)] * 2 + _constrained(1, PERSON, 4))
    first = len(llm.iteration_stats)
    assert [s.num_constrained_seqs for s in llm.iteration_stats] == [1] * first
    assert all(s.mask_fill_s > 0 for s in llm.iteration_stats)
    llm.generate(["a"], SamplingParams(max_tokens=3))
    assert all(s.num_constrained_seqs == 0 and s.mask_fill_s == 0 for s in llm.iteration_stats[first:])


def test_a_matcher_out_of_step_with_its_output_is_rebuilt(ckpt):
    tokenizer = ckpt.tokenizer
    structured = StructuredOutputs(tokenizer, 259)
    params = SamplingParams(guided_choice=["cat", "cow"])
    structured.prepare(params.constraint)
    from engine.sequence import Sequence

    seq = Sequence("r", [1, 2], params)
    staging = Staging(torch.device("cpu"))
    for token in b"co":
        seq.append_token(token)
        assert structured.accept(seq, token)
    assert allowed(structured, seq, staging) == [ord("w")]
    seq.token_ids.pop()  # the output rolled back by one token ("c"): the matcher follows it
    assert allowed(structured, seq, staging) == [ord("a"), ord("o")]
    seq.append_token(ord("x"))
    assert not structured.accept(seq, ord("x"))


def allowed(structured, seq, staging) -> list[int]:
    logits = structured.apply(torch.zeros(1, 259), [seq], np.array([0]), staging, in_place=True)
    return torch.nonzero(logits[0] == 0).flatten().tolist()


def test_unpack_bitmask_matches_xgrammar():
    import xgrammar as xgr

    rng = np.random.default_rng(0)
    words = torch.from_numpy(rng.integers(-(1 << 31), 1 << 31, size=(3, 5), dtype=np.int64).astype(np.int32))
    logits = torch.zeros(3, 150)
    xgr.apply_token_bitmask_inplace(logits, words)
    assert torch.equal(unpack_bitmask(words, 150), logits == 0)


def test_the_device_path_masks_as_the_cpu_kernel_does():
    rng = np.random.default_rng(1)
    words = torch.from_numpy(rng.integers(-(1 << 31), 1 << 31, size=(6, 5), dtype=np.int64).astype(np.int32))
    logits = torch.randn(6, 150, generator=torch.Generator().manual_seed(0))
    rows = np.array([1, 4, 5])
    on_device = apply_bitmask(logits, words, torch.from_numpy(rows))
    assert torch.equal(on_device, apply_bitmask_cpu(logits.clone(), words, rows))
    assert torch.equal(on_device[[0, 2, 3]], logits[[0, 2, 3]])  # other rows untouched
    assert torch.isinf(on_device[rows]).any()


@pytest.mark.parametrize("params, message", [
    (dict(response_format={"type": "json"}), "response_format must be an object with type one of"),
    (dict(response_format={"type": "json_schema"}), 'needs "json_schema": {"schema": {...}}'),
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "response_format and guided_regex"),
    (dict(guided_choice=[]), "guided_choice must be a non-empty list"),
    (dict(guided_regex=""), "guided_regex must be a non-empty string"),
])
def test_sampling_params_refuse_malformed_constraints(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**params)


def test_check_refuses_bad_schemas_and_regexes_with_one_line():
    with pytest.raises(ValueError, match=r"^JSON constraint refused: .*Unsupported type \"bogus\"$"):
        check(Constraint("json_schema", json.dumps({"type": "bogus"})))
    with pytest.raises(ValueError, match=r"^regex match constraint refused: Regex parsing error"):
        check(Constraint("regex", "a("))
    check(None)


def test_smollm2_tokenizer_info_from_our_tokenizer(smollm2_dir):
    import xgrammar as xgr

    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    info = tokenizer_info(tokenizer, tokenizer.vocab_size)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert info.stop_token_ids == sorted(tokenizer.eos_token_ids)
    assert tokenizer.backend.token_to_id("<|im_start|>") in info.special_token_ids
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    text = ('{"name": "bob", "kind": "cat", "age": 3, "score": 1.5, "tags": ["a"], '
            '"owner": {"id": 2, "ok": true}}')
    assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


def test_a_row_whose_grammar_breaks_in_a_step_fails_alone(llm):
    engine = llm.engine
    choices = ["abc", "abd"]
    engine.add_request("bad", "x", SamplingParams(max_tokens=8, guided_choice=choices))
    engine.add_request("good", "y", SamplingParams(max_tokens=8, guided_choice=choices))
    outs = engine.step()
    engine._seqs["bad"].token_ids.append(ord("z"))  # an output the grammar cannot have reached
    while engine.has_unfinished_requests():
        outs += engine.step()
    by_id = {o.request_id: o for o in outs}
    assert by_id["bad"].finish_reason == "error" and "does not match the grammar" in by_id["bad"].error
    assert by_id["good"].finish_reason == "stop" and by_id["good"].text in choices


def test_compiled_grammars_are_cached_per_constraint_and_bounded(ckpt, monkeypatch):
    import engine.structured_output as so

    monkeypatch.setattr(so, "MAX_COMPILED", 2)
    structured = StructuredOutputs(ckpt.tokenizer, 259)
    a, b, c = (SamplingParams(guided_choice=[w]).constraint for w in ("a", "b", "c"))
    structured.prepare(a)
    first = structured._compiled[a]
    structured.prepare(SamplingParams(guided_choice=["a"]).constraint)  # an equal constraint: no compile
    assert structured._compiled[a] is first and len(structured._compiled) == 1
    structured.prepare(b)
    structured.prepare(c)
    assert list(structured._compiled) == [b, c]  # the oldest dropped


def test_logprobs_of_a_constrained_row_are_the_models_own(llm):
    out, = llm.generate(["q"], SamplingParams(max_tokens=10, guided_choice=["yes", "no"], logprobs=3))
    assert out.text in ("yes", "no") and len(out.logprobs) == len(out.token_ids)
    # the masked logits would give -inf to the model's top tokens the grammar refuses
    assert all(np.isfinite(v) for entry in out.logprobs for v in entry.values())
