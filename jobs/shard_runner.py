"""One delivery of a shard task, as a plain function: skip it, run it, or say when to retry it.

`process_shard(task, runtime)` is what the Celery task (`run_shard`, registered on a worker's app by
`register_shard_task`) calls, and what tests call directly:

0. hand the message back (requeue) when the worker is shutting down: it only finishes what it holds;
1. skip when the shard is committed (tasks are idempotent), its job was cancelled, or a live attempt
   of it runs elsewhere (a duplicate delivery);
2. claim the next attempt and open it in the store (`running`), through the shard ledger
   (jobs.shards.ledger), which writes every transition of the shard's life; this module only orchestrates;
3. read the shard file, turn rows into engine requests (bad rows become error rows at once; a text
   prompt goes through the model's chat template as `--apply-chat-template` says; a row with `n`
   samples becomes n requests, seeds derived so a seeded row gives the same samples again), hand
   them to the worker's engine and wait for every row;
4. write output rows (one per sample, with `sample_index`, the `model` and, when asked, `logprobs`)
   and request rows, commit; or, on an error, fail the attempt and ask for a retry (exponential
   backoff) until the job's `max_retries` are used, then fail the shard for good; or, when the
   worker was interrupted, end the attempt "handed back" and give the message back.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import pyarrow as pa

from engine.stats import RequestStats
from jobs.input_contract import RowRequest, row_request
from jobs.manifest import REQUEST_ID_COLUMN, URL_COLUMN, JobManifest, load_manifest, read_shard
from jobs.openai_batch import COMPLETIONS_URL, LOGPROB_FLOOR
from jobs.shards.ledger import Claim, ShardLedger
from jobs.store import LOGPROBS_TYPE, ShardAttempt

if TYPE_CHECKING:
    from jobs.engine_loop import EngineRequest, ShardRun
    from jobs.worker_runtime import WorkerRuntime

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 600.0
MAX_DELIVERY_RETRIES = 10  # retries of a delivery that failed before its shard attempt began
SEED_MIN, SEED_SPAN = -(1 << 63), 3 << 63  # SamplingParams' seed range: [-2**63, 2**64)


@dataclass
class ShardTask:
    """What a shard message says (ids), the data dir of the worker it reached, and its retry count."""

    job_id: str
    shard_id: int
    data_dir: str  # the worker's DATA_DIR (the job's shard file and manifest are found there)
    retries: int = 0  # retries already made of this shard (Celery's request.retries)


@dataclass
class ShardOutcome:
    """What one delivery did."""

    result: str  # committed | skipped | failed | retry | cancelled | handed_back
    attempt: int = 0  # the attempt it ran (0 when skipped)
    rows: int = 0  # output rows committed
    output_tokens: int = 0
    reason: str = ""  # why skipped / failed / retried
    retry_in_s: float | None = None  # set when the task must be retried after this delay

    def describe(self) -> str:
        text = f"{self.result} (attempt {self.attempt}, {self.rows} rows, {self.output_tokens} tokens)"
        return f"{text}: {self.reason}" if self.reason else text

    def as_dict(self) -> dict:
        return asdict(self)


def backoff_s(first_s: float, retries: int) -> float:
    """Delay before retry number `retries + 1`: first_s, 2 first_s, 4 first_s, ... (capped)."""
    return min(first_s * (2 ** retries), MAX_BACKOFF_S)


def process_shard(task: ShardTask, runtime: WorkerRuntime) -> ShardOutcome:
    """Run one delivery of a shard task to its end (see the module docstring)."""
    if runtime.draining:
        return ShardOutcome("handed_back", reason="the worker is shutting down")
    manifest = load_manifest(task.data_dir, task.job_id)
    ledger = ShardLedger(task.data_dir, task.job_id)
    skip = _skip_reason(ledger, task)
    if skip:
        return ShardOutcome("skipped", reason=skip)
    rows = manifest.shard(task.shard_id).num_requests
    claim = ledger.claim(task.shard_id, runtime.worker_id, num_requests=rows)
    if claim is None:
        return ShardOutcome("skipped", reason="a live attempt of this shard runs elsewhere")
    try:
        with runtime.holding(task.job_id, claim.lease, ledger.paths.cancel_marker):
            return _run_attempt(task, manifest, runtime, ledger, claim)
    except Exception as exc:  # noqa: BLE001 - any failure of an attempt is retried, then reported
        log.warning("shard %s/%d attempt %d failed:\n%s", task.job_id, task.shard_id, claim.number,
                    traceback.format_exc())
        return _failed(task, manifest, ledger, claim, _reason(exc))


def _skip_reason(ledger: ShardLedger, task: ShardTask) -> str | None:
    if ledger.store.committed(task.job_id, task.shard_id) is not None:
        return "already committed"
    if ledger.cancelled:
        ledger.skip_cancelled(task.shard_id)
        return "job cancelled"
    return None


def _run_attempt(task: ShardTask, manifest: JobManifest, runtime: WorkerRuntime, ledger: ShardLedger,
                 claim: Claim) -> ShardOutcome:
    runtime.check_model(manifest)
    info = manifest.shard(task.shard_id)
    table = read_shard(info.path, info.num_requests)
    rows = table.to_pylist()
    key = f"{task.job_id}:{task.shard_id}:{claim.number}"
    plan = plan_requests(rows, manifest, key, runtime.has_chat_template)
    run = runtime.run_shard(task.job_id, key, plan.requests)
    if claim.superseded():
        ledger.step_aside(claim)
        return ShardOutcome("skipped", claim.number, reason="superseded by a newer attempt")
    if run.handed_back:
        reason = f"handed back: {run.hand_back_reason}"
        ledger.hand_back(claim, reason)  # no retry used; the message goes back to the broker
        return ShardOutcome("handed_back", claim.number, reason=reason)
    if run.error:
        raise RuntimeError(run.error)
    _write_rows(claim.attempt, rows, run, plan, manifest.extra_columns, table.schema, runtime)
    record = ledger.commit(claim)
    result = "cancelled" if run.cancelled else "committed"
    return ShardOutcome(result, claim.number, record.num_outputs, record.output_tokens)


@dataclass
class ShardPlan:
    """What the engine is asked for a shard's rows."""

    requests: list[EngineRequest] = field(default_factory=list)  # one per sample of each row that runs
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it cannot run
    samples: dict[int, int] = field(default_factory=dict)  # row -> n, for the rows that run
    logprobs: dict[int, int] = field(default_factory=dict)  # row -> alternatives per token, where asked


