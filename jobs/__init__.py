"""Jobs: Parquet prompts in, shards through a queue, one long-lived engine per worker, Parquet parts out.

    input_contract.py  the input contract: files, columns, ids, per-row sampling (InputError)
    submit.py          validate + shard + manifest (prepare_job), record + publish (publish_job)
    manifest.py        DATA_DIR/jobs/<job_id>/: manifest.json, shard files, lease dir, cancel marker
    broker.py          BATCHGEN_BROKER_URL (redis/amqp) or the embedded broker; timeouts from shard size
    embedded_broker.py a kombu transport over SQLite with a visibility timeout (no server needed)
    celery_app.py      the Celery app: settings per broker and queue (publishers send the task by name)
    shard_runner.py    process_shard: skip / claim / run / commit / retry one shard delivery; the
                       Celery task run_shard, registered on a worker's app
    engine_loop.py     EngineLoop: the one thread that owns a worker's engine, fed by every shard
    worker_runtime.py  WorkerRuntime: the engine loop, heartbeats, cancel, the janitor, engine faults
    shards/            a shard's life: ShardState, leases, the ledger, supervision (progress, dead
                       workers, lost messages), broker messages, resume, cancel / retry
    worker_main.py     `batchgen worker`: engine + Celery threads-pool worker, warm shutdown
    parent_watch.py    a worker started by `batchgen run` exits with it
    local_run.py       `batchgen run`: submit + local workers + progress bar + summary + --output
    status.py          `batchgen status`
    request_counts.py  OpenAI Batch's request_counts (status and the summary)
    export.py          a job's output Parquet: every input row once, in input order
    summary.py         the end-of-run summary
    commands.py        the click commands (mapped by jobs.cli)
    store/             the Parquet-parts / DuckDB store (its own package)
"""
