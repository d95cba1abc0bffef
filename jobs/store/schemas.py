"""Arrow schemas of the part kinds, and the row dataclasses the writers take.

Every part file of a kind carries at least that kind's base columns, cast to these types, plus the
internal `_bg_*` columns the views use and never show:

- `_bg_part`: the name of the raw part a row was first written to. It survives compaction, so a view
  can tell that a compacted file and a raw part hold the same rows and count them once.
- `_bg_attempt_id`: the unique id of the shard attempt that wrote the row (outputs, requests,
  commits, shard events), so only the committed attempt's rows are counted.
- `_bg_shard_id`: the shard of an output row (outputs only; `requests` shows `shard_id` openly).

`request_digests` is internal as a whole (read through `_bg` views only): one row per request-timing
part, its totals and a sample of its rows (`jobs.store.digests`).

Output rows carry every extra input column of their job after the base columns; those keep the
Arrow type they arrive with. Names starting with `_bg_` are reserved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import pyarrow as pa

from engine.stats import IterationStats, RequestStats
from jobs.store.digests import DIGEST_COLUMNS, SAMPLE_FIELDS

INTERNAL_PREFIX = "_bg_"
PART_COLUMN = "_bg_part"
ATTEMPT_ID_COLUMN = "_bg_attempt_id"
SHARD_COLUMN = "_bg_shard_id"

STR = pa.string()
I64 = pa.int64()
F64 = pa.float64()

# shard lifecycle events a worker (or the submitter) records
SHARD_EVENTS = ("queued", "running", "completed", "failed", "cancelled")
# job-level events (cancel requests)
JOB_EVENTS = ("cancel_requested",)
FINISH_REASONS = ("stop", "length", "error", "cancelled")


@dataclass
class JobRecord:
    """What a job was submitted as: written once, at submission."""

    job_id: str  # [A-Za-z0-9][A-Za-z0-9._-]* (it names directories)
    model: str  # model name / path as the user gave it
    num_requests: int  # rows of the input Parquet
    num_shards: int  # shards 0 .. num_shards-1
    submitted_ts: float  # epoch seconds
    config: str = "{}"  # JSON: engine config, sampling defaults, input path, ...
    output_path: str = ""  # where the job's own output Parquet goes ("" = only the views)


@dataclass
class ShardEvent:
    """One step in a shard's life (queued, running, completed, failed, cancelled)."""

    job_id: str
    shard_id: int  # 0-based index < num_shards
    event: str  # one of SHARD_EVENTS
    ts: float  # epoch seconds
    attempt: int = 0  # 1, 2, ... for events of an attempt; 0 for queued
    worker_id: str = ""  # worker that ran the attempt
    error: str | None = None  # why, for failed / cancelled
    num_requests: int | None = None  # requests in the shard, when the writer knows it
    attempt_id: str = ""  # unique id of the attempt ("" outside an attempt)


@dataclass
class JobEvent:
    """A request made to a whole job after submission (today: cancel)."""

    job_id: str
    event: str  # one of JOB_EVENTS
    ts: float  # epoch seconds
    reason: str = ""  # free text from the user


@dataclass
class SweepRecord:
    """One measured configuration of `batchgen sweep` (one row of the `sweeps` view)."""

    sweep_id: str  # groups the rows of one sweep run
    ts: float  # epoch seconds when this configuration finished
    model: str
    swept: str  # which knob the sweep varies: max_num_seqs | max_num_batched_tokens | ...
    max_num_seqs: int  # sequence cap in force
    max_num_batched_tokens: int  # token budget in force
    repeat: int  # 0-based repetition of this configuration
    num_requests: int  # requests in the workload
    output_tokens_per_s: float  # generated tokens / wall time
    processed_tokens_per_s: float  # (prompt + generated tokens) / wall time
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float  # inter-token latency (tpot) percentiles over requests
    itl_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    mean_running: float  # mean running sequences per iteration
    mean_budget_utilisation: float  # mean scheduled_tokens / token_budget per iteration
    num_preemptions: int  # preemptions over the run
    workload: str = "{}"  # JSON: prompt/output length distributions, arrival pattern, seed, ...


