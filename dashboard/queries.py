"""The dashboard's SQL over the store's views, one named constant per question a page asks.

Every value comes in as a `$name` parameter. The only text put into SQL by formatting is a column
name picked from `LATENCY_METRICS` (a constant here), never anything from a request.

Times: `requests` and `iterations` hold epoch seconds (float); `jobs` / `shards` *_at columns are
timestamps and come out as epoch seconds (`epoch(...)`) so JSON and the browser see plain numbers.
Live figures read `requests_live` (committed rows plus each running shard's latest attempt), so a
running job's progress moves before its shards commit; for a finished job it equals `requests`.
"""

from __future__ import annotations

# ---------------------------------------------------------------- jobs

# Progress and totals of every job (or one: see JOB_SUMMARY). rows_done counts committed output rows
# plus the finished requests of attempts still running.
_JOBS_SUMMARY = """
WITH live AS (
    SELECT job_id, count(*) AS rows_live, coalesce(sum(output_tokens), 0) AS output_tokens_live
    FROM requests_live WHERE NOT committed {live_filter} GROUP BY job_id
), errors AS (
    SELECT job_id, count(*) AS error_rows
    FROM outputs WHERE finish_reason = 'error' {live_filter} GROUP BY job_id
)
SELECT j.job_id, j.status, j.model, j.num_requests, j.num_shards,
       j.shards_completed, j.shards_failed, j.shards_running,
       (j.rows_done + coalesce(l.rows_live, 0))::BIGINT AS rows_done,
       (j.output_tokens + coalesce(l.output_tokens_live, 0))::BIGINT AS output_tokens,
       j.prompt_tokens::BIGINT AS prompt_tokens,
       coalesce(e.error_rows, 0) AS error_rows, j.error,
       epoch(j.submitted_at) AS submitted_ts, epoch(j.started_at) AS started_ts,
       epoch(j.finished_at) AS finished_ts, j.config
FROM jobs AS j LEFT JOIN live AS l USING (job_id) LEFT JOIN errors AS e USING (job_id)
{job_filter}
ORDER BY j.submitted_at DESC NULLS LAST, j.job_id
LIMIT $limit
"""
JOBS_SUMMARY = _JOBS_SUMMARY.format(live_filter="", job_filter="")
JOB_SUMMARY = _JOBS_SUMMARY.format(live_filter="AND job_id = $job_id", job_filter="WHERE j.job_id = $job_id")

JOB_SHARDS = """
SELECT shard_id, status, attempts, worker_id, num_requests, rows_done, output_tokens,
       epoch(started_at) AS started_ts, epoch(finished_at) AS finished_ts, error
FROM shards WHERE job_id = $job_id ORDER BY shard_id LIMIT $limit
"""

# A sample of outputs: the first rows by request id (numeric ids in numeric order)
JOB_OUTPUTS_SAMPLE = """
SELECT * FROM outputs WHERE job_id = $job_id
ORDER BY TRY_CAST(request_id AS BIGINT) NULLS LAST, request_id LIMIT $limit
"""
JOB_OUTPUTS_ALL = """
SELECT * FROM outputs WHERE job_id = $job_id ORDER BY TRY_CAST(request_id AS BIGINT) NULLS LAST, request_id
"""

# ---------------------------------------------------------------- engine iterations of a job

# The extent of the iterations that served the job (t1 = end of the last step)
JOB_ITERATION_EXTENT = """
SELECT count(*) AS num_iterations, count(DISTINCT worker_id) AS num_workers,
       min(ts) AS t0, max(ts + duration_s) AS t1
FROM iterations WHERE list_contains(job_ids, $job_id)
"""

# One row per iteration (used while the series is short and comes from one worker)
JOB_ITERATIONS_RAW = """
SELECT ts, 1 AS iterations, num_running, num_waiting, num_scheduled_seqs, prefill_tokens, decode_tokens,
       scheduled_tokens, token_budget, max_num_seqs, kv_blocks_used, kv_blocks_total, num_preempted
FROM iterations WHERE list_contains(job_ids, $job_id) ORDER BY ts, worker_id
"""

