"""The input contract: which files, which columns, which rows can run.

Two kinds of bad input, handled differently:

- Input errors (`InputError`): an unreadable or missing file, no `prompt`/`messages` column, a
  column of the wrong type, a null or duplicate `id`, a line or cell over MAX_CELL_BYTES, JSON
  nested deeper than MAX_JSON_DEPTH. The job is refused before any work, with a message naming the
  file, the column and the row (or line).
- Rows that cannot run (an empty prompt, `max_tokens` < 1, a temperature < 0, ...): the job goes
  on and the row becomes an output row with finish_reason "error". `row_request` says why; the
  engine itself reports the rows it alone can judge (a prompt longer than the model's context).

Sampling values come from the job's defaults (CLI flags) overridden per row by the optional
columns; a null cell means "use the default". Column names follow OpenAI/vLLM: `n` (samples per
row, each an output row of its own), `logprobs` (true, or vLLM's count of alternatives) and
`top_logprobs`, `min_p` and the presence/frequency/repetition penalties. `n` shapes the output,
so an `n` outside [1, MAX_N] is an input error, not an error row.

Structured output columns (one per row at most; a row that sets one replaces the job's default):
`response_format` (OpenAI's object, as JSON text), `guided_regex` (a string),
`guided_choice` (a list of strings). A malformed one, or a schema or regex the grammar engine
refuses, is an input error naming the row: it would fail every sample of the row alike.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.sampling_params import SamplingParams
from engine.structured_output import check, constraint_from

# optional per-row sampling columns -> the kind of Arrow type they must have
SAMPLING_COLUMNS: dict[str, str] = {
    "max_tokens": "int", "temperature": "float", "top_p": "float", "top_k": "int", "min_p": "float",
    "presence_penalty": "float", "frequency_penalty": "float", "repetition_penalty": "float",
    "seed": "int", "stop": "stop", "ignore_eos": "bool", "priority": "int", "n": "int",
    "logprobs": "logprobs", "top_logprobs": "int",
    "response_format": "format", "guided_regex": "regex", "guided_choice": "choice",
}
CONSTRAINT_COLUMNS = ("response_format", "guided_regex", "guided_choice")
# output columns an input column may not shadow (it would be ambiguous in `outputs`)
OUTPUT_COLUMNS = ("job_id", "request_id", "sample_index", "output_text", "finish_reason", "prompt_tokens",
                  "output_tokens", "error", "model")
PROMPT_COLUMNS = ("prompt", "messages")  # carried through to `outputs` with --keep-prompt
RESERVED_PREFIX = "_bg_"  # internal columns of shards and of the store
KNOWN_COLUMNS = ("id", *PROMPT_COLUMNS, *SAMPLING_COLUMNS)
GLOB_CHARS = "*?["
INPUT_SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl"}  # file suffix -> input kind
MAX_N = 128  # samples per row at most (OpenAI's limit for `n`)
# The largest JSONL line, or Parquet cell (a prompt, a messages list, any carried column), an input may
# hold: far past any model's context (a prompt that long would be an error row anyway). A JSONL line
# over it is refused once this many bytes were read (never read whole); a Parquet cell as its batch of
# rows is read, before any row of it is parsed.
MAX_CELL_BYTES = 16 << 20
# JSON nested deeper than this (a line, a response_format schema) is refused: real schemas nest a few
# levels, and deeper ones exhaust the recursion of the JSON reader and the grammar compiler
MAX_JSON_DEPTH = 128
CHAT_TEMPLATE_MODES = ("auto", "always", "never")  # --apply-chat-template


class InputError(ValueError):
    """Input that cannot become a job; the message names the file, column and row."""


# ---------------------------------------------------------------- files


def resolve_input_files(source: str | os.PathLike) -> list[Path]:
    """A Parquet or JSONL file, a directory of them (`*.parquet` or `*.jsonl`, sorted) or a glob ->
    absolute paths, all of one kind (see `input_kind`)."""
    text = str(source)
    path = Path(text).expanduser()
    if path.is_file():
        return [path.resolve()]
    if path.is_dir():
        found = sorted(p for suffix in INPUT_SUFFIXES for p in path.glob(f"*{suffix}") if p.is_file())
        if not found:
            raise InputError(f"directory {path} holds no *.parquet or *.jsonl files")
        return _one_kind([p.resolve() for p in found], str(path))
    if any(ch in text for ch in GLOB_CHARS):
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(text), recursive=True))
        found = [p for p in found if p.is_file()]
        if not found:
            raise InputError(f"no file matches {text!r}")
        return _one_kind([p.resolve() for p in found], text)
    raise InputError(f"input {text!r} does not exist (give a Parquet or JSONL file, a directory or a glob)")


def input_kind(path: Path) -> str:
    """"jsonl" for a `.jsonl` file, else "parquet" (whatever its name, a Parquet reader judges it)."""
    return INPUT_SUFFIXES.get(path.suffix.lower(), "parquet")


def _one_kind(paths: list[Path], source: str) -> list[Path]:
    kinds = {input_kind(p) for p in paths}
    if len(kinds) > 1:
        raise InputError(f"{source} mixes Parquet and JSONL files; one job reads one kind")
    return paths


def open_parquet(path: Path) -> pq.ParquetFile:
    """`path` opened for reading batch by batch. Not pre-buffered: pyarrow's default (pre_buffer) keeps
    every column chunk it read, in 32 MiB ranges, until the file is closed: reading 30M rows of a
    100M-row input held 274 MB that way, 93 MB without, no slower (docs/benchmarks.md, issue 38)."""
    try:
        return pq.ParquetFile(path, pre_buffer=False)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({_first_line(exc)})") from exc


# ---------------------------------------------------------------- columns


@dataclass
class InputSchema:
    """The columns of a job's input, checked once per file."""

    schema: pa.Schema  # the first file's Arrow schema; every file must match it
    has_prompt: bool  # a `prompt` column exists
    has_messages: bool  # a `messages` column exists
    extra_columns: list[str]  # columns passed through to `outputs` unchanged

    @classmethod
    def check(cls, schema: pa.Schema, path: Path) -> InputSchema:
        """Check names and types of `schema` (from `path`); raise InputError naming the column."""
        names = schema.names
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise InputError(f"{path}: column(s) {dup} appear more than once")
        if "prompt" not in names and "messages" not in names:
            raise InputError(f"{path}: needs a 'prompt' (string) or 'messages' (list of role/content) "
                             f"column; it has {names}")
        for name in names:
            _check_column_name(name, path)
            _check_column_type(name, schema.field(name).type, path)
        extra = [n for n in names if n not in KNOWN_COLUMNS]
        return cls(schema, "prompt" in names, "messages" in names, extra)

    def check_same(self, schema: pa.Schema, path: Path) -> None:
        """Every input file of a job has the same columns with the same types."""
        mine = {f.name: f.type for f in self.schema}
        theirs = {f.name: f.type for f in schema}
        if set(mine) != set(theirs):
            missing, added = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
            raise InputError(f"{path}: columns differ from the first input file "
                             f"(missing {missing}, extra {added})")
        for name, typ in mine.items():
            if theirs[name] != typ:
                raise InputError(f"{path}: column {name!r} is {theirs[name]}, but {typ} in the first file")


