"""JSONL job input: OpenAI Batch request lines, or plain rows with the Parquet column names.

A file holds one format, decided by its first line: an OpenAI request line (jobs.openai_batch) or a
plain row (`{"prompt": ..., "id": ..., "max_tokens": ...}`, other keys carried through like extra
Parquet columns). Either way each line becomes a row with the input columns of jobs.input_contract, so
everything after (shards, workers, outputs) is the same as for Parquet input.

Errors name the file, the line (1-based) and the field, and come before any shard of the job is
in place (shards are written to a staging directory first). The file is read one line at a time as
bytes: a line over MAX_CELL_BYTES is refused before it is read whole (memory stays bounded whatever
the file holds), and each line is decoded apart, so bad UTF-8 or JSON nested too deeply is named on
its own line. OpenAI request lines have fixed columns and are checked as they are read; plain rows
are read twice, so that every batch of the file has one Arrow schema: `JsonlInput.scan` checks every
line and settles the type of each carried-through key, `batches` converts the lines a few thousand
at a time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from jobs import openai_batch
from jobs.input_contract import (
    KNOWN_COLUMNS,
    MAX_CELL_BYTES,
    MAX_N,
    SAMPLING_COLUMNS,
    InputError,
    load_json,
)
from jobs.manifest import URL_COLUMN

BATCH_LINES = 4096
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1

# input column -> kind of value it takes (the Parquet kinds of jobs.input_contract, for JSON values)
_KINDS = {"id": "id", "prompt": "str", "messages": "messages", **SAMPLING_COLUMNS}
_ARROW = {"id": pa.string(), "str": pa.string(), "messages": MESSAGES_TYPE, "int": pa.int64(),
          "float": pa.float64(), "bool": pa.bool_(), "stop": pa.list_(pa.string()), "logprobs": pa.bool_(),
          "format": pa.string(), "regex": pa.string(), "choice": pa.list_(pa.string())}
_NAMES = {"id": "a string or an integer", "str": "a string", "messages": "a list of role/content objects",
          "int": "an integer", "float": "a number", "bool": "true or false",
          "stop": "a string or a list of strings", "logprobs": "true, false or an integer",
          "format": "a JSON object", "regex": "a string", "choice": "a list of strings"}
# the columns of every OpenAI-format file, in this order
OPENAI_COLUMNS = ("id", "prompt", "messages", *SAMPLING_COLUMNS)


@dataclass
class JsonlInput:
    """One JSONL input file, scanned: its format, columns and the model its requests name."""

    path: Path
    format: str = ""  # "openai" or "jsonl" (plain rows)
    schema: pa.Schema = field(default_factory=lambda: pa.schema([]))  # the input columns
    model: str | None = None  # body.model of the OpenAI requests (all the same), if given
    model_line: int = 0  # the first line that named it
    first_line: int = 0  # the first non-blank line (it decides the format)

    @classmethod
    def scan(cls, path: Path) -> JsonlInput:
        """The file's format (from its first line) and columns; plain rows are all checked now, OpenAI
        request lines as `batches` reads them. InputError names the line and field of a bad one."""
        found = cls(path)
        first = next(_objects(path), None)
        if first is None:
            raise InputError(f"input {path} has no rows")
        found.first_line = first[0]
        found.format = "openai" if openai_batch.is_request_line(first[1]) else "jsonl"
        columns = _Columns()
        if found.format == "jsonl":
            for line_no, obj in _objects(path):
                columns.observe(found._row(obj, line_no), f"{path} line {line_no}")
        found.schema = columns.schema(OPENAI_COLUMNS if found.format == "openai" else ())
        return found

    def _row(self, obj: dict, line_no: int) -> dict:
        where = f"{self.path} line {line_no}"
        fmt = "openai" if openai_batch.is_request_line(obj) else "jsonl"
        if fmt != self.format:
            raise InputError(f"{where}: {_FORMAT_NAMES[fmt][0]}, but line {self.first_line} makes this a "
                             f"file of {_FORMAT_NAMES[self.format][1]}; one format per file")
        if self.format == "jsonl":
            return typed_row(obj, where, "")
        try:
            values, model = openai_batch.request_values(obj)
        except openai_batch.RequestLineError as exc:
            raise InputError(f"{where}: {exc}") from None
        self._check_model(model, line_no)
        row = typed_row(values, where, "body.")
        row[URL_COLUMN] = obj["url"]
        return row

    def _check_model(self, model, line_no: int) -> None:
        if model is None:
            return
        if not isinstance(model, str) or not model:
            raise InputError(f"{self.path} line {line_no}: body.model must be a non-empty string, "
                             f"got {model!r}")
        if self.model is None:
            self.model, self.model_line = model, line_no
        elif model != self.model:
            raise InputError(f"{self.path} line {line_no}: body.model {model!r} differs from {self.model!r} "
                             f"(line {self.model_line}); one job runs one model")

    def batches(self) -> Iterator[tuple[pa.RecordBatch, list[int]]]:
        """(record batch of the input columns, plus `_bg_url` for OpenAI lines; its line numbers)."""
        schema = self.schema
        if self.format == "openai":
            schema = schema.append(pa.field(URL_COLUMN, pa.string()))
        rows, lines = [], []
        for line_no, obj in _objects(self.path):
            rows.append(self._row(obj, line_no))
            lines.append(line_no)
            if len(rows) == BATCH_LINES:
                yield _batch(rows, lines, schema, self.path), lines
                rows, lines = [], []
        if rows:
            yield _batch(rows, lines, schema, self.path), lines


_FORMAT_NAMES = {"openai": ("an OpenAI batch request line", "OpenAI batch request lines"),
                 "jsonl": ("a plain row", "plain rows")}


def _objects(path: Path) -> Iterator[tuple[int, dict]]:
    """(1-based line number, JSON object) of every non-blank line. The file is read as bytes, one line
    at a time and at most MAX_CELL_BYTES of it: a longer line is refused before it is read whole, and
    each line is decoded on its own, so bad UTF-8 is reported on its own line."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, errors become InputError
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    with handle:
        line_no = 0
        while raw := handle.readline(MAX_CELL_BYTES + 1):
            line_no += 1
            if len(raw) > MAX_CELL_BYTES and not raw.endswith(b"\n"):
                raise InputError(f"{path} line {line_no}: longer than {MAX_CELL_BYTES >> 20} MiB, the most a "
                                 "line may hold (a prompt that long is past any model's context)")
            if raw.strip():
                yield line_no, _parse(_decode(raw, path, line_no), path, line_no)


