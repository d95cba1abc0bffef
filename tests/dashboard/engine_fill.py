"""Fill a data dir the way a worker does, by running the real engine and writing through the store.

Used while `batchgen run` cannot fill one itself: one `LLMEngine` on the tiny random model; the
job's shards stream into it (shard 1 is added while shard 0 is still running, so request
concurrency and running sequences differ); each shard's outputs and request timings are written by a
`ShardAttempt` and committed; every step's `IterationStats` goes through a `TelemetryBuffer`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent

WORKER_ID = "worker-a@test"


def prompts(n: int) -> list[dict]:
    """n input rows: an id, a prompt, max_tokens and an extra column; row 3 is empty (an error row)."""
    rows = []
    for i in range(n):
        text = "" if i == 3 else f"Question {i}: " + "tell me about batching " * (1 + i % 4)
        rows.append({"id": str(i), "prompt": text, "max_tokens": 6 + (i * 5) % 14, "topic": f"t{i % 3}"})
    return rows


def fill(data_dir, job_id: str = "job-engine", num_rows: int = 16, num_shards: int = 2) -> dict:
    """Run one job of `num_rows` prompts in `num_shards` shards; returns the job's input rows."""
    store = Store(data_dir)
    config = EngineConfig(model="tiny-random", max_num_seqs=6, max_num_batched_tokens=64, block_size=4,
                          num_kv_blocks=40)
    rows = prompts(num_rows)
    shards = [rows[s::num_shards] for s in range(num_shards)]
    job_config = json.dumps({"engine": asdict(config), "sampling": {"temperature": 0.0}})
    store.record_job(JobRecord(job_id, "tiny-random", num_rows, num_shards, time.time(), config=job_config))
    store.record_shard_events([ShardEvent(job_id, s, "queued", time.time()) for s in range(num_shards)])
    with store.telemetry_buffer(WORKER_ID) as telemetry:
        engine = LLMEngine(config, stat_loggers=[telemetry.append])
        _run_shards(store, engine, job_id, shards)
    return {"rows": rows, "config": config}


def _run_shards(store: Store, engine: LLMEngine, job_id: str, shards: list[list[dict]]) -> None:
    attempts, pending = {}, {}
    next_shard, steps = 0, 0
    while next_shard < len(shards) or engine.has_unfinished_requests() or any(pending.values()):
        if next_shard < len(shards) and (next_shard == 0 or steps >= 4):
            attempts[next_shard] = store.begin_attempt(job_id, next_shard, 1, WORKER_ID,
                                                       num_requests=len(shards[next_shard]))
            pending[next_shard] = {_add(engine, job_id, next_shard, row): row for row in shards[next_shard]}
            next_shard += 1
        for out in engine.step():
            _record(attempts, pending, out)
        steps += 1
        for shard_id in [s for s, left in pending.items() if not left]:
            attempts.pop(shard_id).commit()
            del pending[shard_id]


def _add(engine: LLMEngine, job_id: str, shard_id: int, row: dict) -> str:
    params = SamplingParams(max_tokens=row["max_tokens"], temperature=0.0, ignore_eos=True)
    return engine.add_request(f"{shard_id}:{row['id']}", row["prompt"], params, job_id=job_id)


def _record(attempts: dict, pending: dict, out) -> None:
    shard_id = int(out.request_id.split(":")[0])
    row = pending[shard_id].pop(out.request_id)
    attempt = attempts[shard_id]
    attempt.add_outputs([{
        "request_id": row["id"], "output_text": out.text, "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids), "output_tokens": len(out.token_ids),
        "error": out.error, "topic": row["topic"],
    }])
    attempt.add_request(row["id"], out.finish_reason, out.metrics)