def plan_requests(rows: list[dict], manifest: JobManifest, key: str, has_chat_template: bool) -> ShardPlan:
    """Engine requests for the rows that can run (n each); row index -> error for those that cannot."""
    from jobs.engine_loop import EngineRequest

    plan = ShardPlan()
    for i, row in enumerate(rows):
        req = row_request(row, manifest.sampling_defaults)
        if req.error is None and req.prompt is not None:
            _as_chat(req, row, manifest, has_chat_template)
        if req.error:
            plan.errors[i] = req.error
            continue
        plan.samples[i] = req.n
        if req.params.logprobs is not None:
            plan.logprobs[i] = req.params.logprobs
        for s in range(req.n):
            params = req.params if s == 0 else replace(req.params, seed=sample_seed(req.params.seed, s))
            plan.requests.append(EngineRequest(f"{key}:{i}:{s}", req.prompt, req.messages, params, row=i))
    return plan


def _as_chat(req: RowRequest, row: dict, manifest: JobManifest, has_chat_template: bool) -> None:
    """A text prompt becomes a user turn where the chat template applies: `auto` when the model has
    one, except for OpenAI /v1/completions requests (a raw completion, as that endpoint means);
    `always` (an error where the model has none); `never`."""
    mode = manifest.apply_chat_template
    raw_completion = row.get(URL_COLUMN) == COMPLETIONS_URL
    if mode == "never" or (mode == "auto" and (not has_chat_template or raw_completion)):
        return
    if not has_chat_template:
        req.error = f"--apply-chat-template always: model {manifest.model!r} has no chat template"
        return
    req.prompt, req.messages = None, [{"role": "user", "content": req.prompt}]


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample `sample` of a row seeded `seed` (vLLM's rule: seed + index, kept in range)."""
    if seed is None:
        return None
    return (seed + sample - SEED_MIN) % SEED_SPAN + SEED_MIN


def _write_rows(attempt: ShardAttempt, rows: list[dict], run: ShardRun, plan: ShardPlan,
                extra_columns: list[str], schema: pa.Schema, runtime: WorkerRuntime) -> None:
    """Output and request rows in shard order (input order; a row's samples in sample order)."""
    fields = [schema.field(c) for c in extra_columns]
    if plan.logprobs:
        fields.append(pa.field("logprobs", LOGPROBS_TYPE))
    attempt.extra_schema = pa.schema(fields)
    model, tokens = runtime.config.model, TokenTexts(runtime.tokenizer)
    now = time.time()
    outputs, timings = [], []
    for i, row in enumerate(rows):
        rid = row[REQUEST_ID_COLUMN]
        extras = {c: row[c] for c in extra_columns}
        if i in plan.errors:
            stats = RequestStats(arrival_ts=now, finished_ts=now)
            outputs.append(_output_row(rid, 0, "", "error", 0, 0, plan.errors[i], model, extras))
            timings.append({"request_id": rid, "sample_index": 0, "finish_reason": "error", **stats.as_row()})
            continue
        for s in range(plan.samples[i]):
            out = run.outputs[f"{run.key}:{i}:{s}"]
            out.metrics.prompt_tokens = len(out.prompt_token_ids)
            row_out = _output_row(rid, s, out.text, out.finish_reason, len(out.prompt_token_ids),
                                  len(out.token_ids), out.error, model, extras)
            if i in plan.logprobs:
                row_out["logprobs"] = tokens.logprobs(out.token_ids, out.logprobs, plan.logprobs[i])
            outputs.append(row_out)
            timings.append({"request_id": rid, "sample_index": s, "finish_reason": out.finish_reason,
                            **out.metrics.as_row()})
    attempt.add_outputs(outputs)
    attempt.add_requests(timings)


def _output_row(rid: str, sample: int, text: str, reason: str, prompt_tokens: int, output_tokens: int,
                error: str | None, model: str, extras: dict) -> dict:
    return {"request_id": rid, "sample_index": sample, "output_text": text, "finish_reason": reason,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "error": error, "model": model,
            **extras}


class TokenTexts:
    """Token ids -> the `logprobs` column's entries, each token's text decoded once per shard."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None, top_n: int
                 ) -> list[dict] | None:
        """Per output token: its text, id, logprob, bytes and the `top_n` best alternatives."""
        if logprobs is None:
            return None
        entries = []
        for token, per_token in zip(token_ids, logprobs, strict=True):
            best = sorted(per_token.items(), key=lambda kv: -kv[1])[:top_n]
            entries.append({**self._entry(token, per_token[token]),
                            "top_logprobs": [self._entry(t, lp) for t, lp in best]})
        return entries

    def _entry(self, token: int, logprob: float) -> dict:
        text, raw = self._text(token)
        return {"token": text, "token_id": token, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": raw}

    def _text(self, token: int) -> tuple[str, list[int] | None]:
        found = self._cache.get(token)
        if found is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else str(token)
            # a token that is part of a multi-byte character decodes to U+FFFD: no bytes of its own
            found = (text, None if "\ufffd" in text else list(text.encode("utf-8")))
            self._cache[token] = found
        return found


def _failed(task: ShardTask, manifest: JobManifest, ledger: ShardLedger, claim: Claim,
            reason: str) -> ShardOutcome:
    if task.retries < manifest.max_retries:
        delay = backoff_s(manifest.retry_backoff_s, task.retries)
        ledger.retry(claim, reason, delay)
        return ShardOutcome("retry", claim.number, reason=reason, retry_in_s=delay)
    final = f"{reason} (gave up after {task.retries + 1} tries)"
    ledger.fail(claim, final)
    return ShardOutcome("failed", claim.number, reason=final)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ---------------------------------------------------------------- the Celery task


def register_shard_task(app) -> None:
    """Register the shard task on a worker's Celery app (jobs.celery_app.make_app); a publisher sends it
    by name and needs no task."""
    from jobs.celery_app import TASK_NAME

    if TASK_NAME not in app.tasks:
        app.task(bind=True, name=TASK_NAME, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
                 max_retries=None)(run_shard)


def run_shard(self, job_id: str, shard_id: int, shard_path: str | None = None, data_dir: str | None = None
              ) -> dict:
    """Run one shard in this worker's engine; retry it with backoff when it fails. The job is read from
    the worker's own data dir (`shard_path` and `data_dir`, which messages of older batchgen versions
    carry, are ignored: they may name another host's mount point)."""
    from celery.exceptions import Reject

    from jobs.worker_runtime import current_runtime

    runtime = current_runtime()
    task = ShardTask(job_id, shard_id, str(runtime.data_dir), retries=self.request.retries)
    try:
        outcome = process_shard(task, runtime)
    except Exception as exc:  # before an attempt began (data dir unreachable, ...): do not lose the message
        if self.request.retries >= MAX_DELIVERY_RETRIES:
            raise
        log.warning("shard %s/%d could not start (%s); retrying", job_id, shard_id, exc)
        raise self.retry(exc=exc, countdown=min(2.0 * 2 ** self.request.retries, 300.0)) from exc
    log.info("shard %s/%d: %s", job_id, shard_id, outcome.describe())
    if outcome.result == "handed_back":
        raise Reject(outcome.reason, requeue=True)
    if outcome.retry_in_s is not None:
        raise self.retry(countdown=outcome.retry_in_s)
    return outcome.as_dict()
