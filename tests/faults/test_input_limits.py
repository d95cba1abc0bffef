"""Issue 35 items 5-8: input that is huge, badly encoded or absurdly nested is refused on the right line,
in bounded memory; a long prompt never holds the GIL in a tokenizer; a grammar that completes on the
last allowed token is `stop`; a max_tokens past the context is clamped, and the value in force is
recorded."""

from __future__ import annotations

import itertools
import json
import threading
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from engine import LLM, SamplingParams
from engine.loader import tiny_random_checkpoint
from engine.tokenizer import Tokenizer
from jobs.broker import resolve_broker
from jobs.input_contract import MAX_CELL_BYTES, MAX_JSON_DEPTH, InputError
from jobs.submit import JobRequest, prepare_job
from tests.jobs.helpers import MODEL


def _prepare(tmp_path: Path, src: Path):
    req = JobRequest(str(src), str(tmp_path / "data"), {"model": MODEL}, {"max_tokens": 4}, 100,
                     apply_chat_template="never")
    return prepare_job(req, resolve_broker(tmp_path / "data", embedded=True))


def _refused(tmp_path: Path, src: Path) -> str:
    with pytest.raises(InputError) as refused:
        _prepare(tmp_path, src)
    return str(refused.value)


def _lines(path: Path, *lines: bytes) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _row(i: int) -> bytes:
    return json.dumps({"id": i, "prompt": f"row {i}"}).encode()


def _nested(depth: int) -> str:
    """JSON text of objects nested `depth` deep (built as text: json.dumps itself recurses)."""
    return '{"a": ' * depth + '"x"' + "}" * depth


# ---------------------------------------------------------------- item 5: size


def test_a_huge_jsonl_line_is_refused_with_its_line_number_in_bounded_memory(tmp_path):
    src = tmp_path / "in.jsonl"
    with open(src, "wb") as out:
        for i in range(1, 4):
            out.write(_row(i) + b"\n")
        out.write(b'{"id": 4, "prompt": "' + b"x" * (6 * MAX_CELL_BYTES) + b'"}\n')  # 96 MiB
        out.write(_row(5) + b"\n")
    tracemalloc.start()
    try:
        message = _refused(tmp_path, src)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message == (f"{src} line 4: longer than {MAX_CELL_BYTES >> 20} MiB, the most a line may hold (a "
                       "prompt that long is past any model's context)")
    assert peak < 2 * MAX_CELL_BYTES + (8 << 20), f"peak {peak >> 20} MiB: the line was read whole"


def test_a_line_at_the_limit_is_read(tmp_path):
    padding = MAX_CELL_BYTES - len(b'{"id": 1, "prompt": ""}')
    src = _lines(tmp_path / "in.jsonl", b'{"id": 1, "prompt": "' + b"y" * padding + b'"}', _row(2))
    assert _prepare(tmp_path, src).num_requests == 2


def test_a_huge_parquet_cell_is_refused_naming_its_row_and_column(tmp_path):
    src = tmp_path / "in.parquet"
    prompts = [f"row {i}" for i in range(10)]
    prompts[7] = "z" * (MAX_CELL_BYTES + 1)
    pq.write_table(pa.table({"prompt": prompts}), src)
    assert _refused(tmp_path, src) == (f"{src} row 7: column 'prompt' holds 16.0 MiB; a cell may hold at "
                                       f"most {MAX_CELL_BYTES >> 20} MiB")


