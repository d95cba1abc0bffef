"""The dashboard's SQL over the store's views, one named constant per question a page asks.

Every value comes in as a `$name` parameter. The only text put into SQL by formatting is constants:
column names and conditions from `jobs.store.digests` (`LATENCY_METRICS`), sample levels, never anything
from a request.

Times: `requests` and `iterations` hold epoch seconds (float); `jobs` / `shards` *_at columns are
timestamps and come out as epoch seconds (`epoch(...)`) so JSON and the browser see plain numbers.
Live figures read `requests_live` (committed rows plus each running shard's latest attempt), so a
running job's progress moves before its shards commit; for a finished job it equals `requests`. Its
totals, and the distributions and series of a large job, read the request digests of the same
attempts instead (`_bg.request_digests_live`, jobs.store.digests): one row per part, not per request.
"""

from __future__ import annotations

from jobs.store import (
    DIGEST_LEVELS,
    JOB_SHARDS_CTES,
    LATENCY_METRICS,
    ROLLUP_AVERAGED,
    ROLLUP_LATEST,
    ROLLUP_SUMMED,
    SHARD_WORKERS,
    SHARDS_PAGE,
    SHARDS_PAGE_ORDER,
    TIMED_OUTPUT,
    UNCOMMITTED_DIGESTS,
    WORKER_LATEST_SHARDS,
    over_scans,
    sampled_rows_sql,
)

# ---------------------------------------------------------------- jobs

# Progress and totals of every job (or one: see JOB_SUMMARY). rows_done is the larger of the committed
# output rows and the finished requests of `requests_live` (committed shards plus the latest attempt of
# running ones): the winning commits' request rows, and the digests of the shards without one
# (`UNCOMMITTED_DIGESTS`); output tokens alike (the commits' are their outputs'). Both sides read the one
# computation of the winning commits (`once` below), so a shard counts on exactly one side; two reads of
# the commits could straddle a shard's commit and count it on both or neither. error_rows: the winning
# commits carry their output rows with finish_reason 'error' (`jobs.error_rows`); a job with commits
# written before they did (`counts_complete` false) is counted from the outputs instead (the _SCAN
# variants, which dashboard.data runs for such jobs). The views are inlined, each computed once
# (`over_scans`): the jobs and the live figures read the winning commits alike.
_JOBS_SUMMARY = """
WITH live AS (
    SELECT job_id, sum(n) AS rows_live, coalesce(sum(t), 0) AS output_tokens_live FROM (
        SELECT job_id, num_request_rows AS n, output_tokens AS t FROM _bg.winners
        UNION ALL
        SELECT job_id, num_rows, output_tokens FROM ({uncommitted})
    ) {live_where} GROUP BY job_id
){errors}
SELECT j.job_id, j.status, j.model, j.num_requests, j.num_shards,
       j.shards_completed, j.shards_failed, j.shards_running,
       greatest(j.rows_done, coalesce(l.rows_live, 0))::BIGINT AS rows_done,
       greatest(j.output_tokens, coalesce(l.output_tokens_live, 0))::BIGINT AS output_tokens,
       j.prompt_tokens::BIGINT AS prompt_tokens,
       {error_rows} AS error_rows, j.error,
       epoch(j.submitted_at) AS submitted_ts, epoch(j.started_at) AS started_ts,
       epoch(j.finished_at) AS finished_ts, j.config, j.counts_complete
FROM _bg_jobs AS j LEFT JOIN live AS l USING (job_id){errors_join}
{job_filter}
ORDER BY j.submitted_at DESC NULLS LAST, j.job_id
LIMIT $limit
"""
_ERRORS_SCAN = """, errors AS (
    SELECT job_id, count(*) AS error_rows
    FROM outputs WHERE finish_reason = 'error' {error_filter} GROUP BY job_id
)"""
_ONE_JOB = {"live_where": "WHERE job_id = $job_id", "job_filter": "WHERE j.job_id = $job_id",
            "uncommitted": UNCOMMITTED_DIGESTS}
_EVERY_JOB = {"live_where": "", "job_filter": "", "uncommitted": UNCOMMITTED_DIGESTS}
_FROM_COMMITS = {"errors": "", "error_rows": "j.error_rows", "errors_join": ""}
_FROM_OUTPUTS = {"error_rows": "coalesce(e.error_rows, 0)",
                 "errors_join": " LEFT JOIN errors AS e USING (job_id)"}
