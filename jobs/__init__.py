"""Jobs: Parquet prompts in, shards through a queue, one long-lived engine per worker, Parquet parts out.

    spec.py            the input contract: files, columns, ids, per-row sampling (InputError)
    submit.py          validate + shard + manifest (prepare_job), record + publish (publish_job)
    manifest.py        DATA_DIR/jobs/<job_id>/: manifest.json, shard files, lease dir, cancel marker
    broker.py          BATCHGEN_BROKER_URL (redis/amqp) or the embedded broker; timeouts from shard size
    embedded_broker.py a kombu transport over SQLite with a visibility timeout (no server needed)
    celery_app.py      the Celery app and its one thin task, run_shard
    shard_runner.py    process_shard: skip / claim / run / commit / retry one shard delivery
    runtime.py         WorkerRuntime: the engine loop thread, heartbeats, cancel, janitor
    leases.py          attempt claims and heartbeats (one live attempt per shard, dead-worker detection)
    supervise.py       progress from leases; re-queueing shards whose worker died
    worker_main.py     `batchgen worker`: engine + Celery threads-pool worker, warm shutdown
    local_run.py       `batchgen run`: submit + local workers + progress bar + summary + --output
    status.py          `batchgen status` / `retry`
    export.py          a job's output Parquet: every input row once, in input order
    summary.py         the end-of-run summary
    commands.py        the click commands (mapped by jobs.cli)
    store/             the Parquet-parts / DuckDB store (its own package)
"""
