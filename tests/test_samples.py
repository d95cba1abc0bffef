"""The committed sample prompt sets in data/samples/: sources, Parquet files, README and build script."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "data" / "samples"
README = ROOT / "data" / "README.md"


@pytest.fixture(scope="module")
def build():
    """data/samples/build.py, imported by path (data/ is not a package)."""
    spec = importlib.util.spec_from_file_location("samples_build", SAMPLES / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_jsonl(name: str) -> list[dict]:
    with (SAMPLES / name).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def readme_category_counts() -> dict[str, tuple[int, int]]:
    """category -> (prompts.jsonl count, chat.jsonl count), from the README's Categories table."""
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+) \|", README.read_text(encoding="utf-8"), re.M)
    assert rows, "data/README.md has no category table"
    return {name: (int(n_prompts), int(n_chat)) for name, n_prompts, n_chat in rows}


SAMPLE_FILES = ["prompts.jsonl", "prompts.parquet", "chat.jsonl", "chat.parquet", "build.py"]


@pytest.mark.parametrize("name", SAMPLE_FILES)
def test_sample_files_exist(name):
    assert (SAMPLES / name).is_file()


def test_prompts_parquet_matches_jsonl_exactly():
    table = pq.read_table(SAMPLES / "prompts.parquet")
    assert table.schema.names == ["id", "category", "prompt", "max_tokens"]
    assert [f.type for f in table.schema] == [pa.string(), pa.string(), pa.string(), pa.int32()]
    assert [f.nullable for f in table.schema] == [False, False, False, True]
    expected = [{**row, "max_tokens": row.get("max_tokens")} for row in read_jsonl("prompts.jsonl")]
    assert table.to_pylist() == expected


def test_chat_parquet_matches_jsonl_exactly():
    table = pq.read_table(SAMPLES / "chat.parquet")
    assert table.schema.names == ["id", "category", "messages"]
    messages_type = table.schema.field("messages").type
    assert pa.types.is_list(messages_type)
    assert messages_type.value_type == pa.struct([("role", pa.string()), ("content", pa.string())])
    assert table.to_pylist() == read_jsonl("chat.jsonl")


def test_counts_and_unique_ids():
    prompts, chat = read_jsonl("prompts.jsonl"), read_jsonl("chat.jsonl")
    assert 300 <= len(prompts) <= 400
    assert len(chat) == 40
    for rows, pattern in ((prompts, r"p\d{4}"), (chat, r"c\d{3}")):
        ids = [row["id"] for row in rows]
        assert len(set(ids)) == len(ids), [i for i, n in Counter(ids).items() if n > 1]
        assert all(re.fullmatch(pattern, i) for i in ids)


def test_every_prompt_and_message_is_non_empty():
    for row in read_jsonl("prompts.jsonl"):
        assert row["prompt"].strip(), row["id"]
    for row in read_jsonl("chat.jsonl"):
        assert row["messages"], row["id"]
        for message in row["messages"]:
            assert message["content"].strip(), row["id"]


def test_chat_turns_are_well_formed():
    rows = read_jsonl("chat.jsonl")
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert set(roles) <= {"system", "user", "assistant"}, row["id"]
        assert "system" not in roles[1:], row["id"]
        assert roles[-1] == "user", row["id"]
    assert sum(m["messages"][0]["role"] == "system" for m in rows) >= 5
    assert sum(any(x["role"] == "assistant" for x in m["messages"]) for m in rows) >= 5


def test_max_tokens_sized_and_omitted_on_about_a_third():
    rows = read_jsonl("prompts.jsonl")
    given = [row["max_tokens"] for row in rows if "max_tokens" in row]
    assert all(type(n) is int and 16 <= n <= 256 for n in given)
    assert 0.25 <= 1 - len(given) / len(rows) <= 0.40


def test_prompt_lengths_vary_from_a_few_words_to_long_texts():
    lengths = sorted(len(row["prompt"].split()) for row in read_jsonl("prompts.jsonl"))
    assert lengths[0] <= 3
    assert sum(n >= 600 for n in lengths) >= 5
    assert lengths[-1] <= 1600