# Time buckets of width $w from $t0: each worker's mean per iteration in the bucket, summed over the
# workers (so running sequences and KV blocks add up across the fleet); preemptions are counted.
JOB_ITERATIONS_BUCKETED = """
WITH per_worker AS (
    SELECT floor((ts - $t0) / $w)::BIGINT AS bucket, worker_id, count(*) AS iterations,
           avg(num_running) AS num_running, avg(num_waiting) AS num_waiting,
           avg(num_scheduled_seqs) AS num_scheduled_seqs, avg(prefill_tokens) AS prefill_tokens,
           avg(decode_tokens) AS decode_tokens, avg(scheduled_tokens) AS scheduled_tokens,
           avg(token_budget) AS token_budget, avg(max_num_seqs) AS max_num_seqs,
           avg(kv_blocks_used) AS kv_blocks_used, avg(kv_blocks_total) AS kv_blocks_total,
           sum(num_preempted) AS num_preempted
    FROM iterations WHERE list_contains(job_ids, $job_id)
    GROUP BY ALL
)
SELECT $t0 + bucket * $w AS ts, sum(iterations) AS iterations,
       sum(num_running) AS num_running, sum(num_waiting) AS num_waiting,
       sum(num_scheduled_seqs) AS num_scheduled_seqs, sum(prefill_tokens) AS prefill_tokens,
       sum(decode_tokens) AS decode_tokens, sum(scheduled_tokens) AS scheduled_tokens,
       sum(token_budget) AS token_budget, sum(max_num_seqs) AS max_num_seqs,
       sum(kv_blocks_used) AS kv_blocks_used, sum(kv_blocks_total) AS kv_blocks_total,
       sum(num_preempted) AS num_preempted
FROM per_worker GROUP BY bucket ORDER BY bucket
"""

# Request concurrency of the job at each time in $points: requests that have arrived at an engine
# and not finished (waiting or running there) -- not the same thing as running sequences.
JOB_OUTSTANDING_AT = """
WITH pts AS (SELECT i, $points[i] AS t FROM range(1, len($points) + 1) AS r(i)),
r AS (
    SELECT arrival_ts, CASE WHEN finished_ts > 0 THEN finished_ts ELSE 'infinity'::DOUBLE END AS finished_ts
    FROM requests_live WHERE job_id = $job_id AND arrival_ts > 0
)
SELECT pts.t AS ts, count(r.arrival_ts) AS outstanding_requests
FROM pts LEFT JOIN r ON r.arrival_ts <= pts.t AND r.finished_ts > pts.t
GROUP BY pts.i, pts.t ORDER BY pts.i
"""

# ---------------------------------------------------------------- output tokens of a job over time

JOB_OUTPUT_EXTENT = """
SELECT count(*) AS num_requests, min(first_token_ts) AS t0, max(greatest(finished_ts, first_token_ts)) AS t1,
       coalesce(sum(output_tokens), 0) AS output_tokens
FROM requests_live WHERE job_id = $job_id AND first_token_ts > 0 AND output_tokens > 0
"""

# Output tokens/s of the job in $n buckets of width $w from $t0. A request's first token counts at
# first_token_ts, its other output_tokens - 1 spread evenly over (first_token_ts, finished_ts]; so the
# buckets add up exactly to the job's output tokens.
JOB_OUTPUT_RATE = """
WITH r AS (
    SELECT first_token_ts AS t0, greatest(finished_ts, first_token_ts) AS t1, output_tokens AS n
    FROM requests_live WHERE job_id = $job_id AND first_token_ts > 0 AND output_tokens > 0
), b AS (
    SELECT i, $t0 + i * $w AS lo, $t0 + (i + 1) * $w AS hi FROM range($n) AS t(i)
)
SELECT b.lo AS ts, coalesce(sum(
        CASE WHEN r.t0 >= b.lo AND r.t0 < b.hi THEN 1 ELSE 0 END
      + CASE WHEN r.t1 > r.t0
             THEN (r.n - 1) * greatest(least(b.hi, r.t1) - greatest(b.lo, r.t0), 0) / (r.t1 - r.t0)
             WHEN r.t0 >= b.lo AND r.t0 < b.hi THEN r.n - 1
             ELSE 0 END), 0) / $w AS output_tokens_per_s
FROM b LEFT JOIN r ON r.t0 < b.hi AND r.t1 >= b.lo
GROUP BY b.i, b.lo ORDER BY b.i
"""