def _check_column_name(name: str, path: Path) -> None:
    if name.startswith(RESERVED_PREFIX):
        raise InputError(f"{path}: column {name!r} uses the reserved prefix {RESERVED_PREFIX!r}; rename it")
    if name in OUTPUT_COLUMNS:
        hint = " (the row id column is 'id')" if name == "request_id" else ""
        raise InputError(f"{path}: column {name!r} clashes with an output column of the same name; "
                         f"rename it{hint}")


def _check_column_type(name: str, typ: pa.DataType, path: Path) -> None:
    want = _COLUMN_KINDS.get(name)
    if want is None or _TYPE_OK[want](typ):
        return
    raise InputError(f"{path}: column {name!r} must be {_TYPE_NAMES[want]}, got {typ}")


def _is_str(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)


def _is_messages(t: pa.DataType) -> bool:
    if not _is_list(t) or not pa.types.is_struct(t.value_type):
        return False
    inner = {f.name: f.type for f in t.value_type}
    return all(k in inner and (_is_str(inner[k]) or pa.types.is_null(inner[k])) for k in ("role", "content"))


def _is_int_like(t: pa.DataType) -> bool:
    # floats are allowed when every value is whole (pandas turns an int column with nulls into float64)
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)


_TYPE_OK = {
    "str": lambda t: _is_str(t) or pa.types.is_null(t),
    "messages": lambda t: _is_messages(t) or pa.types.is_null(t),
    "id": lambda t: pa.types.is_integer(t) or _is_str(t),
    "int": _is_int_like,
    "float": lambda t: pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t),
    "bool": lambda t: pa.types.is_boolean(t) or pa.types.is_null(t),
    "stop": lambda t: _is_str(t) or (_is_list(t) and _is_str(t.value_type)) or pa.types.is_null(t),
    "logprobs": lambda t: pa.types.is_boolean(t) or _is_int_like(t),
    "format": lambda t: _is_str(t) or pa.types.is_null(t),
    "regex": lambda t: _is_str(t) or pa.types.is_null(t),
    "choice": lambda t: (_is_list(t) and _is_str(t.value_type)) or pa.types.is_null(t),
}
_TYPE_NAMES = {
    "str": "a string", "messages": "a list of struct<role: string, content: string>",
    "id": "an integer or a string", "int": "an integer", "float": "a number", "bool": "a boolean",
    "stop": "a string or a list of strings", "logprobs": "a boolean or an integer",
    "format": "a string of JSON (OpenAI's response_format object)", "regex": "a string",
    "choice": "a list of strings",
}
_COLUMN_KINDS = {"prompt": "str", "messages": "messages", "id": "id", **SAMPLING_COLUMNS}