def test_categories_are_as_documented(build):
    documented = readme_category_counts()
    prompts = Counter(row["category"] for row in read_jsonl("prompts.jsonl"))
    chat = Counter(row["category"] for row in read_jsonl("chat.jsonl"))
    assert set(documented) == set(build.CHAT_CATEGORIES) == set(build.PROMPT_CATEGORIES) | set(chat)
    assert set(prompts) <= set(build.PROMPT_CATEGORIES)
    assert documented == {name: (prompts[name], chat[name]) for name in documented}
    total = re.search(r"^\| \*\*total\*\* \| (\d+) \| (\d+) \|", README.read_text(encoding="utf-8"), re.M)
    assert total and (int(total[1]), int(total[2])) == (sum(prompts.values()), sum(chat.values()))


def test_build_is_deterministic(build, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    build.build(SAMPLES, first)
    build.build(SAMPLES, second)
    for name in ("prompts.parquet", "chat.parquet"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
        rebuilt, committed = pq.read_table(first / name), pq.read_table(SAMPLES / name)
        assert rebuilt.equals(committed), f"{name} is stale: run python data/samples/build.py"
    assert sorted(p.name for p in first.iterdir()) == ["chat.parquet", "prompts.parquet"]


GOOD_PROMPT = '{"id": "p0001", "category": "factual", "prompt": "Why is the sky blue?"}'


@pytest.mark.parametrize(
    ("second_line", "message"),
    [
        ('{"id": "p0001", "category": "math", "prompt": "2 + 2?"}', "duplicate id 'p0001'"),
        ('{"id": "p0002", "category": "factual", "prompt": "   "}', "'prompt' is empty"),
        ('{"id": "p0002", "category": "poetry", "prompt": "A poem"}', "category 'poetry'"),
        ('{"id": "p0002", "category": "math", "prompt": "1+1", "max_tokens": true}', "'max_tokens'"),
        ('{"id": "p0002", "category": "math", "prompt": "1+1", "max_tokens": 0}', "must be >= 1"),
        ('{"id": "p0002", "category": "math"}', "missing field(s) ['prompt']"),
        ('{"id": "p0002", "category": "math", "prompt": "1+1", "temp": 0}', "unknown field(s) ['temp']"),
        ('{"id": "p0002", "category": "math", "prompt": "1+1"', "not valid JSON"),
    ],
)
def test_build_names_the_bad_prompt_row(build, tmp_path, second_line, message):
    (tmp_path / "prompts.jsonl").write_text(f"{GOOD_PROMPT}\n{second_line}\n", encoding="utf-8")
    shutil.copy(SAMPLES / "chat.jsonl", tmp_path / "chat.jsonl")
    with pytest.raises(build.SampleError) as info:
        build.build(tmp_path, tmp_path / "out")
    assert "prompts.jsonl line 2" in str(info.value)
    assert message in str(info.value)
    assert not (tmp_path / "out").exists()  # nothing is written when any row is bad


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "last message"),
        ([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief"},
          {"role": "user", "content": "Hi"}], "messages[1]: a system message may only come first"),
        ([{"role": "bot", "content": "Hi"}], "messages[0]: role 'bot'"),
        ([{"role": "user", "content": ""}], "messages[0]: field 'content' is empty"),
        ([], "'messages' must be a non-empty list"),
    ],
)
def test_build_names_the_bad_chat_row(build, tmp_path, messages, message):
    shutil.copy(SAMPLES / "prompts.jsonl", tmp_path / "prompts.jsonl")
    row = {"id": "c001", "category": "conversation", "messages": messages}
    (tmp_path / "chat.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(build.SampleError, match="chat.jsonl line 1") as info:
        build.build(tmp_path, tmp_path / "out")
    assert message in str(info.value)


def test_build_cli_writes_and_reports_errors(build, tmp_path, capsys):
    assert build.main(["--out-dir", str(tmp_path / "out")]) == 0
    assert f"prompts.parquet ({len(read_jsonl('prompts.jsonl'))} rows)" in capsys.readouterr().out
    (tmp_path / "prompts.jsonl").write_text('{"id": "p1"}\n', encoding="utf-8")
    assert build.main(["--src-dir", str(tmp_path)]) == 1
    assert "prompts.jsonl line 1: missing field(s)" in capsys.readouterr().err
