"""Build the sample prompt sets' Parquet files from their JSON Lines sources.

    python data/samples/build.py               # writes prompts.parquet and chat.parquet beside the .jsonl
    python data/samples/build.py --out-dir D   # writes them into D instead

The .jsonl files are the source of truth; the .parquet files are what `batchgen run` reads. Every
row is checked before anything is written (a bad row is an error naming the file, the line and the
field), and the output is deterministic: the same sources give the same tables and, with the same
pyarrow, the same bytes. Each file is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SAMPLES_DIR = Path(__file__).resolve().parent

# task categories of prompts.jsonl (data/README.md lists them with their counts)
PROMPT_CATEGORIES = (
    "factual", "summarize", "long_summarize", "rewrite", "code", "math",
    "classify", "extract", "creative", "list", "translate",
)
# chat.jsonl uses the same task names plus open-ended conversation
CHAT_CATEGORIES = PROMPT_CATEGORIES + ("conversation",)
CHAT_ROLES = ("system", "user", "assistant")

PROMPTS_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("category", pa.string(), nullable=False),
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("max_tokens", pa.int32(), nullable=True),  # null: the job-level default applies
])
# one chat turn; the list's item field is named "element" as Parquet stores it, so a table read
# back from the file equals the one built here
MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
CHAT_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("category", pa.string(), nullable=False),
    pa.field("messages", pa.list_(pa.field("element", MESSAGE_TYPE)), nullable=False),
])

# fixed writer settings: part of what makes the output deterministic
WRITE_OPTIONS = {"compression": "zstd", "compression_level": 9, "row_group_size": 1 << 20}


class SampleError(ValueError):
    """A source row that cannot go into the Parquet file; the message names file, line and field."""


def _where(path: Path, line_no: int) -> str:
    return f"{path.name} line {line_no}"


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"duplicate key(s) {duplicates}")
    return dict(pairs)


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for each non-blank line; malformed JSON is a SampleError."""
    if not path.is_file():
        raise SampleError(f"{path}: no such file")
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_reject_duplicate_keys)
            except ValueError as exc:
                raise SampleError(f"{_where(path, line_no)}: not valid JSON ({exc})") from exc
            if not isinstance(row, dict):
                got = type(row).__name__
                raise SampleError(f"{_where(path, line_no)}: expected a JSON object, got {got}")
            yield line_no, row


def _check_keys(row: dict, required: set[str], optional: set[str], where: str) -> None:
    missing = sorted(required - row.keys())
    if missing:
        raise SampleError(f"{where}: missing field(s) {missing}")
    unknown = sorted(row.keys() - required - optional)
    if unknown:
        raise SampleError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(required | optional)}")