_SUMMARY_ORDER = " ORDER BY submitted_ts DESC NULLS LAST, job_id"
JOBS_SUMMARY = over_scans(_JOBS_SUMMARY.format(**_EVERY_JOB, **_FROM_COMMITS), once=True) + _SUMMARY_ORDER
JOB_SUMMARY = over_scans(_JOBS_SUMMARY.format(**_ONE_JOB, **_FROM_COMMITS), once=True) + _SUMMARY_ORDER
JOBS_SUMMARY_SCAN = over_scans(_JOBS_SUMMARY.format(**_EVERY_JOB, **_FROM_OUTPUTS,
                                                    errors=_ERRORS_SCAN.format(error_filter="")),
                               once=True) + _SUMMARY_ORDER
JOB_SUMMARY_SCAN = over_scans(_JOBS_SUMMARY.format(
    **_ONE_JOB, **_FROM_OUTPUTS, errors=_ERRORS_SCAN.format(error_filter="AND job_id = $job_id")),
    once=True) + _SUMMARY_ORDER

# One page of a job's shards: the ones that need a look first (failed, then running), then the
# rest by id; `$status` (NULL = every status) narrows the list to one status. The `shards` view's rows
# of the page only (`SHARDS_PAGE`: no row made for each committed shard off the page)
JOB_SHARDS_PAGE = f"""
SELECT shard_id, status, attempts, worker_id, num_requests, rows_done, output_tokens,
       epoch(started_at) AS started_ts, epoch(finished_at) AS finished_ts, error
FROM ({SHARDS_PAGE}) ORDER BY {SHARDS_PAGE_ORDER}
"""
# (from `_bg.shard_status_counts`: the `shards` rows' counts, without a row per committed shard)
JOB_SHARD_COUNTS = "SELECT status, n FROM _bg.shard_status_counts WHERE job_id = $job_id"
# the workers that ran a job's shards (one row each, however many shards; `SHARD_WORKERS`: no row made
# for each committed shard)
JOB_SHARD_WORKERS = SHARD_WORKERS

# A sample of outputs: the first committed shards' rows (as many shards as hold $limit rows), first by
# request id (numeric ids in numeric order). Shards are cut in input order, so these are the first
# input rows that are done. JOB_SAMPLE_SHARDS picks the shards from the winning commits; the sample
# reads only those shards' rows (`_bg.outputs_of_shards`, jobs.store.catalog), however large the job.
JOB_SAMPLE_SHARDS = """
WITH w AS (
    SELECT shard_id,
           sum(num_outputs) OVER (ORDER BY shard_id ROWS UNBOUNDED PRECEDING) - num_outputs AS before
    FROM _bg.winners WHERE job_id = $job_id
)
SELECT min(shard_id) AS lo, max(shard_id) AS hi FROM w WHERE before < $limit
"""
JOB_OUTPUTS_SAMPLE = """
SELECT * FROM _bg.outputs_of_shards($job_id, $lo, $hi)
ORDER BY TRY_CAST(request_id AS BIGINT) NULLS LAST, request_id LIMIT $limit
"""
JOB_OUTPUTS_ALL = """
SELECT * FROM outputs WHERE job_id = $job_id ORDER BY TRY_CAST(request_id AS BIGINT) NULLS LAST, request_id
"""

# ---------------------------------------------------------------- engine iterations of a job

