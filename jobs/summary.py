"""The end-of-job summary `batchgen run` prints: rows by outcome, tokens, time, throughput."""

from __future__ import annotations

from dataclasses import dataclass, field

from jobs.manifest import JobManifest
from jobs.store.catalog import connect


@dataclass
class JobSummary:
    """A finished (or failed, or cancelled) job, from the views."""

    job_id: str
    status: str  # the `jobs` view status
    num_requests: int  # input rows
    rows_ok: int = 0  # finish_reason stop or length
    rows_error: int = 0  # finish_reason error
    rows_cancelled: int = 0  # finish_reason cancelled
    prompt_tokens: int = 0
    output_tokens: int = 0
    generation_s: float = 0.0  # first shard started -> last shard finished
    shards_failed: int = 0
    failures: list[str] = field(default_factory=list)  # "shard N: error" of failed shards

    def render(self, elapsed_s: float) -> str:
        gen = self.generation_s or elapsed_s
        rows = self.rows_ok + self.rows_error + self.rows_cancelled
        lines = [
            f"job {self.job_id}: {self.status} in {elapsed_s:.1f} s (generation {gen:.1f} s, the rest is "
            "start-up: model load, worker start)",
            f"rows: {self.rows_ok} ok, {self.rows_error} error, {self.rows_cancelled} cancelled, "
            f"{self.num_requests - rows} without output (of {self.num_requests}); {rows / gen:.2f} rows/s",
            f"tokens: {self.output_tokens} output ({self.output_tokens / gen:.1f} tok/s), "
            f"{self.prompt_tokens} prompt",
        ]
        lines += [f"failed {f}" for f in self.failures]
        return "\n".join(lines)


def job_summary(manifest: JobManifest) -> JobSummary:
    con = connect(manifest.data_dir)
    try:
        job = con.execute("SELECT status, epoch(started_at), epoch(finished_at) FROM jobs WHERE job_id = ?",
                          [manifest.job_id]).fetchone()
        reasons = con.execute(
            "SELECT finish_reason, count(*), sum(prompt_tokens), sum(output_tokens) FROM outputs "
            "WHERE job_id = ? GROUP BY finish_reason", [manifest.job_id]).fetchall()
        failed = con.execute("SELECT shard_id, error FROM shards WHERE job_id = ? AND status = 'failed' "
                             "ORDER BY shard_id", [manifest.job_id]).fetchall()
    finally:
        con.close()
    status, started, finished = job if job else ("unknown", None, None)
    summary = JobSummary(manifest.job_id, status, manifest.num_requests, shards_failed=len(failed),
                         failures=[f"shard {s}: {e}" for s, e in failed])
    if started and finished:
        summary.generation_s = max(finished - started, 0.0)
    for reason, n, prompt, output in reasons:
        if reason in ("stop", "length"):
            summary.rows_ok += n
        elif reason == "error":
            summary.rows_error += n
        else:
            summary.rows_cancelled += n
        summary.prompt_tokens += int(prompt or 0)
        summary.output_tokens += int(output or 0)
    return summary