@dataclass
class CommitRecord:
    """The row that makes a shard attempt count (written last, by `ShardAttempt.commit`).

    A row with `lost` set is a revocation instead (`Store.revoke_commit`): the commit of the same
    attempt id no longer counts, because rows it made count were lost (a part file gone or damaged).
    The shard then has no winning commit until another attempt commits.
    """

    job_id: str
    shard_id: int
    attempt: int
    attempt_id: str
    worker_id: str
    committed_ts: float  # epoch seconds
    num_outputs: int = 0  # input rows the attempt answered (its output rows of sample 0)
    num_request_rows: int = 0  # request timing rows the attempt wrote
    prompt_tokens: int = 0  # sums over the attempt's output rows
    output_tokens: int = 0
    parts: list[str] = field(default_factory=list)  # names of the attempt's data parts
    lost: str | None = None  # a revocation: why the commit of this attempt id no longer counts
    # the attempt's request outcomes as OpenAI Batch counts them (a request's samples together: failed
    # if one erred, else cancelled if one was cancelled, else completed) and its output rows with
    # finish_reason 'error': what `status` and the pages count, carried by the commit so they read the
    # winning commits instead of every output row. None in commits written before schema v3 (then
    # the readers count the outputs) and in revocations.
    requests_completed: int | None = None
    requests_failed: int | None = None
    requests_cancelled: int | None = None
    error_rows: int | None = None


def _schema(*cols: tuple[str, pa.DataType]) -> pa.Schema:
    return pa.schema([pa.field(name, typ) for name, typ in cols])


# sample_index: 0 .. n-1, one output row per sample of a request; model: the model that answered
OUTPUTS = _schema(
    ("job_id", STR), ("request_id", STR), ("sample_index", I64), ("output_text", STR), ("finish_reason", STR),
    ("prompt_tokens", I64), ("output_tokens", I64), ("error", STR), ("model", STR),
    (SHARD_COLUMN, I64), (ATTEMPT_ID_COLUMN, STR), (PART_COLUMN, STR),
)

# The `logprobs` output column, present when a job's rows ask for logprobs: per output token, the
# token (text), its id, its log probability, its UTF-8 bytes (null where the token alone is not
# whole UTF-8) and the top alternatives (OpenAI's `logprobs.content` shape, plus token ids).
_TOKEN_LOGPROB = [("token", STR), ("token_id", I64), ("logprob", F64), ("bytes", pa.list_(I64))]
LOGPROBS_TYPE = pa.list_(pa.struct([*_TOKEN_LOGPROB, ("top_logprobs", pa.list_(pa.struct(_TOKEN_LOGPROB)))]))

_ARROW_OF_ANNOTATION = {"bool": pa.bool_(), "int": I64, "float": F64, "str": STR, "list[str]": pa.list_(STR)}


def _stats_columns(stats: object) -> list[tuple[str, pa.DataType]]:
    """Columns of an engine stats dataclass's `as_row()`: the engine owns these names and types.

    A field's type comes from its annotation ("int", "float | None", "list[str]", ...); a computed
    entry (a property such as ttft_s) from its value.
    """
    hints = {name: str(ann) for name, ann in getattr(type(stats), "__annotations__", {}).items()}
    cols = []
    for name, value in stats.as_row().items():  # type: ignore[attr-defined]
        hint = hints.get(name, type(value).__name__).replace(" ", "").replace("|None", "")
        if hint not in _ARROW_OF_ANNOTATION:
            raise TypeError(f"{type(stats).__name__}.{name}: no Parquet column type for {hint!r}")
        cols.append((name, _ARROW_OF_ANNOTATION[hint]))
    return cols


_REQUEST_STATS = dict(_stats_columns(RequestStats()))
REQUESTS = _schema(  # the views' documented order first, then the rest of RequestStats
    ("job_id", STR), ("shard_id", I64), ("request_id", STR), ("sample_index", I64), ("worker_id", STR),
    ("prompt_tokens", _REQUEST_STATS.pop("prompt_tokens")),
    ("output_tokens", _REQUEST_STATS.pop("output_tokens")),
    ("finish_reason", STR), *_REQUEST_STATS.items(),
    ("attempt", I64), (ATTEMPT_ID_COLUMN, STR), (PART_COLUMN, STR),
)

ITERATIONS = _schema(*_stats_columns(IterationStats()), (PART_COLUMN, STR))

COMMITS = _schema(
    ("job_id", STR), ("shard_id", I64), ("attempt", I64), (ATTEMPT_ID_COLUMN, STR), ("worker_id", STR),
    ("committed_ts", F64), ("num_outputs", I64), ("num_request_rows", I64), ("prompt_tokens", I64),
    ("output_tokens", I64), ("parts", pa.list_(STR)), ("lost", STR), ("requests_completed", I64),
    ("requests_failed", I64), ("requests_cancelled", I64), ("error_rows", I64), (PART_COLUMN, STR),
)