# The engine iterations that served the job, in one scan: one row per iteration while there are at
# most $max_points of them from one worker; otherwise time buckets of width `bucket_s` (span /
# $max_points), each worker's mean per iteration in the bucket, summed over the workers (so running
# sequences and KV blocks add up across the fleet). Preemptions are counted, not averaged. Every row
# repeats the extent (num_iterations, num_workers, downsampled, bucket_s); the caller takes it once.
# The two forms are two branches of one UNION ALL, so that only the series of at most $max_points
# iterations numbers its rows (a window over every iteration of a large job cost a third of the query).
JOB_ITERATIONS = """
WITH it AS MATERIALIZED (
    SELECT ts, duration_s, worker_id, num_running, num_waiting, num_scheduled_seqs, prefill_tokens,
           decode_tokens, scheduled_tokens, token_budget, max_num_seqs, kv_blocks_used, kv_blocks_total,
           num_preempted, num_constrained_seqs, mask_fill_s
    FROM iterations WHERE list_contains(job_ids, $job_id) AND ts BETWEEN $t0 AND $t_end
), extent AS (
    SELECT count(*) AS num_iterations, count(DISTINCT worker_id) AS num_workers, min(ts) AS t0,
           NOT (count(*) <= $max_points AND count(DISTINCT worker_id) = 1) AS downsampled,
           greatest(max(ts + duration_s) - min(ts), 1e-6) * (1 + 1e-9) / $max_points AS bucket_s
    FROM it
), bucketed AS (
    SELECT floor((it.ts - e.t0) / e.bucket_s)::BIGINT AS bucket, it.*
    FROM it, extent AS e WHERE e.downsampled
    UNION ALL
    SELECT row_number() OVER (ORDER BY it.ts) AS bucket, it.*
    FROM it, extent AS e WHERE NOT e.downsampled
), per_worker AS (
    SELECT bucket, worker_id, min(ts) AS first_ts, count(*) AS iterations,
           avg(num_running) AS num_running, avg(num_waiting) AS num_waiting,
           avg(num_scheduled_seqs) AS num_scheduled_seqs, avg(prefill_tokens) AS prefill_tokens,
           avg(decode_tokens) AS decode_tokens, avg(scheduled_tokens) AS scheduled_tokens,
           avg(token_budget) AS token_budget, avg(max_num_seqs) AS max_num_seqs,
           avg(kv_blocks_used) AS kv_blocks_used, avg(kv_blocks_total) AS kv_blocks_total,
           sum(num_preempted) AS num_preempted, avg(num_constrained_seqs) AS num_constrained_seqs,
           avg(mask_fill_s) AS mask_fill_s
    FROM bucketed GROUP BY bucket, worker_id
)
SELECT CASE WHEN any_value(e.downsampled) THEN any_value(e.t0) + bucket * any_value(e.bucket_s)
            ELSE min(first_ts) END AS ts,
       sum(iterations) AS iterations,
       sum(num_running) AS num_running, sum(num_waiting) AS num_waiting,
       sum(num_scheduled_seqs) AS num_scheduled_seqs, sum(prefill_tokens) AS prefill_tokens,
       sum(decode_tokens) AS decode_tokens, sum(scheduled_tokens) AS scheduled_tokens,
       sum(token_budget) AS token_budget, sum(max_num_seqs) AS max_num_seqs,
       sum(kv_blocks_used) AS kv_blocks_used, sum(kv_blocks_total) AS kv_blocks_total,
       sum(num_preempted) AS num_preempted, sum(num_constrained_seqs) AS num_constrained_seqs,
       sum(mask_fill_s) AS mask_fill_s,
       any_value(e.num_iterations) AS num_iterations, any_value(e.num_workers) AS num_workers,
       any_value(e.downsampled) AS downsampled, any_value(e.bucket_s) AS bucket_s
FROM per_worker, extent AS e GROUP BY bucket ORDER BY bucket
"""
# the columns of JOB_ITERATIONS(_ROLLED) that describe the whole series, not a point
ITERATION_EXTENT_COLUMNS = ("num_iterations", "num_workers", "downsampled", "bucket_s")