# ---------------------------------------------------------------- rows


class RequestIds:
    """Request ids of a job in input order: the `id` column, else the row number; unique.

    Nothing is held per row: a null id is refused as its batch is read; ids from an `id` column go to
    a spill file in `spill_dir` (id, input row, file, row or line), and `check_unique` has DuckDB find
    the first repeat there once the whole input is read, in bounded memory (spilling to disk past
    ID_CHECK_MEMORY). Row numbers need no check: they are unique by construction.
    """

    SPILL_ROWS = 65_536  # ids buffered per row group of the spill file

    def __init__(self, spill_dir: Path) -> None:
        self.spill_dir = Path(spill_dir)
        self.num_rows = 0  # rows seen so far (the next row's number)
        self._files: list[tuple[Path, bool]] = []  # (path, positions are JSONL lines)
        self._writer: pq.ParquetWriter | None = None
        self._held: list[pa.RecordBatch] = []
        self._held_rows = 0

    def take(self, batch: pa.RecordBatch, path: Path, file_row0: int, lines: list[int] | None = None
             ) -> pa.Array:
        """Ids of `batch` (rows file_row0.. of `path`, or its `lines` of a JSONL file), as strings;
        raise InputError on a null id (duplicates: `check_unique`)."""
        n = batch.num_rows
        if "id" not in batch.schema.names:
            ids = _arange(self.num_rows, n).cast(pa.string())
            self.num_rows += n
            return ids
        column = batch.column("id")
        if column.null_count:
            i = pc.index(column.is_null(), True).as_py()
            where = f"{path} line {lines[i]}" if lines else f"{path} row {file_row0 + i}"
            raise InputError(f"{where}: column 'id' is null; every row needs an id (or drop the column)")
        ids = column.cast(pa.string())  # an integer id as its decimal text, as str() writes it
        if not self._files or self._files[-1][0] != path:
            self._files.append((path, lines is not None))
        positions = pa.array(lines, pa.int64()) if lines else _arange(file_row0, n)
        self._spill(pa.record_batch({
            "id": ids, "row": _arange(self.num_rows, n),
            "file": pa.array(np.full(n, len(self._files) - 1, np.int32)), "pos": positions}))
        self.num_rows += n
        return ids

    def _spill(self, batch: pa.RecordBatch) -> None:
        self._held.append(batch)
        self._held_rows += batch.num_rows
        if self._held_rows >= self.SPILL_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self._held:
            return
        table = pa.Table.from_batches(self._held)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.spill_dir / "ids.parquet", table.schema, compression="lz4",
                                            use_dictionary=False, write_statistics=False)
        self._writer.write_table(table)
        self._held, self._held_rows = [], 0

    def check_unique(self) -> None:
        """Raise InputError naming the first row whose id an earlier row already used (and that row)."""
        self._flush()
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        found = _first_repeat(self.spill_dir / "ids.parquet", self.spill_dir / "duckdb-spill", self.num_rows)
        if found is not None:
            rid, file, pos, first = found
            path, is_line = self._files[file]
            where = f"{path} line {pos}" if is_line else f"{path} row {pos}"
            raise InputError(f"{where}: duplicate id {rid!r} (first used by input row {first})")