def _decode(raw: bytes, path: Path, line_no: int) -> str:
    try:
        return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} line {line_no}: not UTF-8 text ({exc.reason} at byte {exc.start + 1} "
                         "of the line)") from None


def _parse(text: str, path: Path, line_no: int) -> dict:
    try:
        obj = load_json(text)
    except ValueError as exc:
        raise InputError(f"{path} line {line_no}: {exc}") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path} line {line_no}: a line must be a JSON object, got {type(obj).__name__}")
    return obj


# ---------------------------------------------------------------- typing one row


def typed_row(values: dict, where: str, prefix: str) -> dict:
    """The known input columns checked and converted to their kinds; other keys kept as they are.
    A `logprobs` count (vLLM) becomes `logprobs` true plus `top_logprobs`."""
    row = {}
    for name, value in values.items():
        if name.startswith("_bg_"):
            raise InputError(f"{where}: key {name!r} uses the reserved prefix '_bg_'; rename it")
        kind = _KINDS.get(name)
        typed = kind is not None and value is not None
        row[name] = _typed(kind, value, f"{where}: {prefix}{name}") if typed else value
    count = row.get("logprobs")
    if count is not None and not isinstance(count, bool):
        top = row.get("top_logprobs")
        if top is not None and top != count:
            raise InputError(f"{where}: {prefix}logprobs {count} (a count) and {prefix}top_logprobs {top} "
                             "disagree; give one")
        row["logprobs"], row["top_logprobs"] = True, count
    n = row.get("n")
    if n is not None and not 1 <= n <= MAX_N:
        raise InputError(f"{where}: {prefix}n must be an integer in [1, {MAX_N}], got {n}")
    return row


def _typed(kind: str, value, what: str):
    if kind == "messages":
        return _messages(value, what)
    if kind == "stop":
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
        return _ok([value] if isinstance(value, str) else value, ok, kind, what, value)
    if kind == "format":  # kept as JSON text: one Arrow type whatever the schema's shape
        return _ok(json.dumps(value, ensure_ascii=False), isinstance(value, dict), kind, what, value)
    if kind == "choice":
        ok = isinstance(value, list) and all(isinstance(c, str) for c in value)
        return _ok(value, ok, kind, what, value)
    if kind in ("str", "id", "regex"):
        ok = isinstance(value, str) or (kind == "id" and _is_int(value))
        return _ok(str(value), ok, kind, what, value)
    if kind == "bool":
        return _ok(value, isinstance(value, bool), kind, what, value)
    if kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return _ok(float(value) if ok else value, ok, kind, what, value)
    if kind == "logprobs" and isinstance(value, bool):
        return value
    ok = _is_int(value) and I64_MIN <= value <= I64_MAX
    return _ok(int(value) if ok else value, ok, kind, what, value)