# The same series from the per-second rollups of the iterations (`_bg.iteration_seconds`,
# jobs.store.rollups): buckets of whole seconds from the whole second before the first iteration, as
# many as fit in $max_points, each worker's mean per iteration in the bucket (sum over count of its
# rollups) summed over the workers: JOB_ITERATIONS's answer on that grid, exactly. Its rows also carry
# the extent of the job's iterations (t0: the first start, t_end: the last end) and `rolled`: whether
# this is the series to draw (downsampled, and buckets of at least a second: a span of $max_points
# seconds or more); otherwise JOB_ITERATIONS answers, over the rows of [t0, t_end] only (a long-finished
# job's iterations then come from few row groups of the compacted files, sorted by time).
JOB_ITERATIONS_ROLLED = f"""
WITH r AS MATERIALIZED (
    SELECT * FROM _bg.iteration_seconds WHERE list_contains(job_ids, $job_id)
), grid AS (
    SELECT *, floor((t_end - b0) / $max_points) + 1 AS bucket_s,
           NOT (num_iterations <= $max_points AND num_workers = 1) AS downsampled,
           NOT (num_iterations <= $max_points AND num_workers = 1) AND t_end - t0 >= $max_points AS rolled
    FROM (SELECT sum(iterations) AS num_iterations, count(DISTINCT worker_id) AS num_workers,
                 min(first_ts) AS t0, max(last_end) AS t_end, floor(min(first_ts)) AS b0
          FROM r) WHERE num_iterations > 0
), per_worker AS (
    SELECT floor((r.second - g.b0) / g.bucket_s)::BIGINT AS bucket, r.worker_id,
           sum(r.iterations) AS iterations,
           {", ".join(f"sum(r.sum_{c}) / sum(r.n_{c}) AS {c}" for c in ROLLUP_AVERAGED)},
           {", ".join(f"sum(r.{c}) AS {c}" for c in ROLLUP_SUMMED)}
    FROM r, grid AS g GROUP BY bucket, r.worker_id
)
SELECT any_value(g.b0) + bucket * any_value(g.bucket_s) AS ts, sum(iterations) AS iterations,
       {", ".join(f"sum({c}) AS {c}" for c in (*ROLLUP_AVERAGED, *ROLLUP_SUMMED))},
       any_value(g.num_iterations) AS num_iterations, any_value(g.num_workers) AS num_workers,
       any_value(g.downsampled) AS downsampled, any_value(g.bucket_s) AS bucket_s,
       any_value(g.t0) AS t0, any_value(g.t_end) AS t_end, any_value(g.rolled) AS rolled
FROM per_worker, grid AS g GROUP BY bucket ORDER BY bucket
"""

# ---------------------------------------------------------------- a job's requests: rows or sample

# Where the request figures below come from (jobs.store.digests). Every query over a job's requests
# comes in two forms: EXACT reads its rows in `requests_live`; SAMPLED[level] reads the sampled rows of
# level >= level in the job's request digests and scales what it counts to the exact totals the
# digests carry. `JOB_REQUEST_DIGESTS` tells which to run (dashboard.series.request_source): the rows
# of a job with few of them, or with commits whose parts have no digests (written by an older batchgen).
JOB_REQUEST_DIGESTS = over_scans("""
WITH d AS MATERIALIZED (
    SELECT _bg_attempt_id, committed, num_rows FROM _bg.request_digests_live WHERE job_id = $job_id
), c AS (
    SELECT _bg_attempt_id, sum(num_rows) AS n FROM d WHERE committed GROUP BY _bg_attempt_id
)
SELECT (SELECT coalesce(sum(num_rows), 0) FROM d)::BIGINT AS request_rows,
       (SELECT count(*) FROM _bg.winners AS w LEFT JOIN c USING (_bg_attempt_id)
        WHERE w.job_id = $job_id AND coalesce(c.n, 0) <> w.num_request_rows) AS undigested_commits
""", once=True)  # the winning commits computed once for both

_ROWS = "SELECT * FROM requests_live WHERE job_id = $job_id"
_DIGESTS = "d AS MATERIALIZED (SELECT * FROM _bg.request_digests_live WHERE job_id = $job_id),"


def _exact_and_sampled(build) -> tuple[str, dict[int, str]]:
    """`build(inputs, rows, level)` over the rows (level None), and over each level's sample."""
    return (build("", _ROWS, None),
            {level: build(_DIGESTS, sampled_rows_sql(level, "d"), level) for level in DIGEST_LEVELS})


# Request concurrency of the job at each time in $points: requests that have arrived at an engine
# and not finished (waiting or running there) -- not the same thing as running sequences. One sort of
# the arrivals (+1) and finishes (-1) with the points among them: at a point, the running sum counts
# the arrivals at or before it less the finishes at or before it (events sort before a point at the
# same time); a request not finished yet never counts as a finish. Sampled: each sampled request
# stands for 2**level.
def _outstanding_at(inputs: str, rows: str, level: int | None) -> str:
    scale = 1 if level is None else 2 ** level
    return f"""
WITH {inputs} pts AS (SELECT i, $points[i] AS t FROM range(1, len($points) + 1) AS r(i)),
r AS MATERIALIZED (
    SELECT arrival_ts, finished_ts FROM ({rows}) WHERE arrival_ts > 0
), ev AS (
    SELECT arrival_ts AS t, 1 AS d, NULL::BIGINT AS i FROM r
    UNION ALL SELECT finished_ts, -1, NULL FROM r WHERE finished_ts > 0
    UNION ALL SELECT t, 0, i FROM pts
), counted AS (
    SELECT i, t, sum(d) OVER (ORDER BY t, i NULLS FIRST ROWS UNBOUNDED PRECEDING) AS n FROM ev
)
SELECT t AS ts, (n * {scale})::BIGINT AS outstanding_requests FROM counted WHERE i IS NOT NULL ORDER BY i
"""


