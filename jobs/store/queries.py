"""Named queries over the views: what the dashboard runs, and the README's example queries.

`QUERIES` maps a name to SQL with `$name` parameters; `run_named(con, "job_latency", job_id="j1")`
runs one with `run_query`'s time limit and row cap. `README_EXAMPLES` holds the five queries the
README shows for `batchgen sql` (with a literal job id to replace).

Timestamps: `iterations.ts` and the `requests` *_ts columns are epoch seconds (float); `jobs` and
`shards` *_at columns are TIMESTAMP WITH TIME ZONE.
"""

from __future__ import annotations

from typing import Any

import duckdb

from jobs.store.usersql import DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT_S, QueryResult, run_query

QUERIES: dict[str, str] = {
    # the jobs page: newest first
    "jobs_overview": """
        SELECT job_id, status, model, num_requests, num_shards, shards_completed, shards_failed,
               rows_done, output_tokens, submitted_at, started_at, finished_at, error
        FROM jobs ORDER BY submitted_at DESC NULLS LAST, job_id LIMIT 200""",
    "job_detail": "SELECT * FROM jobs WHERE job_id = $job_id",
    "job_shards": "SELECT * FROM shards WHERE job_id = $job_id ORDER BY shard_id",
    # live progress: committed rows plus the latest attempt of each running shard
    "job_progress": """
        SELECT count(*) AS requests_finished,
               count(*) FILTER (WHERE committed) AS requests_committed,
               coalesce(sum(output_tokens), 0) AS output_tokens,
               max(finished_ts) AS last_finished_ts
        FROM requests_live WHERE job_id = $job_id""",
    # engine tokens per second, per minute, over the iterations that served the job
    "job_tokens_per_minute": """
        SELECT date_trunc('minute', to_timestamp(ts)) AS minute,
               sum(decode_tokens) / 60.0 AS output_tokens_per_s,
               sum(scheduled_tokens) / 60.0 AS processed_tokens_per_s,
               count(*) AS iterations
        FROM iterations WHERE list_contains(job_ids, $job_id)
        GROUP BY minute ORDER BY minute""",
    "job_latency": """
        SELECT count(*) AS requests,
               quantile_cont(ttft_s, 0.5) AS ttft_p50_s, quantile_cont(ttft_s, 0.99) AS ttft_p99_s,
               quantile_cont(tpot_s, 0.5) FILTER (WHERE output_tokens > 1) AS itl_p50_s,
               quantile_cont(tpot_s, 0.99) FILTER (WHERE output_tokens > 1) AS itl_p99_s,
               quantile_cont(e2e_s, 0.5) AS e2e_p50_s, quantile_cont(e2e_s, 0.99) AS e2e_p99_s,
               quantile_cont(queue_s, 0.5) AS queue_p50_s, sum(num_preemptions) AS preemptions
        FROM requests WHERE job_id = $job_id""",
    # time series for the job page's charts, bucketed so 50k iterations come back as ~hundreds of points
    "job_iterations_timeline": """
        SELECT worker_id, time_bucket(INTERVAL '10 seconds', to_timestamp(ts)) AS bucket,
               avg(num_running) AS num_running, avg(num_waiting) AS num_waiting,
               sum(scheduled_tokens) / 10.0 AS scheduled_tokens_per_s,
               avg(scheduled_tokens / nullif(token_budget, 0)) AS budget_utilisation,
               max(kv_blocks_used) AS kv_blocks_used, max(kv_blocks_total) AS kv_blocks_total,
               sum(num_preempted) AS preemptions, count(*) AS iterations
        FROM iterations WHERE list_contains(job_ids, $job_id)
        GROUP BY ALL ORDER BY bucket, worker_id""",
    "job_kv_blocks": """
        SELECT worker_id, time_bucket(INTERVAL '10 seconds', to_timestamp(ts)) AS bucket,
               max(kv_blocks_used) AS kv_blocks_used, max(kv_blocks_total) AS kv_blocks_total
        FROM iterations WHERE list_contains(job_ids, $job_id)
        GROUP BY ALL ORDER BY bucket, worker_id""",
    "preemptions_per_worker": """
        SELECT worker_id, sum(num_preempted) AS preemptions, count(*) AS iterations,
               sum(num_preempted) / count(*) AS preemptions_per_iteration
        FROM iterations GROUP BY worker_id ORDER BY preemptions DESC""",
    "job_budget_utilisation": """
        SELECT date_trunc('minute', to_timestamp(ts)) AS minute,
               avg(scheduled_tokens / nullif(token_budget, 0)) AS budget_utilisation,
               avg(num_scheduled_seqs / nullif(max_num_seqs, 0)) AS seq_cap_utilisation
        FROM iterations WHERE list_contains(job_ids, $job_id)
        GROUP BY minute ORDER BY minute""",
    "sweeps_overview": """
        SELECT * FROM sweeps ORDER BY ts DESC, sweep_id, swept, max_num_seqs, max_num_batched_tokens, repeat
        LIMIT 1000""",
}

