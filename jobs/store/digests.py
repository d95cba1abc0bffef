"""Request digests: what a running job's live figures read instead of every request row.

Every request-timing part an attempt writes (`ShardAttempt`) gets a digest part beside it: one row
holding the part's exact totals (rows, output tokens, preemptions; per latency metric its count, sum,
minimum and maximum) and a deterministic sample of its request rows. So the live figures of a job
cost its parts, not its requests:

- totals (rows done, output tokens, preemptions, each metric's count / mean / min / max) are sums
  over digests: exact;
- percentiles, histograms and the time series (output tokens/s, request concurrency) of a job with
  more than `EXACT_MAX_ROWS` request rows are computed from the sample (the histograms and series
  scaled to the exact totals); a smaller job's are computed from its request rows, exactly.

The sample. A request row's level is the number of trailing zero bits of a 64-bit BLAKE2b hash of its
request id and sample index, so a row has level >= L with probability 2**-L, independently of its
timings, and every attempt of a shard samples the same requests. A digest keeps the rows of level >=
`MIN_LEVEL`, one list column per level (`sample_l3` ... `sample_l12`, the last holding every level
from `MAX_LEVEL` up): a query at level L reads the columns L.. only, about 2**-L of the rows.
`sample_level(rows)` picks the level that leaves about `SAMPLE_ROWS` of them.

`LATENCY_METRICS` is the one definition of the latency metrics (which column, over which requests):
the digests sum them and the dashboard's queries read them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

# A condition on a request row: every (column, bound) of it holds `column > bound` (a null fails it).
# The digests evaluate it with Arrow, the dashboard's SQL with its text (`where_sql`): one definition.
Condition = tuple[tuple[str, int], ...]


def where_sql(condition: Condition) -> str:
    return " AND ".join(f"{column} > {bound}" for column, bound in condition)


# metric -> (column of the request rows, which requests it is defined for)
METRIC_CONDITIONS: dict[str, tuple[str, Condition]] = {
    "ttft_s": ("ttft_s", (("first_token_ts", 0),)),
    "itl_s": ("tpot_s", (("output_tokens", 1), ("first_token_ts", 0))),
    "e2e_s": ("e2e_s", (("finished_ts", 0),)),
    "queue_s": ("queue_s", (("scheduled_ts", 0),)),
}
LATENCY_METRICS: dict[str, tuple[str, str]] = {
    metric: (column, where_sql(condition)) for metric, (column, condition) in METRIC_CONDITIONS.items()
}
# the requests whose output tokens have times (the output rate spreads them over first token..finish)
TIMED: Condition = (("first_token_ts", 0), ("output_tokens", 0))
TIMED_OUTPUT = where_sql(TIMED)

MIN_LEVEL = 3  # a digest keeps 1 in 8 request rows
MAX_LEVEL = 12  # the last sample column holds every level from here up
LEVELS = tuple(range(MIN_LEVEL, MAX_LEVEL + 1))
EXACT_MAX_ROWS = 65_536  # a job with at most this many request rows is read row by row
SAMPLE_ROWS = 65_536  # about how many sampled rows a query at the chosen level reads

# the request columns a sampled row keeps (what the dashboard's distributions and series read)
SAMPLE_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("arrival_ts", pa.float64()), ("scheduled_ts", pa.float64()), ("first_token_ts", pa.float64()),
    ("finished_ts", pa.float64()), ("output_tokens", pa.int64()), ("ttft_s", pa.float64()),
    ("tpot_s", pa.float64()), ("e2e_s", pa.float64()), ("queue_s", pa.float64()),
)
SAMPLE_TYPE = pa.list_(pa.struct(list(SAMPLE_FIELDS)))


def sample_column(level: int) -> str:
    return f"sample_l{level}"


STAT_SUFFIXES = ("count", "sum", "min", "max")

# the digest's own columns, in order (schemas.REQUEST_DIGESTS adds the attempt's identity around them)
TOTAL_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("num_rows", pa.int64()), ("output_tokens", pa.int64()), ("num_preemptions", pa.int64()),
    ("requests_preempted", pa.int64()), ("timed_output_tokens", pa.int64()),
    ("first_token_ts_min", pa.float64()), ("timed_end_ts_max", pa.float64()),
    *((f"{metric}_{suffix}", pa.int64() if suffix == "count" else pa.float64())
      for metric in LATENCY_METRICS for suffix in STAT_SUFFIXES),
)
DIGEST_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    *TOTAL_COLUMNS, *((sample_column(level), SAMPLE_TYPE) for level in LEVELS),
)


def levels(request_ids: Sequence[str | None], sample_indexes: Sequence[int | None]) -> list[int]:
    """Each row's sampling level: trailing zero bits of BLAKE2b-64(request id, sample index)."""
    out = []
    for request_id, index in zip(request_ids, sample_indexes, strict=True):
        key = f"{request_id}\x00{index or 0}".encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        out.append(64 if h == 0 else (h & -h).bit_length() - 1)
    return out