JOB_OUTSTANDING_AT, JOB_OUTSTANDING_AT_SAMPLED = _exact_and_sampled(_outstanding_at)

# ---------------------------------------------------------------- output tokens of a job over time


# Output tokens/s of the job in $n equal buckets spanning its first to its last output token. A
# request's first token counts at first_token_ts, its other output_tokens - 1 spread evenly over
# (first_token_ts, finished_ts]; so rate * bucket_s adds up exactly to the job's output tokens.
# Sampled: the span and the total are the digests' (exact), and the sample's tokens are scaled to
# that total.
def _output_rate(inputs: str, rows: str, level: int | None) -> str:
    extent = ("SELECT min(t0) AS start, greatest(max(t1) - min(t0), 1e-6) * (1 + 1e-9) / $n AS w, "
              "sum(n) AS total, 1.0 AS scale FROM r HAVING count(*) > 0")
    if level is not None:
        extent = ("SELECT min(first_token_ts_min) AS start, "
                  "greatest(max(timed_end_ts_max) - min(first_token_ts_min), 1e-6) * (1 + 1e-9) / $n AS w, "
                  "sum(timed_output_tokens) AS total, "
                  "sum(timed_output_tokens) / (SELECT sum(n) FROM r) AS scale "
                  "FROM d HAVING sum(timed_output_tokens) > 0")
    return f"""
WITH {inputs} r AS MATERIALIZED (
    SELECT first_token_ts AS t0, greatest(finished_ts, first_token_ts) AS t1, output_tokens AS n
    FROM ({rows}) WHERE {TIMED_OUTPUT}
), e AS (
    {extent}
), b AS (
    SELECT i, start + i * w AS lo, start + (i + 1) * w AS hi, w, total, scale FROM e, range($n) AS t(i)
)
SELECT b.lo AS ts, coalesce(sum(
        CASE WHEN r.t0 >= b.lo AND r.t0 < b.hi THEN 1 ELSE 0 END
      + CASE WHEN r.t1 > r.t0
             THEN (r.n - 1) * greatest(least(b.hi, r.t1) - greatest(b.lo, r.t0), 0) / (r.t1 - r.t0)
             WHEN r.t0 >= b.lo AND r.t0 < b.hi THEN r.n - 1
             ELSE 0 END), 0) * any_value(b.scale) / any_value(b.w) AS output_tokens_per_s,
       any_value(b.w) AS bucket_s, any_value(b.total)::BIGINT AS output_tokens
FROM b LEFT JOIN r ON r.t0 < b.hi AND r.t1 >= b.lo
GROUP BY b.i, b.lo ORDER BY b.i
"""


JOB_OUTPUT_RATE, JOB_OUTPUT_RATE_SAMPLED = _exact_and_sampled(_output_rate)

# ---------------------------------------------------------------- latency distributions

_METRIC_VALUES = "\n    UNION ALL ".join(
    f"SELECT '{metric}' AS metric, {column} AS v FROM r WHERE {where}"
    for metric, (column, where) in LATENCY_METRICS.items()
)
_METRIC_TOTALS = "\n    UNION ALL ".join(
    f"SELECT '{m}' AS metric, sum({m}_count) AS count, sum({m}_sum) / nullif(sum({m}_count), 0) AS mean, "
    f"min({m}_min) AS min, max({m}_max) AS max FROM d"
    for m in LATENCY_METRICS
)