def _arange(start: int, n: int) -> pa.Array:
    return pa.array(np.arange(start, start + n, dtype=np.int64))


ID_CHECK_MEMORY = "160MB"  # DuckDB's memory for the duplicate id check; past it, it spills to disk
ID_CHECK_PARTITION_ROWS = 8_000_000  # ids checked a partition at a time (by hash: a repeat stays in one)
# rows a DuckDB thread buffers before it writes them to their partitions' files (DuckDB's default
# 524,288): 13 partitions of a 10M-row spill file peaked 35 MB lower, and no slower
ID_CHECK_FLUSH_ROWS = 65_536


def _first_repeat(ids_file: Path, temp_dir: Path, rows: int) -> tuple[str, int, int, int] | None:
    """(id, file, row or line, first input row) of the first row in input order whose id an earlier row
    used, from a spill file of `rows` (id, row, file, pos); None when every id is unique.

    Past ID_CHECK_PARTITION_ROWS the ids are first split by a hash of the id into partitions of about
    that many rows (one pass), each checked alone: one GROUP BY over 100M distinct ids ran out of
    DuckDB's memory limit instead of spilling. Every copy of an id lands in one partition, so the
    first repeat of the input is the earliest of the partitions' first repeats."""
    import duckdb

    temp_dir.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(config={"memory_limit": ID_CHECK_MEMORY, "temp_directory": str(temp_dir),
                                 "preserve_insertion_order": False,
                                 "partitioned_write_flush_threshold": ID_CHECK_FLUSH_ROWS})
    query = ("WITH repeated AS (SELECT id, min(row) AS first FROM read_parquet($files) GROUP BY id "
             "HAVING count(*) > 1) "
             "SELECT s.id, s.file, s.pos, r.first, s.row FROM read_parquet($files) s JOIN repeated r "
             "ON s.id = r.id AND s.row > r.first ORDER BY s.row LIMIT 1")
    try:
        parts = -(-rows // ID_CHECK_PARTITION_ROWS)
        if parts <= 1:
            found = [con.execute(query, {"files": [str(ids_file)]}).fetchone()]
        else:
            split = temp_dir / "partitions"
            con.execute(f"COPY (SELECT id, row, file, pos, hash(id) % {parts} AS p FROM read_parquet($file)) "
                        f"TO '{split}' (FORMAT parquet, PARTITION_BY (p), COMPRESSION lz4)",
                        {"file": str(ids_file)})
            found = [con.execute(query, {"files": files}).fetchone()
                     for files in (sorted(str(f) for f in (split / f"p={k}").glob("*.parquet"))
                                   for k in range(parts)) if files]
        hits = [hit for hit in found if hit is not None]
        return min(hits, key=lambda hit: hit[4])[:4] if hits else None
    finally:
        con.close()


def check_sampling_values(batch: pa.RecordBatch, path: Path, file_row0: int,
                          lines: list[int] | None = None) -> int:
    """Integer columns stored as floats must hold whole numbers (else it is a wrong type), `n`
    must be in [1, MAX_N], structured output constraints must compile. Returns the largest `n` of
    the batch (1 without an `n` column)."""
    names = batch.schema.names
    for name, kind in SAMPLING_COLUMNS.items():
        if kind not in ("int", "logprobs") or name not in names:
            continue
        if not pa.types.is_floating(batch.schema.field(name).type):
            continue
        for i, value in enumerate(batch.column(name).to_pylist()):
            if value is not None and not (math.isfinite(value) and float(value).is_integer()):
                raise InputError(f"{path} row {file_row0 + i}: column {name!r} must be an integer, "
                                 f"got {value!r}")
    check_constraints(batch, path, file_row0, lines)
    if "n" not in names:
        return 1
    values = batch.column("n").to_pylist()
    for i, value in enumerate(values):
        if value is not None and not 1 <= value <= MAX_N:
            raise InputError(f"{path} row {file_row0 + i}: column 'n' must be an integer in [1, {MAX_N}], "
                             f"got {value!r}")
    return int(max((v for v in values if v is not None), default=1))


def check_constraints(batch: pa.RecordBatch, path: Path, file_row0: int, lines: list[int] | None) -> None:
    """Each row's structured output constraint is well formed and its schema or regex compiles
    (once per distinct constraint); InputError names the row (or JSONL line)."""
    given = [name for name in CONSTRAINT_COLUMNS if name in batch.schema.names]
    if not given:
        return
    columns = {name: batch.column(name).to_pylist() for name in given}
    for i in range(batch.num_rows):
        cells = {name: columns[name][i] for name in given if columns[name][i] is not None}
        if not cells:
            continue
        try:
            check(constraint_from(**{name: _cell(name, v) for name, v in cells.items()}))
        except ValueError as exc:
            where = f"{path} line {lines[i]}" if lines else f"{path} row {file_row0 + i}"
            raise InputError(f"{where}: {exc}") from None


@dataclass
class RowRequest:
    """What the engine is asked for one input row (or why the row cannot run)."""

    prompt: str | None  # text prompt (None when messages are given or the row is bad)
    messages: list[dict] | None  # chat messages, the model's chat template applies
    params: SamplingParams | None  # the row's sampling parameters (None when the row is bad)
    error: str | None  # why the row cannot run; it becomes an output row with finish_reason "error"
    n: int = 1  # samples of this row: one engine request and one output row each


def sampling_defaults(**given: Any) -> dict:
    """Job-level sampling defaults (CLI flags named as the input columns; None = the default),
    checked now."""
    unknown = sorted(set(given) - set(SAMPLING_COLUMNS))
    if unknown:
        raise InputError(f"unknown sampling parameter(s) {unknown}")
    defaults = {k: v for k, v in given.items() if v is not None}
    try:
        check(sampling_params(defaults)[0].constraint)
    except (TypeError, ValueError) as exc:
        raise InputError(f"job sampling defaults: {exc}") from exc
    return defaults


def sampling_params(values: dict) -> tuple[SamplingParams, int]:
    """SamplingParams and `n` from values named as the input columns (`n`, `logprobs` and
    `top_logprobs` are not SamplingParams fields); ValueError names the bad one."""
    values = dict(values)
    n = values.pop("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
    values["logprobs"] = _top_n(values.pop("logprobs", None), values.pop("top_logprobs", None))
    return SamplingParams(**values), n


def _top_n(logprobs: bool | int | None, top: int | None) -> int | None:
    """SamplingParams.logprobs (alternatives per token; None = no logprobs) from OpenAI's pair
    `logprobs` (true) + `top_logprobs` (count), or vLLM's `logprobs` count alone."""
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise ValueError(f"top_logprobs must be an integer >= 0, got {top!r}")
    if logprobs is None or logprobs is True:
        return top if top is not None else (0 if logprobs else None)
    if logprobs is False:
        if top is not None:
            raise ValueError("top_logprobs needs logprobs true (or null), got logprobs false")
        return None
    if top is not None and top != logprobs:
        raise ValueError(f"logprobs {logprobs} (a count) and top_logprobs {top} disagree; give one")
    return logprobs


def row_request(row: dict, defaults: dict) -> RowRequest:
    """Turn one input row (a dict of its cells) into a RowRequest; bad rows get an error."""
    try:
        overrides = {k: _cell(k, row[k]) for k in SAMPLING_COLUMNS if row.get(k) is not None}
    except ValueError as exc:
        return RowRequest(None, None, None, f"invalid sampling parameters: {exc}")
    if any(k in overrides for k in CONSTRAINT_COLUMNS):  # the row's constraint replaces the job's
        defaults = {k: v for k, v in defaults.items() if k not in CONSTRAINT_COLUMNS}
    messages = row.get("messages")
    prompt = row.get("prompt")
    if messages is None and prompt is None:
        return RowRequest(None, None, None, "empty prompt (both 'prompt' and 'messages' are null)")
    if messages is not None and prompt is not None:  # which one was meant? never drop one silently
        return RowRequest(None, None, None, "both 'prompt' and 'messages' are set; give one of them")
    if messages is not None:
        error = _check_messages(messages)
        if error:
            return RowRequest(None, None, None, error)
        prompt = None
    elif not prompt:
        return RowRequest(None, None, None, "empty prompt")
    try:
        params, n = sampling_params({**defaults, **overrides})
    except (TypeError, ValueError) as exc:
        return RowRequest(None, None, None, f"invalid sampling parameters: {exc}")
    return RowRequest(prompt, messages, params, None, n)


def _cell(name: str, value: Any) -> Any:
    kind = SAMPLING_COLUMNS[name]
    if kind == "logprobs":
        return value if isinstance(value, bool) else int(value)
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "stop":
        return [value] if isinstance(value, str) else [s for s in value if s is not None]
    if kind == "format":
        return _json_value(name, value)
    if kind in ("regex", "choice"):
        return value
    return bool(value)


def _json_value(name: str, text: str) -> Any:
    try:
        return load_json(text)
    except ValueError as exc:
        raise ValueError(f"{name} is {exc}") from None


def load_json(text: str) -> Any:
    """json.loads within the nesting limit; a ValueError that says what is wrong ("not JSON (...)",
    "JSON nested ..."), for the caller to prefix with where the text came from."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH}")
    return value


def json_depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value (a scalar: 0); iterative, so any
    depth is measured without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in children)
    return deepest


def check_cell_sizes(batch: pa.RecordBatch, path: Path, file_row0: int) -> None:
    """No cell of the batch holds more than MAX_CELL_BYTES (InputError naming the row and column);
    a column whose whole batch is under the limit is passed at once."""
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        if column.nbytes <= MAX_CELL_BYTES:
            continue
        sizes = _cell_sizes(column)
        over = next((i for i, size in enumerate(sizes) if size > MAX_CELL_BYTES), None)
        if over is not None:
            raise InputError(f"{path} row {file_row0 + over}: column {name!r} holds "
                             f"{sizes[over] / (1 << 20):.1f} MiB; a cell may hold at most "
                             f"{MAX_CELL_BYTES >> 20} MiB")


def _cell_sizes(column: pa.Array) -> list[int]:
    """Bytes of each cell: a string's length, else the Arrow bytes of the one-row slice."""
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind):
        return pc.fill_null(pc.binary_length(column), 0).to_pylist()
    return [column.slice(i, 1).nbytes for i in range(len(column))]


def _check_messages(messages: list) -> str | None:
    if not messages:
        return "empty prompt ('messages' is an empty list)"
    for i, msg in enumerate(messages):
        if msg is None or msg.get("role") is None or msg.get("content") is None:
            return f"messages[{i}] needs a non-null 'role' and 'content'"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ---------------------------------------------------------------- the model


def check_model(name: str, *, local: bool, what: str = "--model") -> None:
    """Refuse a model name that names nothing, or files the engine could not load, before a job is
    recorded (InputError, exit 2).

    A registry name, the random test model, an existing directory or GGUF file, or a Hugging Face
    Hub id pass (a Hub id is fetched by the workers; nothing is downloaded here). With `local` (the
    job runs on this machine, `batchgen run`) a registry model must be pulled already, since the
    workers would fail on it; `submit` leaves pulling to the worker machines. A directory or GGUF
    file is checked without reading its weights (engine.model_files.check_model_files: config, every
    tensor's presence and shape, no shard missing or truncated, the tokenizer), naming the file.
    """
    from engine.model_files import ModelFileError, check_model_files
    from engine.registry import KNOWN_MODELS, ModelNotFoundError, resolve_model

    if not name or (_looks_like_hub_id(name) and not Path(name).expanduser().exists()):
        return
    if name in KNOWN_MODELS and not local:
        return
    try:
        check_model_files(resolve_model(name))
    except (ModelNotFoundError, ModelFileError) as exc:
        raise InputError(f"{what}: {exc}") from None


def _looks_like_hub_id(name: str) -> bool:
    owner, slash, repo = name.partition("/")
    return bool(slash and owner and repo) and "/" not in repo and not name.startswith((".", "~"))
