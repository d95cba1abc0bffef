"""JSONL input (no engine, no broker): OpenAI Batch request lines and plain rows, into shards; every
bad line refused before any work, naming the file, the line and the field."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from jobs.broker import resolve_broker
from jobs.cli import cli
from jobs.input_contract import InputError
from jobs.manifest import REQUEST_ID_COLUMN, URL_COLUMN
from jobs.submit import JobRequest, prepare_job

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def request(custom_id: str, body: dict, url: str = CHAT, **line) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **line}


def chat(custom_id: str, text: str = "hi", **body) -> dict:
    return request(custom_id, {"messages": [{"role": "user", "content": text}], **body})


def write_jsonl(path, *lines) -> str:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def prepare(tmp_path, source, model_given=True, model="tiny-random", **kw):
    data_dir = tmp_path / "data"
    req = JobRequest(str(source), str(data_dir), {"model": model}, {}, 2, model_given=model_given, **kw)
    return prepare_job(req, resolve_broker(data_dir, embedded=True))


def shard_rows(manifest) -> list[dict]:
    return [row for s in manifest.shards for row in pq.read_table(s.path).to_pylist()]


def no_job_left(tmp_path) -> bool:
    jobs = tmp_path / "data" / "jobs"
    return not jobs.exists() or not any(p.name.startswith("job-") for p in jobs.iterdir())


def test_openai_request_lines_become_rows(tmp_path):
    src = write_jsonl(
        tmp_path / "batch.jsonl",
        chat("a", max_completion_tokens=7, temperature=0, seed=3, stop="\n", n=2, logprobs=True,
             top_logprobs=2, presence_penalty=0.5, frequency_penalty=-0.5, top_k=5, min_p=0.1,
             repetition_penalty=1.2, user="u1", metadata={"k": "v"}, stream=False, model="tiny-random"),
        "",  # blank lines are skipped (line numbers still count them)
        request("b", {"prompt": "once", "max_tokens": 4, "logprobs": 3, "model": "tiny-random"}, COMPLETIONS),
        request("c", {"messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "one"},
                                                                {"type": "text", "text": "two"}]}]}),
    )
    m = prepare(tmp_path, src)
    assert (m.input_format, m.num_requests, m.extra_columns, m.model) == ("openai", 3, [], "tiny-random")
    a, b, c = shard_rows(m)
    assert [r[REQUEST_ID_COLUMN] for r in (a, b, c)] == ["a", "b", "c"]
    assert [r[URL_COLUMN] for r in (a, b, c)] == [CHAT, COMPLETIONS, CHAT]
    assert a["messages"] == [{"role": "user", "content": "hi"}] and a["prompt"] is None
    want = {"max_tokens": 7, "temperature": 0.0, "seed": 3, "stop": ["\n"], "n": 2, "logprobs": True,
            "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.2}
    assert {k: a[k] for k in want} == want
    assert (b["prompt"], b["messages"], b["max_tokens"], b["logprobs"], b["top_logprobs"]) == \
        ("once", None, 4, True, 3)  # a completions logprobs count: that many alternatives
    assert c["messages"][1] == {"role": "user", "content": "one\ntwo"}  # text parts joined


def test_body_model_sets_the_job_model_unless_model_is_given(tmp_path):
    src = write_jsonl(tmp_path / "b.jsonl", chat("a", model="tiny-random"), chat("b"))
    assert prepare(tmp_path, src, model_given=False, model="smollm2-135m").model == "tiny-random"
    with pytest.raises(InputError, match=r"b.jsonl line 1: body.model 'tiny-random' differs from --model "
                                         r"'smollm2-135m'"):
        prepare(tmp_path, src, model_given=True, model="smollm2-135m")
    other = write_jsonl(tmp_path / "o.jsonl", chat("a", model="gpt-4o-mini"))
    with pytest.raises(InputError, match=r"o.jsonl line 1: body.model: unknown model 'gpt-4o-mini'"):
        prepare(tmp_path, other, model_given=False)
    plain = write_jsonl(tmp_path / "p.jsonl", {"prompt": "a"})  # no body.model: the (default) --model holds
    with pytest.raises(InputError, match=r"--model: unknown model 'nosuchmodel'"):
        prepare(tmp_path, plain, model_given=False, model="nosuchmodel")
    assert len(list((tmp_path / "data" / "jobs").glob("job-*"))) == 1, "only the first job was made"


def test_plain_jsonl_rows_use_the_parquet_column_names(tmp_path):
    src = write_jsonl(
        tmp_path / "rows.jsonl",
        {"id": 1, "prompt": "a", "topic": "x", "score": 1, "meta": {"k": [1]}, "n": 2},
        {"id": "two", "messages": [{"role": "user", "content": "b"}], "topic": "y", "score": 2.5,
         "logprobs": 4, "max_tokens": 3.0},
    )
    m = prepare(tmp_path, src)
    assert (m.input_format, m.extra_columns) == ("jsonl", ["topic", "score", "meta"])
    rows = shard_rows(m)
    assert [r[REQUEST_ID_COLUMN] for r in rows] == ["1", "two"]
    assert [(r["topic"], r["score"], r["meta"]) for r in rows] == [("x", 1.0, {"k": [1]}), ("y", 2.5, None)]
    assert [(r["n"], r["logprobs"], r["top_logprobs"], r["max_tokens"]) for r in rows] == \
        [(2, None, None, None), (None, True, 4, 3)]
    assert pq.read_table(m.shards[0].path).schema.field("score").type == pa.float64()


def test_keep_prompt_carries_the_prompt_columns(tmp_path):
    src = write_jsonl(tmp_path / "rows.jsonl", {"prompt": "a", "topic": "x"})
    assert prepare(tmp_path, src, keep_prompt=True).extra_columns == ["prompt", "topic"]


BAD_LINES = [
    # (lines, the message's tail after "<file> line N: ")
    ([chat("a"), '{"custom_id": "b", '], "line 2: not JSON"),
    ([chat("a"), "[1, 2]"], "line 2: a line must be a JSON object, got list"),
    ([{"method": "POST", "url": CHAT, "body": {"messages": []}}], "line 1: missing 'custom_id'"),
    ([chat("a"), chat("b"), chat("a")], "line 3: duplicate id 'a' (first used by input row 0)"),
    ([request("a", {"input": "x"}, "/v1/embeddings")], "line 1: url '/v1/embeddings' is not supported"),
    ([chat("a", method="GET") | {"method": "GET"}], "line 1: method must be 'POST', got 'GET'"),
    ([chat("a"), chat("b", n=0)], "line 2: body.n must be an integer in [1, 128], got 0"),
    ([{"prompt": "a", "n": 0}], "line 1: n must be an integer in [1, 128], got 0"),
    ([chat("a"), {"prompt": "plain"}], "line 2: a plain row, but line 1 makes this a file of OpenAI batch"),
    ([{"prompt": "plain"}, chat("a")],
     "line 2: an OpenAI batch request line, but line 1 makes this a file of plain rows"),
    ([chat("a", temperature="hot")], 'line 1: body.temperature must be a number, got "hot"'),
    ([chat("a", n=1.5)], "line 1: body.n must be an integer, got 1.5"),
    ([chat("a", stop=5)], "line 1: body.stop must be a string or a list of strings, got 5"),
    ([{"prompt": "a", "max_tokens": "many"}], 'line 1: max_tokens must be an integer, got "many"'),
    ([{"prompt": "a", "ignore_eos": 1}], "line 1: ignore_eos must be true or false, got 1"),
    ([chat("a", foo=1)], "line 1: body.foo: unrecognized request argument"),
    ([chat("a", tools=[])], "line 1: body.tools is not supported by batchgen"),
    ([chat("a", stream=True)], "line 1: body.stream: batch requests do not stream"),
    ([chat("a", top_logprobs=2)], "line 1: body.top_logprobs needs body.logprobs true"),
    ([request("a", {"prompt": "x", "messages": []}, COMPLETIONS)],
     "line 1: body.messages is not supported on /v1/completions"),
    ([request("a", {"prompt": ["x", "y"]}, COMPLETIONS)], "line 1: body.prompt must be a string on "
                                                           "/v1/completions, got a list"),
    ([request("a", {})], "line 1: body.messages is required on /v1/chat/completions"),
    ([request("a", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})],
     "line 1: body.messages[0].content[0]: type 'image_url' is not supported"),
    ([chat("a", model="tiny-random"), chat("b", model="other")], "line 2: body.model 'other' differs from "
                                                                  "'tiny-random' (line 1)"),
    ([chat("a") | {"extra": 1}], "line 1: unknown key(s) ['extra']"),
    ([{"prompt": "a", "topic": "x"}, {"prompt": "b", "topic": 5}],
     "line 2: key 'topic' holds an integer, but"),
    ([{"prompt": "a", "_bg_row": 1}], "line 1: key '_bg_row' uses the reserved prefix"),
    ([{"prompt": "a", "logprobs": 2, "top_logprobs": 3}], "line 1: logprobs 2 (a count) and top_logprobs 3 "
                                                          "disagree"),
]


@pytest.mark.parametrize("lines, message", BAD_LINES)
def test_bad_lines_are_refused_naming_line_and_field(tmp_path, lines, message):
    src = write_jsonl(tmp_path / "bad.jsonl", *lines)
    with pytest.raises(InputError) as info:
        prepare(tmp_path, src)
    assert f"bad.jsonl {message}" in str(info.value)
    assert no_job_left(tmp_path)


def test_unreadable_empty_and_mixed_inputs(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(InputError, match="empty.jsonl has no rows"):
        prepare(tmp_path, empty)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(InputError, match="latin.jsonl line 1: not UTF-8"):
        prepare(tmp_path, latin)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", {"prompt": "a"})
    pq.write_table(pa.table({"prompt": ["b"]}), mixed / "b.parquet")
    with pytest.raises(InputError, match="mixes Parquet and JSONL files"):
        prepare(tmp_path, mixed)
    both = tmp_path / "both"
    both.mkdir()
    write_jsonl(both / "a.jsonl", {"prompt": "a"})
    write_jsonl(both / "b.jsonl", chat("x"))
    with pytest.raises(InputError, match="b.jsonl: openai input, but the first file is jsonl"):
        prepare(tmp_path, both)
    assert no_job_left(tmp_path)


def test_a_directory_of_jsonl_files_is_one_job(tmp_path):
    d = tmp_path / "many"
    d.mkdir()
    write_jsonl(d / "b.jsonl", chat("x"))
    write_jsonl(d / "a.jsonl", chat("y"), chat("z"))
    m = prepare(tmp_path, d)
    assert [r[REQUEST_ID_COLUMN] for r in shard_rows(m)] == ["y", "z", "x"]
    write_jsonl(d / "c.jsonl", chat("y"))
    with pytest.raises(InputError, match="c.jsonl line 1: duplicate id 'y'"):
        prepare(tmp_path, d)


def test_parquet_n_out_of_range_is_refused(tmp_path):
    src = tmp_path / "n.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "n": [2, 0]}), src)
    with pytest.raises(InputError, match=r"n.parquet row 1: column 'n' must be an integer in \[1, 128\]"):
        prepare(tmp_path, src)


# ---------------------------------------------------------------- the CLI: exit 2, nothing left behind


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("command", ["submit", "run"])
def test_cli_refuses_bad_jsonl_with_exit_2(tmp_path, command):
    src = write_jsonl(tmp_path / "bad.jsonl", chat("a"), chat("a"))
    result = invoke(command, src, "--model", "tiny-random", "--data-dir", str(tmp_path / "data"))
    assert result.exit_code == 2 and "bad.jsonl line 2: duplicate id 'a'" in result.output, result.output
    assert no_job_left(tmp_path)


@pytest.mark.parametrize("command", ["submit", "run"])
def test_cli_refuses_an_unknown_model_with_exit_2_and_no_job(tmp_path, command):
    src = write_jsonl(tmp_path / "ok.jsonl", {"prompt": "a"})
    result = invoke(command, src, "--model", "nosuchmodel", "--data-dir", str(tmp_path / "data"))
    assert result.exit_code == 2 and "--model: unknown model 'nosuchmodel'" in result.output, result.output
    assert no_job_left(tmp_path)
    listing = invoke("status", "--data-dir", str(tmp_path / "data"), "--format", "json")
    assert listing.exit_code == 0 and json.loads(listing.output) == [], listing.output


def test_cli_refuses_an_output_suffix_it_cannot_write(tmp_path):
    src = write_jsonl(tmp_path / "ok.jsonl", {"prompt": "a"})
    result = invoke("run", src, "--model", "tiny-random", "--data-dir", str(tmp_path / "data"),
                    "--output", str(tmp_path / "out.csv"))
    assert result.exit_code == 2 and "give a .parquet or .jsonl file" in result.output, result.output
    assert no_job_left(tmp_path)
    result = invoke("status", "job-x", "--data-dir", str(tmp_path), "--output", str(tmp_path / "out"))
    assert result.exit_code == 2 and "give a .parquet or .jsonl file" in result.output, result.output