def source_level(request_rows: int, undigested_commits: int) -> int | None:
    """Which sample level a job's request figures read: None (its rows) for a job of at most
    EXACT_MAX_ROWS request rows, or with commits whose parts have no digests (written by a batchgen
    before them: the digests' sums would be short); else `sample_level`."""
    if request_rows <= EXACT_MAX_ROWS or undigested_commits:
        return None
    return sample_level(request_rows)


def sample_level(rows: int) -> int:
    """The level whose sample of `rows` request rows holds about SAMPLE_ROWS (at least MIN_LEVEL)."""
    wanted = math.ceil(math.log2(max(rows, 1) / SAMPLE_ROWS)) if rows > SAMPLE_ROWS else 0
    return min(max(wanted, MIN_LEVEL), MAX_LEVEL)


def digest(requests: pa.Table) -> dict:
    """The digest row of one request-timing part (its `_bg_*` identity columns are the caller's)."""
    def mask(condition: Condition) -> pa.Array:
        out = None
        for column, bound in condition:
            holds = pc.greater(requests.column(column), bound)
            out = holds if out is None else pc.and_kleene(out, holds)
        return pc.fill_null(out, False)

    def total(values) -> int:
        return pc.sum(values).as_py() or 0

    timed = mask(TIMED)
    first, finished = requests.column("first_token_ts"), requests.column("finished_ts")
    row = {
        "num_rows": requests.num_rows,
        "output_tokens": total(requests.column("output_tokens")),
        "num_preemptions": total(requests.column("num_preemptions")),
        "requests_preempted": total(pc.fill_null(pc.greater(requests.column("num_preemptions"), 0), False)),
        "timed_output_tokens": total(pc.filter(requests.column("output_tokens"), timed)),
        "first_token_ts_min": pc.min(pc.filter(first, timed)).as_py(),
        "timed_end_ts_max": pc.max(pc.filter(pc.max_element_wise(finished, first), timed)).as_py(),
    }
    for metric, (column, condition) in METRIC_CONDITIONS.items():
        values = pc.filter(requests.column(column), mask(condition))
        extremes = pc.min_max(values)
        row.update({f"{metric}_count": pc.count(values).as_py(), f"{metric}_sum": pc.sum(values).as_py(),
                    f"{metric}_min": extremes["min"].as_py(), f"{metric}_max": extremes["max"].as_py()})
    level = pa.array(levels(requests.column("request_id").to_pylist(),
                            requests.column("sample_index").to_pylist()), pa.int64())
    fields = requests.select([name for name, _ in SAMPLE_FIELDS])
    for lv in LEVELS:
        at = pc.greater_equal(level, lv) if lv == MAX_LEVEL else pc.equal(level, lv)
        row[sample_column(lv)] = fields.filter(at).to_pylist()
    return row


# ---------------------------------------------------------------- reading them