# Per metric: count, mean, min, max, p50 / p90 / p99, and a histogram of $bins equal bins from min
# to max (bin i covers [min + i * width, min + (i + 1) * width), width = max(max - min, 1e-9) / $bins;
# the maximum falls in the last bin). `bins` lists the non-empty bins, `counts` their requests.
# `sampled_count`: the sampled requests the percentiles and histogram come from (NULL: every request).
# Sampled: count, mean, min and max are the digests' (exact); the percentiles are the sample's (kept
# within min..max), its histogram counts scaled to the exact count.
def _latency(inputs: str, rows: str, level: int | None) -> str:
    if level is None:
        stats = ("SELECT metric, count(*) AS count, avg(v) AS mean, min(v) AS min, max(v) AS max FROM x "
                 "GROUP BY metric")
        count_of_bin, sampled = "n", "NULL::BIGINT"
    else:
        stats = f"SELECT * FROM ({_METRIC_TOTALS}) WHERE count > 0"
        count_of_bin, sampled = "round(h.n * s.count / q.sampled_count)::BIGINT", "q.sampled_count"
    return f"""
WITH {inputs} r AS MATERIALIZED (
    SELECT ttft_s, tpot_s, e2e_s, queue_s, first_token_ts, scheduled_ts, finished_ts, output_tokens
    FROM ({rows})
), x AS (
    {_METRIC_VALUES}
), s AS (
    SELECT *, greatest(max - min, 1e-9) / $bins AS width FROM ({stats})
), q AS (
    SELECT metric, count(*) AS sampled_count, quantile_cont(v, 0.5) AS p50, quantile_cont(v, 0.9) AS p90,
           quantile_cont(v, 0.99) AS p99
    FROM x GROUP BY metric
), h AS (
    SELECT x.metric, least(greatest(floor((x.v - s.min) / s.width), 0)::BIGINT, $bins - 1) AS bin,
           count(*) AS n
    FROM x JOIN s USING (metric) GROUP BY ALL
), hist AS (
    SELECT h.metric, list(h.bin ORDER BY h.bin) AS bins, list({count_of_bin} ORDER BY h.bin) AS counts
    FROM h JOIN s USING (metric) JOIN q USING (metric) GROUP BY h.metric
)
SELECT s.metric, s.count, s.mean, s.min, s.max, greatest(least(q.p50, s.max), s.min) AS p50,
       greatest(least(q.p90, s.max), s.min) AS p90, greatest(least(q.p99, s.max), s.min) AS p99, s.width,
       hist.bins, hist.counts, {sampled} AS sampled_count
FROM s LEFT JOIN q USING (metric) LEFT JOIN hist USING (metric)
"""


JOB_LATENCY, JOB_LATENCY_SAMPLED = _exact_and_sampled(_latency)

# Preemptions of the job's requests: the digests' sums (exact), or the rows of a job with commits
# that have no digests (`JOB_REQUEST_DIGESTS`)
JOB_PREEMPTIONS = """
SELECT coalesce(sum(num_preemptions), 0)::BIGINT AS request_preemptions,
       coalesce(sum(requests_preempted), 0)::BIGINT AS requests_preempted
FROM _bg.request_digests_live WHERE job_id = $job_id
"""
JOB_PREEMPTIONS_SCAN = """
SELECT coalesce(sum(num_preemptions), 0)::BIGINT AS request_preemptions,
       count(*) FILTER (WHERE num_preemptions > 0) AS requests_preempted
FROM requests_live WHERE job_id = $job_id
"""

# Queries whose answer depends on the rows of their $job_id alone: they are run over a listing of
# that job's parts only (jobs.store.run_query's job_id), so a job's page opens none of the other
# jobs' files however many the data dir holds
JOB_SCOPED = frozenset({
    JOB_SUMMARY, JOB_SUMMARY_SCAN, JOB_SHARDS_PAGE, JOB_SHARD_COUNTS, JOB_SHARD_WORKERS,
    JOB_SAMPLE_SHARDS, JOB_OUTPUTS_SAMPLE, JOB_OUTPUTS_ALL, JOB_ITERATIONS, JOB_ITERATIONS_ROLLED,
    JOB_REQUEST_DIGESTS,
    JOB_OUTSTANDING_AT, JOB_OUTPUT_RATE, JOB_LATENCY, JOB_PREEMPTIONS, JOB_PREEMPTIONS_SCAN,
    *JOB_OUTSTANDING_AT_SAMPLED.values(), *JOB_OUTPUT_RATE_SAMPLED.values(), *JOB_LATENCY_SAMPLED.values(),
})