# the queries that take $job_id
JOB_QUERIES = tuple(name for name, sql in QUERIES.items() if "$job_id" in sql)

# (title, SQL) shown in the README for `batchgen sql "..."`; replace 'my-job' by a job id
README_EXAMPLES: list[tuple[str, str]] = [
    ("Tokens per second, per minute, of a job (engine iterations that served it)",
     "SELECT date_trunc('minute', to_timestamp(ts)) AS minute, "
     "round(sum(decode_tokens) / 60.0, 1) AS output_tok_s, "
     "round(sum(scheduled_tokens) / 60.0, 1) AS processed_tok_s "
     "FROM iterations WHERE list_contains(job_ids, 'my-job') GROUP BY minute ORDER BY minute"),
    ("p50 / p99 TTFT and ITL per job",
     "SELECT job_id, count(*) AS requests, "
     "quantile_cont(ttft_s, 0.5) AS ttft_p50_s, quantile_cont(ttft_s, 0.99) AS ttft_p99_s, "
     "quantile_cont(tpot_s, 0.5) AS itl_p50_s, quantile_cont(tpot_s, 0.99) AS itl_p99_s "
     "FROM requests WHERE output_tokens > 1 GROUP BY job_id ORDER BY job_id"),
    ("KV blocks used over time (10 s buckets, per worker)",
     "SELECT worker_id, time_bucket(INTERVAL '10 seconds', to_timestamp(ts)) AS t, "
     "max(kv_blocks_used) AS used, max(kv_blocks_total) AS total, "
     "round(100.0 * max(kv_blocks_used) / max(kv_blocks_total), 1) AS pct "
     "FROM iterations GROUP BY ALL ORDER BY t, worker_id"),
    ("Preemptions per worker",
     "SELECT worker_id, sum(num_preempted) AS preemptions, count(*) AS iterations "
     "FROM iterations GROUP BY worker_id ORDER BY preemptions DESC"),
    ("Token-budget utilisation (scheduled_tokens / token_budget) per job and minute",
     "SELECT j.job_id, date_trunc('minute', to_timestamp(ts)) AS minute, "
     "round(avg(scheduled_tokens / nullif(token_budget, 0)), 3) AS budget_utilisation "
     "FROM iterations, unnest(job_ids) AS j(job_id) GROUP BY ALL ORDER BY j.job_id, minute"),
]


def run_named(con: duckdb.DuckDBPyConnection, name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
              max_rows: int = DEFAULT_MAX_ROWS, **params: Any) -> QueryResult:
    """Run the named query with its $parameters (e.g. job_id=...)."""
    try:
        sql = QUERIES[name]
    except KeyError:
        raise KeyError(f"no query named {name!r}; known: {sorted(QUERIES)}") from None
    return run_query(con, sql, params or None, timeout_s=timeout_s, max_rows=max_rows)