def test_a_huge_messages_cell_is_refused_too(tmp_path):
    src = tmp_path / "in.parquet"
    messages = [[{"role": "user", "content": f"row {i}"}] for i in range(6)]
    messages[2] = [{"role": "user", "content": "w" * (MAX_CELL_BYTES // 2)}] * 3
    pq.write_table(pa.table({"messages": messages}), src)
    assert _refused(tmp_path, src).startswith(f"{src} row 2: column 'messages' holds 24.0 MiB")


def test_a_prompt_past_any_context_is_refused_without_tokenizing_it(monkeypatch):
    """Tokenizing holds the GIL (3 s for 3 MB of SmolLM2 text, measured): a 50 MB prompt starved the
    worker's heartbeat thread into a false "attempt 1 is dead". The engine refuses a text that
    cannot fit max_model_len whatever its tokens before its tokenizer sees it."""
    llm = LLM("tiny-random", checkpoint=tiny_random_checkpoint(), max_model_len=64, max_num_seqs=2)
    seen = []
    encode = llm.tokenizer.encode

    def counting(text, *args, **kwargs):
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", counting)
    [huge, chat, fine] = _generate(llm)
    assert huge.error.startswith("prompt has 5000000 characters, so at least 5000000 tokens; max_model_len "
                                 "is 64 (it was refused without tokenizing it)"), huge.error
    assert huge.finish_reason == "error"
    assert chat.finish_reason == "error" and "refused without tokenizing it" in chat.error
    assert fine.finish_reason == "length" and len(fine.token_ids) == 2
    assert max(seen) < 100, "only the short prompt was tokenized"


def test_tokenizing_a_long_prompt_lets_the_other_threads_run():
    """A prompt that fits is tokenized with the GIL released: a thread ticking beside it (as the lease
    heartbeat does) keeps ticking. (With the GIL held, as `tokenizers`' encode holds it, it cannot.)"""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(models.BPE(vocab={**{c: i for i, c in enumerate(alphabet)}, "</s>": 256},
                                              merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = Tokenizer(backend, eos_token="</s>")
    text = "a few words, and more. " * 8000
    ticks, stop = [], threading.Event()

    def heartbeat():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    beside = threading.Thread(target=heartbeat)
    beside.start()
    time.sleep(0.05)
    try:
        start = time.monotonic()
        ids = tokenizer.encode(text)
        end = time.monotonic()
    finally:
        stop.set()
        beside.join()
    assert ids == backend.encode(text).ids  # the same tokens
    # no stretch of the call without a tick (held, the GIL would leave one gap nearly as long as the call)
    seen = [start] + [t for t in ticks if start < t < end] + [end]
    assert max(b - a for a, b in itertools.pairwise(seen)) < (end - start) / 2


def _generate(llm):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    chat = [{"role": "user", "content": "y" * 3_000_000}]
    ids = [llm.engine.add_request("huge", "x" * 5_000_000, params),
           llm.engine.add_request("chat", None, params, messages=chat),
           llm.engine.add_request("fine", "hello", params)]
    done = {}
    while llm.engine.has_unfinished_requests() or len(done) < len(ids):
        for out in llm.engine.step():
            done[out.request_id] = out
    return [done[i] for i in ids]


# ---------------------------------------------------------------- item 6: encoding, nesting


def test_invalid_utf8_is_reported_on_its_own_line(tmp_path):
    bad = b'{"id": 1001, "prompt": "\xff"}'
    many = _lines(tmp_path / "many.jsonl", *[_row(i) for i in range(1, 1001)], bad)
    expected = f"{many} line 1001: not UTF-8 text (invalid start byte at byte 25 of the line)"
    assert _refused(tmp_path, many) == expected
    few = _lines(tmp_path / "few.jsonl", _row(1), _row(2), b'{"id": 3, "prompt": "caf\xc3"}')
    assert _refused(tmp_path, few).startswith(f"{few} line 3: not UTF-8 text")


def test_json_nested_past_the_limit_names_its_line(tmp_path):
    too_deep_to_parse = '{"prompt": "p", "meta": ' + _nested(3000) + "}"
    src = _lines(tmp_path / "deep.jsonl", _row(1), too_deep_to_parse.encode())
    assert _refused(tmp_path, src) == f"{src} line 2: JSON nested deeper than {MAX_JSON_DEPTH} levels"
    parses = '{"prompt": "p", "response_format": {"type": "json_object", "x": ' + _nested(500) + "}}"
    src = _lines(tmp_path / "deep2.jsonl", _row(1), _row(2), parses.encode())
    assert _refused(tmp_path, src) == f"{src} line 3: JSON nested 502 levels deep; at most {MAX_JSON_DEPTH}"


def test_a_response_format_schema_nested_3000_deep_in_parquet_names_its_row(tmp_path):
    schema = '{"type": "json_schema", "json_schema": {"schema": ' + _nested(3000) + "}}"
    src = tmp_path / "in.parquet"
    formats = [None, None, schema]
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "response_format": formats}), src)
    assert _refused(tmp_path, src) == (f"{src} row 2: response_format is JSON nested deeper than "
                                       f"{MAX_JSON_DEPTH} levels")


# ---------------------------------------------------------------- items 7, 8: the engine's limits


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", checkpoint=tiny_random_checkpoint(), max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=128, block_size=8, num_kv_blocks=64)


def test_a_grammar_completed_on_the_last_allowed_token_is_stop(llm):
    """`ab` is two byte tokens: the choice is whole at max_tokens=2, only the stop token is missing."""
    [whole, cut] = llm.generate(["pick", "pick"], [
        SamplingParams(max_tokens=2, temperature=0.0, guided_choice=["ab"]),
        SamplingParams(max_tokens=1, temperature=0.0, guided_choice=["ab"])])
    assert (whole.text, whole.finish_reason, whole.error) == ("ab", "stop", None)
    assert cut.finish_reason == "length" and "the output is incomplete" in cut.error


def test_max_tokens_past_the_context_is_clamped_and_the_value_in_force_recorded(llm):
    [out] = llm.generate(["hello"], SamplingParams(max_tokens=10**9, temperature=0.0, ignore_eos=True))
    room = 64 - len(out.prompt_token_ids)
    assert out.finish_reason == "length" and len(out.token_ids) == room
    assert out.metrics.max_tokens == room and out.metrics.as_row()["max_tokens"] == room
    [small] = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert small.metrics.max_tokens == 3