def job_scope(sql: str, params) -> str | None:
    """The job whose parts alone `sql` reads with `params` (a JOB_SCOPED query's $job_id), else None."""
    return params.get("job_id") if isinstance(params, dict) and sql in JOB_SCOPED else None

# ---------------------------------------------------------------- workers

# Every worker seen in telemetry: its last iteration (the heartbeat), the limits in force then, and its
# decode tokens over the recent window: the whole seconds from floor($now) - $window_s on, per second
# of that span (up to $now: $window_s plus the fraction of the current second). From the per-second
# rollups of the iterations (`_bg.iteration_seconds`), whose values at each rollup's last iteration give
# the worker's latest: one row per worker, second and part, not one per iteration.
WORKERS = f"""
SELECT worker_id, sum(iterations) AS iterations, max(last_end) AS last_seen_ts,
       min(first_ts) AS first_seen_ts,
       {", ".join(f"arg_max(last_{c}, last_ts) AS {c}" for c in ROLLUP_LATEST)},
       coalesce(sum(sum_decode_tokens) FILTER (WHERE second >= floor($now) - $window_s), 0)
           / ($now - floor($now) + $window_s) AS recent_decode_tokens_per_s,
       coalesce(sum(sum_scheduled_tokens) FILTER (WHERE second >= floor($now) - $window_s), 0)
           / ($now - floor($now) + $window_s) AS recent_scheduled_tokens_per_s,
       sum(sum_decode_tokens) / greatest(max(last_end) - min(first_ts), 1e-9) AS lifetime_decode_tokens_per_s,
       sum(num_preempted) AS preemptions
FROM _bg.iteration_seconds GROUP BY worker_id ORDER BY last_seen_ts DESC
"""

# Shards a worker is running now, and the job (and its config) it ran most recently. The job's config
# and model are its record's (as the `jobs` view has them), read from the records, not from `jobs`,
# whose shard counts would read every shard a second time. A running shard has no winning commit: its
# row is among those `JOB_SHARDS_CTES` makes (`u`), not one per committed shard
WORKER_SHARDS = f"""
WITH {JOB_SHARDS_CTES}
SELECT worker_id, job_id, shard_id, status, attempts, epoch(started_at) AS started_ts
FROM u WHERE worker_id IS NOT NULL AND status = 'running' ORDER BY worker_id, job_id, shard_id
"""
WORKER_LATEST_JOB = f"""
SELECT s.worker_id, s.job_id, j.config, j.model
FROM ({WORKER_LATEST_SHARDS}) AS s LEFT JOIN _bg.job_records AS j USING (job_id)
"""

# ---------------------------------------------------------------- /metrics

JOB_STATUS_COUNTS = over_scans("SELECT status, count(*) AS n FROM _bg_jobs GROUP BY status", once=True)
SHARD_STATUS_COUNTS = "SELECT status, sum(n)::BIGINT AS n FROM _bg.shard_status_counts GROUP BY status"
ROWS_COMMITTED = over_scans("SELECT coalesce(sum(rows_done), 0)::BIGINT AS n FROM _bg_jobs", once=True)
JOB_SHARD_STATUS_COUNTS = """
SELECT job_id, status, n FROM _bg.shard_status_counts WHERE list_contains($job_ids, job_id)
"""

# ---------------------------------------------------------------- sweeps

# One row per measured configuration, repeats averaged
SWEEP_CONFIGURATIONS = """
SELECT sweep_id, swept, model, max_num_seqs, max_num_batched_tokens, count(*) AS repeats,
       max(ts) AS ts, avg(num_requests) AS num_requests,
       avg(output_tokens_per_s) AS output_tokens_per_s, avg(processed_tokens_per_s) AS processed_tokens_per_s,
       avg(ttft_p50_s) AS ttft_p50_s, avg(ttft_p99_s) AS ttft_p99_s,
       avg(itl_p50_s) AS itl_p50_s, avg(itl_p99_s) AS itl_p99_s,
       avg(e2e_p50_s) AS e2e_p50_s, avg(e2e_p99_s) AS e2e_p99_s,
       avg(mean_running) AS mean_running, avg(mean_budget_utilisation) AS mean_budget_utilisation,
       sum(num_preemptions) AS num_preemptions
FROM sweeps GROUP BY sweep_id, swept, model, max_num_seqs, max_num_batched_tokens
ORDER BY sweep_id, swept, output_tokens_per_s
LIMIT $limit
"""
