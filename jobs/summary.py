"""The end-of-job summary `batchgen run` prints: rows by outcome, tokens, time, throughput."""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb

from jobs.manifest import JobManifest
from jobs.request_counts import REQUEST_OUTCOMES_SQL
from jobs.store import connect, unreadable_part_message


@dataclass
class JobSummary:
    """A finished (or failed, or cancelled) job, from the views."""

    job_id: str
    status: str  # the `jobs` view status
    num_requests: int  # input rows
    rows_ok: int = 0  # every sample finished with stop or length
    rows_error: int = 0  # a sample with finish_reason error
    rows_cancelled: int = 0  # a sample with finish_reason cancelled (and none with error)
    prompt_tokens: int = 0  # once per row (its samples share the prompt)
    output_tokens: int = 0
    generation_s: float = 0.0  # first shard started -> last shard finished
    shards_failed: int = 0
    failures: list[str] = field(default_factory=list)  # "shard N: error" of failed shards
    unreadable: str = ""  # why the row counts are unknown (a damaged part file), if they are

    def render(self, elapsed_s: float, resumed: bool = False) -> str:
        """The summary; a `resumed` job's rates would mix runs (its generation time spans both), so
        they are left out."""
        gen = self.generation_s or elapsed_s
        rows = self.rows_ok + self.rows_error + self.rows_cancelled
        rows_rate = "" if resumed else f"; {rows / gen:.2f} rows/s"
        tok_rate = "" if resumed else f" ({self.output_tokens / gen:.1f} tok/s)"
        how = ("this run, which resumed the job; no rates: they would span the runs" if resumed else
               f"generation {gen:.1f} s, the rest is start-up: model load, worker start")
        lines = [
            f"job {self.job_id}: {self.status} in {elapsed_s:.1f} s ({how})",
            f"rows: {self.rows_ok} ok, {self.rows_error} error, {self.rows_cancelled} cancelled, "
            f"{self.num_requests - rows} without output (of {self.num_requests}){rows_rate}",
            f"tokens: {self.output_tokens} output{tok_rate}, {self.prompt_tokens} prompt",
        ] if not self.unreadable else [
            f"job {self.job_id}: {self.status} in {elapsed_s:.1f} s ({how})",
            f"rows: unknown: {self.unreadable}",
        ]
        lines += [f"failed {f}" for f in self.failures]
        return "\n".join(lines)


def job_summary(manifest: JobManifest) -> JobSummary:
    """The job's summary; a damaged part file leaves what it held unknown (said so), not a traceback."""
    con = connect(manifest.data_dir)
    try:
        job = con.execute("SELECT status, epoch(started_at), epoch(finished_at) FROM jobs WHERE job_id = ?",
                          [manifest.job_id]).fetchone()
        failed = con.execute("SELECT shard_id, error FROM shards WHERE job_id = ? AND status = 'failed' "
                             "ORDER BY shard_id", [manifest.job_id]).fetchall()
        status, started, finished = job if job else ("unknown", None, None)
        summary = JobSummary(manifest.job_id, status, manifest.num_requests, shards_failed=len(failed),
                             failures=[f"shard {s}: {e}" for s, e in failed])
        if started and finished:
            summary.generation_s = max(finished - started, 0.0)
        try:
            _count_rows(con, summary)
        except duckdb.Error as exc:
            summary.unreadable = unreadable_part_message(str(exc))
    finally:
        con.close()
    return summary


def _count_rows(con, summary: JobSummary) -> None:
    outcomes = con.execute("SELECT outcome, count(*) FROM (" + REQUEST_OUTCOMES_SQL.format(
        where="WHERE job_id = ?") + ") GROUP BY outcome", [summary.job_id]).fetchall()
    tokens = con.execute("SELECT sum(prompt_tokens) FILTER (WHERE coalesce(sample_index, 0) = 0), "
                         "sum(output_tokens) FROM outputs WHERE job_id = ?", [summary.job_id]).fetchone()
    counts = dict(outcomes)
    summary.rows_ok, summary.rows_error = counts.get("completed", 0), counts.get("failed", 0)
    summary.rows_cancelled = counts.get("cancelled", 0)
    summary.prompt_tokens, summary.output_tokens = int(tokens[0] or 0), int(tokens[1] or 0)