SAMPLES_MACRO = "_bg.request_samples"  # (level): the sampled request rows of that level and up (catalog.py)
SAMPLE_TWIN_LEVEL = "level"  # a sample twin's column: the level of the sample column a row comes from
# what ties a sampled row to its digest's attempt: the digests' attempt id column (schemas.ATTEMPT_ID_COLUMN,
# which imports this module). A job's figures read the attempts `requests_live` picks, each whole
SAMPLE_KEY = "_bg_attempt_id"


def sample_rows_select(source: str, min_level: str | int = MIN_LEVEL) -> str:
    """The sampled request rows of level >= `min_level` (an expression: a macro's parameter, constant
    in a query, so that the sample columns below it are not read) of the digests of `source` (a
    relation with the digests' columns): one row per sampled request row, with its digest's `job_id`
    and attempt (SAMPLE_KEY), and SAMPLE_FIELDS."""
    columns = ", ".join(f"CASE WHEN {lv} >= {min_level} OR {lv} = {MAX_LEVEL} THEN {sample_column(lv)} END"
                        for lv in LEVELS)
    return (f"SELECT job_id, {SAMPLE_KEY}, unnest(s, recursive := true) FROM (SELECT job_id, {SAMPLE_KEY}, "
            f"unnest(flatten([{columns}])) AS s FROM {source})")


# The lowest level a sample twin holds: a job's figures read the twins at this level and above, those of
# a job of more than 2**(TWIN_MIN_LEVEL - 1) * SAMPLE_ROWS request rows (`sample_level`: 2.1M); a
# smaller job's read its digests' sample columns, as many as a twin would hold at its level. A twin
# holds 1 in 2**TWIN_MIN_LEVEL request rows: writing every level from MIN_LEVEL, 8 times as many, doubled
# the CPU of a merge of digests (75,704 of them: 2.0 -> 4.1 s). Raising it later is safe (a twin's lower
# levels are left unread); lowering it is not until every twin is written anew (they lack those levels)
TWIN_MIN_LEVEL = 6


def sample_twin_select(source: str) -> str:
    """The rows of the *sample twin* of a compacted digests file whose rows are `source`
    (jobs.store.rollups): the sampled request rows of its digests of level TWIN_MIN_LEVEL and up, as
    `sample_rows_select`, with the level of their sample column (SAMPLE_TWIN_LEVEL: MAX_LEVEL for every
    level from there up), highest levels first, so that a query at level L reads the twin's first row
    groups only."""
    per_level = "\n    UNION ALL ".join(
        f"SELECT job_id, {SAMPLE_KEY}, {lv}::BIGINT AS {SAMPLE_TWIN_LEVEL}, "
        f"unnest({sample_column(lv)}) AS s FROM {source}" for lv in LEVELS if lv >= TWIN_MIN_LEVEL)
    return f"""SELECT job_id, {SAMPLE_KEY}, {SAMPLE_TWIN_LEVEL}, s.* FROM (
    {per_level}
) ORDER BY {SAMPLE_TWIN_LEVEL} DESC"""


def sampled_rows_sql(level: int, digests: str = "d") -> str:
    """The sampled request rows of level >= `level` of one job ($job_id) as a relation (SAMPLE_FIELDS):
    those of the attempts in `digests` (a relation of the job's chosen digests, with SAMPLE_KEY: every
    digest of an attempt is chosen or none), from SAMPLES_MACRO, which reads them flat from the sample
    twins where the listing has them."""
    if not MIN_LEVEL <= level <= MAX_LEVEL:
        raise ValueError(f"sample level {level} is outside {MIN_LEVEL}..{MAX_LEVEL}")
    fields = ", ".join(name for name, _ in SAMPLE_FIELDS)
    return (f"SELECT {fields} FROM {SAMPLES_MACRO}({level}) AS s SEMI JOIN {digests} AS sd "
            f"USING ({SAMPLE_KEY}) WHERE s.job_id = $job_id")