# one row per request-timing part: its totals and sample (jobs.store.digests); `requests_part` names it
REQUEST_DIGESTS = _schema(
    ("job_id", STR), ("shard_id", I64), ("attempt", I64), ("requests_part", STR), *DIGEST_COLUMNS,
    (ATTEMPT_ID_COLUMN, STR), (PART_COLUMN, STR),
)

SHARD_EVENTS_SCHEMA = _schema(
    ("job_id", STR), ("shard_id", I64), ("event", STR), ("ts", F64), ("attempt", I64), ("worker_id", STR),
    ("error", STR), ("num_requests", I64), (ATTEMPT_ID_COLUMN, STR), (PART_COLUMN, STR),
)

JOB_RECORDS = _schema(
    ("job_id", STR), ("model", STR), ("num_requests", I64), ("num_shards", I64), ("submitted_ts", F64),
    ("config", STR), ("output_path", STR), (PART_COLUMN, STR),
)

JOB_EVENTS_SCHEMA = _schema(("job_id", STR), ("event", STR), ("ts", F64), ("reason", STR), (PART_COLUMN, STR))


def _sweep_columns() -> list[tuple[str, pa.DataType]]:
    types = {"str": STR, "int": I64, "float": F64}
    return [(name, types[typ]) for name, typ in SweepRecord.__annotations__.items()]


SWEEPS = _schema(*_sweep_columns(), (PART_COLUMN, STR))

# kind -> base schema; the order is the order the views are created in
KIND_SCHEMAS: dict[str, pa.Schema] = {
    "job_records": JOB_RECORDS,
    "job_events": JOB_EVENTS_SCHEMA,
    "shard_events": SHARD_EVENTS_SCHEMA,
    "commits": COMMITS,
    "outputs": OUTPUTS,
    "requests": REQUESTS,
    "request_digests": REQUEST_DIGESTS,
    "iterations": ITERATIONS,
    "sweeps": SWEEPS,
}
KINDS = tuple(KIND_SCHEMAS)

# per-second rollups of the iterations (jobs.store.rollups): the kind, the columns the chart averages
# (kept as sum and count of non-nulls) and those it sums, and the rollup rows' schema
ROLLED_UP_KIND = "iterations"
ROLLUP_AVERAGED = ("num_running", "num_waiting", "num_scheduled_seqs", "prefill_tokens", "decode_tokens",
                   "scheduled_tokens", "token_budget", "max_num_seqs", "kv_blocks_used", "kv_blocks_total",
                   "num_constrained_seqs", "mask_fill_s")
ROLLUP_SUMMED = ("num_preempted",)
# kept as their value at the rollup's last iteration (`last_<column>`, at `last_ts`): a worker's latest
ROLLUP_LATEST = ("max_num_seqs", "token_budget", "kv_blocks_total", "kv_blocks_used", "num_running",
                 "num_waiting")
ROLLUPS = _schema(
    (PART_COLUMN, STR), ("worker_id", STR), ("job_ids", pa.list_(STR)), ("second", I64), ("iterations", I64),
    ("first_ts", F64), ("last_end", F64),
    *[(f"{prefix}_{c}", typ) for c in ROLLUP_AVERAGED for prefix, typ in (("sum", F64), ("n", I64))],
    *[(c, I64) for c in ROLLUP_SUMMED], ("last_ts", F64), *[(f"last_{c}", I64) for c in ROLLUP_LATEST],
)
# the sample twins of the compacted request digests (jobs.store.digests.sample_twin_select): one row per
# sampled request row of the file's digests, its level (that of its digest's sample column) and its digest
SAMPLED_KIND = "request_digests"
SAMPLE_TWINS = _schema(
    ("job_id", STR), (ATTEMPT_ID_COLUMN, STR), ("level", I64), *SAMPLE_FIELDS,
)
# kinds whose parts belong to one job (grouped by job_id on disk, compacted per finished job)
JOB_KINDS = ("job_records", "job_events", "shard_events", "commits", "outputs", "requests", "request_digests")

# the columns a request timing row must have (RequestStats.as_row() gives all of them)
REQUEST_STATS_COLUMNS = tuple(RequestStats().as_row())


def record_row(record: object) -> dict:
    """A dataclass record as a row dict (the part writers take rows)."""
    return asdict(record)  # type: ignore[arg-type]
