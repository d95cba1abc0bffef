"""A large job written through the store's writer API without running a model: 100k iterations.

Two workers step at 20 iterations/s for 2500 s each; the job's requests arrive in shards, so the
request concurrency, running and waiting series all move. Rows are random but obey the engine's
invariants (scheduled = prefill + decode <= token budget, KV used <= total). Also writes one sweep.
"""

from __future__ import annotations

import random
import time

from engine.stats import IterationStats, RequestStats
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent, SweepRecord

JOB_ID = "big-job"
SWEEP_ID = "sweep-seqs"
WORKERS = ("gpu-worker-0", "gpu-worker-1")
STEP_S = 0.05  # one iteration every 50 ms
BUDGET, MAX_SEQS, KV_TOTAL = 2048, 64, 4096


def fill(data_dir, *, iterations: int = 100_000, requests: int = 2000, shards: int = 4,
         seed: int = 0) -> dict:
    rng = random.Random(seed)
    store = Store(data_dir)
    t0 = time.time() - 3600.0
    store.record_job(JobRecord(JOB_ID, "smollm2-135m", requests, shards, t0 - 5,
                               '{"engine": {"max_num_seqs": 64, "max_num_batched_tokens": 2048}}'))
    store.record_shard_events([ShardEvent(JOB_ID, s, "queued", t0 - 5) for s in range(shards)])
    span = iterations // len(WORKERS) * STEP_S
    for shard in range(shards):
        _write_shard(store, rng, shard, requests // shards, t0 + shard * span / shards, span / shards)
    for worker in WORKERS:
        _write_iterations(store, rng, worker, iterations // len(WORKERS), t0)
    _write_sweep(store, rng)
    return {"iterations": iterations, "requests": requests}


def _write_shard(store: Store, rng: random.Random, shard: int, n: int, start: float, span: float) -> None:
    attempt = store.begin_attempt(JOB_ID, shard, 1, WORKERS[shard % len(WORKERS)], num_requests=n)
    outputs, timings = [], []
    for i in range(n):
        rid, out = str(shard * n + i), rng.randint(1, 200)
        arrival = start + rng.uniform(0, 0.1 * span)
        scheduled = arrival + rng.uniform(0, 0.5 * span)
        first = scheduled + rng.uniform(0.02, 0.5)
        finished = first + out * rng.uniform(0.01, 0.03)
        preemptions, prompt = rng.randint(0, 1), rng.randint(10, 500)
        stats = RequestStats(arrival, scheduled, first, finished, preemptions, prompt, out)
        outputs.append({"request_id": rid, "output_text": f"answer {rid}", "finish_reason": "length",
                        "prompt_tokens": stats.prompt_tokens, "output_tokens": out, "error": None})
        timings.append({"request_id": rid, "finish_reason": "length", **stats.as_row()})
    attempt.add_outputs(outputs)
    attempt.add_requests(timings)
    attempt.commit()


def _write_iterations(store: Store, rng: random.Random, worker: str, n: int, t0: float) -> None:
    buf = store.telemetry_buffer(worker, flush_interval_s=1e9)
    buf.max_rows = 10_000
    for it in range(n):
        running = rng.randint(1, MAX_SEQS)
        prefill = rng.choice((0, 0, 0, rng.randint(1, BUDGET - running)))
        buf.append(IterationStats(
            worker, it, t0 + it * STEP_S, STEP_S * 0.9, running, rng.randint(0, 300), running,
            int(prefill > 0), running - int(prefill > 0), prefill, running - int(prefill > 0),
            prefill + running - int(prefill > 0), BUDGET, MAX_SEQS, rng.randint(100, KV_TOTAL), KV_TOTAL,
            int(rng.random() < 0.01), rng.randint(0, 2), 0, [JOB_ID], running // 4, running * 2e-5))
    buf.close()


def _write_sweep(store: Store, rng: random.Random) -> None:
    records = []
    for seqs in (1, 4, 16, 64, 256):
        for repeat in range(2):
            tput = 300 * seqs ** 0.6 * rng.uniform(0.95, 1.05)
            records.append(SweepRecord(
                SWEEP_ID, time.time(), "smollm2-135m", "max_num_seqs", seqs, 2048, repeat, 256,
                tput, tput * 3,
                0.02 * seqs ** 0.5, 0.05 * seqs ** 0.7, 0.004 * seqs ** 0.3, 0.01 * seqs ** 0.4, 1.0, 2.5,
                min(seqs, 200) * 0.9, min(seqs / 256, 1.0), 0))
    store.record_sweep(records)