def _check_text(value: object, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise SampleError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise SampleError(f"{where}: field {field!r} is empty")
    return value


def _check_category(value: object, allowed: tuple[str, ...], where: str) -> str:
    category = _check_text(value, "category", where)
    if category not in allowed:
        raise SampleError(f"{where}: category {category!r} is not one of {list(allowed)}")
    return category


def _check_max_tokens(value: object, where: str) -> int:
    # bool is an int subclass in Python; true/false is a mistake here, not a count
    if not isinstance(value, int) or isinstance(value, bool):
        raise SampleError(f"{where}: field 'max_tokens' must be an integer, got {value!r}")
    if not 1 <= value <= 2**31 - 1:
        raise SampleError(f"{where}: field 'max_tokens' must be >= 1 (and fit int32), got {value}")
    return value


def _check_messages(value: object, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise SampleError(f"{where}: field 'messages' must be a non-empty list")
    messages = []
    for i, message in enumerate(value):
        at = f"{where}: messages[{i}]"
        if not isinstance(message, dict):
            raise SampleError(f"{at} must be an object with 'role' and 'content'")
        _check_keys(message, {"role", "content"}, set(), at)
        role = _check_text(message["role"], "role", at)
        if role not in CHAT_ROLES:
            raise SampleError(f"{at}: role {role!r} is not one of {list(CHAT_ROLES)}")
        if role == "system" and i != 0:
            raise SampleError(f"{at}: a system message may only come first")
        messages.append({"role": role, "content": _check_text(message["content"], "content", at)})
    if messages[-1]["role"] != "user":
        raise SampleError(f"{where}: the last message must be from the user (the model answers it)")
    return messages


def _check_unique_id(row: dict, seen: dict[str, int], where: str) -> str:
    row_id = _check_text(row["id"], "id", where)
    if row_id in seen:
        raise SampleError(f"{where}: duplicate id {row_id!r} (first on line {seen[row_id]})")
    return row_id


def _columns(path: Path, required: set[str], optional: set[str],
             convert: Callable[[dict, str], dict]) -> dict[str, list]:
    """Validate every row of one .jsonl file and gather it column by column, in file order."""
    columns: dict[str, list] = {}
    seen: dict[str, int] = {}
    for line_no, row in read_jsonl(path):
        where = _where(path, line_no)
        _check_keys(row, required, optional, where)
        seen[_check_unique_id(row, seen, where)] = line_no
        for name, value in convert(row, where).items():
            columns.setdefault(name, []).append(value)
    if not seen:
        raise SampleError(f"{path}: no rows")
    return columns


def _prompt_row(row: dict, where: str) -> dict:
    max_tokens = row.get("max_tokens")
    return {
        "id": row["id"],
        "category": _check_category(row["category"], PROMPT_CATEGORIES, where),
        "prompt": _check_text(row["prompt"], "prompt", where),
        "max_tokens": None if max_tokens is None else _check_max_tokens(max_tokens, where),
    }


def _chat_row(row: dict, where: str) -> dict:
    return {
        "id": row["id"],
        "category": _check_category(row["category"], CHAT_CATEGORIES, where),
        "messages": _check_messages(row["messages"], where),
    }


def load_prompts(path: Path) -> pa.Table:
    """prompts.jsonl -> table (id, category, prompt, max_tokens int32 nullable), in file order."""
    columns = _columns(path, {"id", "category", "prompt"}, {"max_tokens"}, _prompt_row)
    return pa.Table.from_pydict(columns, schema=PROMPTS_SCHEMA)


def load_chat(path: Path) -> pa.Table:
    """chat.jsonl -> table (id, category, messages list<struct<role, content>>), in file order."""
    columns = _columns(path, {"id", "category", "messages"}, set(), _chat_row)
    return pa.Table.from_pydict(columns, schema=CHAT_SCHEMA)


def write_parquet(table: pa.Table, dest: Path) -> None:
    """Write under a temporary name beside dest, then rename: readers never see half a file."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp, **WRITE_OPTIONS)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


# source name -> (loader, output name)
TARGETS: dict[str, tuple[Callable[[Path], pa.Table], str]] = {
    "prompts.jsonl": (load_prompts, "prompts.parquet"),
    "chat.jsonl": (load_chat, "chat.parquet"),
}


def build(src_dir: Path = SAMPLES_DIR, out_dir: Path | None = None) -> list[Path]:
    """Validate every source first, then write each Parquet file; returns the paths written."""
    out_dir = src_dir if out_dir is None else out_dir
    tables = {out_name: load(src_dir / src_name) for src_name, (load, out_name) in TARGETS.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for out_name, table in tables.items():
        write_parquet(table, out_dir / out_name)
        written.append(out_dir / out_name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src-dir", type=Path, default=SAMPLES_DIR, help="folder holding the .jsonl sources")
    parser.add_argument("--out-dir", type=Path, default=None, help="where to write (default: --src-dir)")
    args = parser.parse_args(argv)
    try:
        written = build(args.src_dir, args.out_dir)
    except SampleError as exc:
        print(f"build.py: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path} ({pq.read_metadata(path).num_rows} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