# ---------------------------------------------------------------- latency distributions

# metric -> (column of requests_live, which requests it is defined for)
LATENCY_METRICS: dict[str, tuple[str, str]] = {
    "ttft_s": ("ttft_s", "first_token_ts > 0"),
    "itl_s": ("tpot_s", "output_tokens > 1 AND first_token_ts > 0"),
    "e2e_s": ("e2e_s", "finished_ts > 0"),
    "queue_s": ("queue_s", "scheduled_ts > 0"),
}

_LATENCY_SUMMARY = """
SELECT count(*) AS count, avg({column}) AS mean, min({column}) AS min, max({column}) AS max,
       quantile_cont({column}, 0.5) AS p50, quantile_cont({column}, 0.9) AS p90,
       quantile_cont({column}, 0.99) AS p99
FROM requests_live WHERE job_id = $job_id AND {where}
"""

_LATENCY_HISTOGRAM = """
WITH x AS (SELECT {column} AS v FROM requests_live WHERE job_id = $job_id AND {where})
SELECT least(floor((v - $lo) / $width)::BIGINT, $bins - 1) AS bin, count(*) AS count
FROM x GROUP BY bin ORDER BY bin
"""


def latency_summary_sql(metric: str) -> str:
    column, where = LATENCY_METRICS[metric]
    return _LATENCY_SUMMARY.format(column=column, where=where)


def latency_histogram_sql(metric: str) -> str:
    column, where = LATENCY_METRICS[metric]
    return _LATENCY_HISTOGRAM.format(column=column, where=where)


JOB_PREEMPTIONS = """
SELECT coalesce(sum(num_preemptions), 0)::BIGINT AS request_preemptions,
       count(*) FILTER (WHERE num_preemptions > 0) AS requests_preempted
FROM requests_live WHERE job_id = $job_id
"""

# ---------------------------------------------------------------- workers

# Every worker seen in telemetry: its last iteration (the heartbeat), the limits in force then, and
# its decode tokens over the last $window_s seconds before $now.
WORKERS = """
SELECT worker_id, count(*) AS iterations, max(ts + duration_s) AS last_seen_ts, min(ts) AS first_seen_ts,
       arg_max(max_num_seqs, ts) AS max_num_seqs, arg_max(token_budget, ts) AS token_budget,
       arg_max(kv_blocks_total, ts) AS kv_blocks_total, arg_max(kv_blocks_used, ts) AS kv_blocks_used,
       arg_max(num_running, ts) AS num_running, arg_max(num_waiting, ts) AS num_waiting,
       coalesce(sum(decode_tokens) FILTER (WHERE ts >= $now - $window_s), 0) / $window_s
           AS recent_decode_tokens_per_s,
       coalesce(sum(scheduled_tokens) FILTER (WHERE ts >= $now - $window_s), 0) / $window_s
           AS recent_scheduled_tokens_per_s,
       sum(decode_tokens) / greatest(max(ts + duration_s) - min(ts), 1e-9) AS lifetime_decode_tokens_per_s,
       sum(num_preempted) AS preemptions
FROM iterations GROUP BY worker_id ORDER BY last_seen_ts DESC
"""

# Shards a worker is running now, and the job (and its config) it ran most recently
WORKER_SHARDS = """
SELECT worker_id, job_id, shard_id, status, attempts, epoch(started_at) AS started_ts
FROM shards WHERE worker_id IS NOT NULL AND status = 'running' ORDER BY worker_id, job_id, shard_id
"""
WORKER_LATEST_JOB = """
SELECT s.worker_id, arg_max(s.job_id, s.started_at) AS job_id, arg_max(j.config, s.started_at) AS config,
       arg_max(j.model, s.started_at) AS model
FROM shards AS s JOIN jobs AS j USING (job_id)
WHERE s.worker_id IS NOT NULL AND s.started_at IS NOT NULL GROUP BY s.worker_id
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