def _is_int(value) -> bool:
    if isinstance(value, bool):
        return False
    whole_float = isinstance(value, float) and math.isfinite(value) and value.is_integer()
    return isinstance(value, int) or whole_float


def _ok(converted, ok: bool, kind: str, what: str, value):
    if not ok:
        raise InputError(f"{what} must be {_NAMES[kind]}, got {json.dumps(value)[:80]}")
    return converted


def _messages(value, what: str) -> list[dict]:
    if not isinstance(value, list):
        raise InputError(f"{what} must be {_NAMES['messages']}, got {json.dumps(value)[:80]}")
    for i, msg in enumerate(value):
        ok = isinstance(msg, dict) and set(msg) <= {"role", "content"} and all(
            msg.get(k) is None or isinstance(msg.get(k), str) for k in ("role", "content"))
        if not ok:
            raise InputError(f"{what}[{i}] must be an object with string 'role' and 'content', "
                             f"got {json.dumps(msg)[:80]}")
    return [{"role": m.get("role"), "content": m.get("content")} for m in value]


# ---------------------------------------------------------------- columns


class _Columns:
    """The columns seen so far, in first-seen order, and the JSON kind of each carried-through one."""

    def __init__(self) -> None:
        self.names: dict[str, None] = {}
        self.kinds: dict[str, tuple[str, pa.DataType | None, str]] = {}  # name -> (kind, nested type, where)

    def observe(self, row: dict, where: str) -> None:
        for name, value in row.items():
            if name == URL_COLUMN:
                continue
            self.names.setdefault(name)
            if name in KNOWN_COLUMNS or value is None:
                continue
            kind = _json_kind(value)
            seen = self.kinds.get(name)
            if seen is None:
                nested = _infer(value, name, where) if kind == "nested" else None
                self.kinds[name] = (kind, nested, where)
            elif seen[0] != kind:
                if {seen[0], kind} == {"int", "float"}:
                    self.kinds[name] = ("float", None, seen[2])
                    continue
                raise InputError(f"{where}: key {name!r} holds {_KIND_NAMES[kind]}, but {seen[2]} has "
                                 f"{_KIND_NAMES[seen[0]]}; one type per key")

    def schema(self, fixed: tuple[str, ...]) -> pa.Schema:
        names = list(fixed) + [n for n in self.names if n not in fixed]
        return pa.schema([pa.field(n, self._type(n)) for n in names])

    def _type(self, name: str) -> pa.DataType:
        if name in _KINDS:
            return _ARROW[_KINDS[name]]
        kind, nested, _ = self.kinds.get(name, ("null", None, ""))
        return nested if kind == "nested" else _SCALAR_TYPES[kind]


_SCALAR_TYPES = {"null": pa.null(), "bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(),
                 "str": pa.string()}
_KIND_NAMES = {"bool": "a boolean", "int": "an integer", "float": "a number", "str": "a string",
               "nested": "a list or object"}


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "nested"


def _infer(value, name: str, where: str) -> pa.DataType:
    try:
        return pa.array([value]).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        raise InputError(f"{where}: key {name!r} cannot be stored as a Parquet column ({exc})") from None


def _batch(rows: list[dict], lines: list[int], schema: pa.Schema, path: Path) -> pa.RecordBatch:
    arrays = []
    for fld in schema:
        values = [row.get(fld.name) for row in rows]
        try:
            arrays.append(pa.array(values, type=fld.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            arrays.append(_first_bad(values, fld, lines, path))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _first_bad(values: list, fld: pa.Field, lines: list[int], path: Path) -> pa.Array:
    """Name the first line whose value does not fit the column's type (a nested key's shape changed)."""
    for value, line_no in zip(values, lines, strict=True):
        try:
            pa.array([value], type=fld.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            raise InputError(f"{path} line {line_no}: key {fld.name!r} holds {json.dumps(value)[:80]}, "
                             f"which does not fit the type of earlier lines ({fld.type})") from None
    raise InputError(f"{path}: key {fld.name!r} cannot be stored as a Parquet column")
