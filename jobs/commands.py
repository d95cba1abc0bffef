"""The job commands of `batchgen`: run, submit, worker, status, cancel, retry.

Exit codes: 0 done; 1 the job (or a worker) failed, or the environment did (a broker out of reach,
a full disk: jobs.cli); 2 bad usage or bad input (click's usage error), with a message naming the
flag, file, column or row.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import click

import engine
from engine.cli_options import engine_config, engine_options, flag_name, given_engine_flags
from jobs.broker import (
    BROKER_ENV,
    DEFAULT_MAX_TOKENS,
    DEFAULT_QUEUE,
    DEFAULT_SHARD_SIZE,
    EMBEDDED,
    QUEUE_ENV,
    BrokerSettings,
    resolve_broker,
)
from jobs.input_contract import CHAT_TEMPLATE_MODES
from jobs.logs import LOG_FORMAT_ENV
from jobs.store import DATA_DIR_ENV, DEFAULT_DATA_DIR

# ---------------------------------------------------------------- shared options

MAX_CONCURRENCY = 64  # shards one worker holds at once, at most

_SAMPLING_OPTIONS = [
    click.option("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, show_default=True,
                 help="Job default: new tokens per row at most (clamped per row, as vLLM does, to the room "
                      "--max-model-len leaves after its prompt; requests.max_tokens shows the limit used)."),
    click.option("--temperature", type=float, help="Job default (0 = greedy; default 1.0)."),
    click.option("--top-p", type=float, help="Job default (default 1.0)."),
    click.option("--top-k", type=int, help="Job default (0 = off)."),
    click.option("--min-p", type=float, help="Job default: drop tokens below min_p x the top token's "
                 "probability (default 0)."),
    click.option("--presence-penalty", type=float, help="Job default, OpenAI's [-2, 2] (default 0)."),
    click.option("--frequency-penalty", type=float, help="Job default, OpenAI's [-2, 2] (default 0)."),
    click.option("--repetition-penalty", type=float, help="Job default, vLLM's (> 1 discourages repeats; "
                 "default 1)."),
    click.option("--seed", type=int, help="Job default per-row seed."),
    click.option("--stop", multiple=True, help="Job default stop string (repeatable)."),
    click.option("--ignore-eos", is_flag=True, default=None, help="Job default: generate past EOS."),
    click.option("--n", "n", type=int, help="Job default: samples per row, one output row each (default 1)."),
    click.option("--logprobs/--no-logprobs", default=None, help="Job default: a `logprobs` column (the "
                 "log probability of each output token)."),
    click.option("--top-logprobs", type=int, help="Job default: alternatives per token in `logprobs` "
                 "(implies --logprobs)."),
    click.option("--response-format", metavar="FILE.json", callback=lambda ctx, param, value:
                 _response_format(value), help="Job default structured output: a JSON file holding "
                 'OpenAI\'s response_format ({"type": "json_schema", "json_schema": {"schema": ...}} or '
                 '{"type": "json_object"}) or a bare JSON schema. Rows override it with their own '
                 "response_format / guided_regex / guided_choice."),
]
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "ignore_eos", "n", "logprobs",
                   "top_logprobs", "response_format")

_JOB_OPTIONS = [
    click.option("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, show_default=True,
                 help="Rows per shard (one task each)."),
    click.option("--max-retries", type=int, default=3, show_default=True,
                 help="Retries of a shard that fails or whose worker dies before it fails for good."),
    click.option("--retry-backoff", type=float, default=5.0, show_default=True,
                 help="Seconds before the first retry (doubles each retry)."),
    click.option("--job-id", callback=lambda ctx, param, value: _valid_job_id(ctx, param, value),
                 help="Job id (default job-<utc time>-<random>): 1-128 of [A-Za-z0-9._-]."),
    click.option("--apply-chat-template", type=click.Choice(CHAT_TEMPLATE_MODES), default="auto",
                 show_default=True, help="A text `prompt` through the model's chat template: auto = when "
                 "the model has one (not for OpenAI /v1/completions requests), always, never."),
    click.option("--keep-prompt", is_flag=True,
                 help="Carry the prompt / messages columns through to the outputs."),
]

_DATA_DIR_OPTION = click.option(
    "--data-dir", envvar=DATA_DIR_ENV, default=DEFAULT_DATA_DIR, show_default=True,
    type=click.Path(file_okay=False), help=f"Data dir (or ${DATA_DIR_ENV}).")
_BROKER_OPTION = click.option(
    "--broker", "broker_url", envvar=BROKER_ENV,
    help=f"redis://... or amqp://... (or ${BROKER_ENV}); unset or 'embedded': the embedded broker "
         "under the data dir.")


def _valid_job_id(ctx, param, value: str | None) -> str | None:
    """--job-id becomes a directory name and part of a queue name: checked before anything else."""
    if value is None:
        return None
    from jobs.store import StoreError, check_id

    try:
        return check_id("job id", value)
    except StoreError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def usable_data_dir(data_dir: str) -> str:
    """--data-dir made absolute and created if missing; a path that cannot be (a file, /proc/x, no
    permission) is a usage error naming the flag."""
    path = Path(data_dir).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"{path} cannot be used as a data dir: {exc.strerror or exc}",
                                 param_hint="'--data-dir'") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise click.BadParameter(f"{path} is not writable", param_hint="'--data-dir'")
    return str(path)


def _response_format(path: str | None) -> dict | None:
    """--response-format FILE.json -> the response_format object, its schema checked (exit 2 if bad)."""
    if path is None:
        return None
    from engine.structured_output import RESPONSE_FORMAT_TYPES, check, constraint_from

    try:
        value = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as exc:
        raise click.BadParameter(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"{path}: not JSON ({exc})") from None
    if isinstance(value, dict) and value.get("type") not in RESPONSE_FORMAT_TYPES:
        value = {"type": "json_schema", "json_schema": {"schema": value}}  # a bare JSON schema
    try:
        check(constraint_from(value))
    except ValueError as exc:
        raise click.BadParameter(f"{path}: {exc}") from None
    return value


def _apply(options):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


sampling_options = _apply(_SAMPLING_OPTIONS)
job_options = _apply(_JOB_OPTIONS)


def sampling_from(opts: dict) -> dict:
    given = {k: opts.get(k) for k in SAMPLING_FIELDS}
    given["stop"] = list(given["stop"]) or None
    return given


def _job_request(prompts: str, data_dir: str, config, opts: dict, output: str | None, *, local: bool = False):
    from dataclasses import asdict

    from click.core import ParameterSource

    from jobs.submit import JobRequest

    model_given = click.get_current_context().get_parameter_source("model") != ParameterSource.DEFAULT
    # a submitted job records only its model: its shards run with the engine config of whichever worker
    # serves them; `run` records the config it hands its own workers (`worker --job`)
    engine = asdict(config) if local else {"model": config.model}
    return JobRequest(source=prompts, data_dir=data_dir, engine=engine, sampling=sampling_from(opts),
                      shard_size=opts["shard_size"], max_retries=opts["max_retries"],
                      retry_backoff_s=opts["retry_backoff"], job_id=opts.get("job_id"),
                      output_path=str(output or ""), apply_chat_template=opts["apply_chat_template"],
                      keep_prompt=opts["keep_prompt"], model_given=model_given, local=local)


def _output_path(ctx, param, value: str | None) -> Path | None:
    """--output: a .parquet or .jsonl file, checked before any work."""
    if value is None:
        return None
    from jobs.export import ExportError, check_output_path

    try:
        return check_output_path(value)
    except ExportError as exc:
        raise click.BadParameter(str(exc).removeprefix(f"--output {value}: "), ctx, param) from None


def _prepare(request, broker: BrokerSettings):
    from jobs.input_contract import InputError
    from jobs.submit import prepare_job

    try:
        return prepare_job(request, broker)
    except InputError as exc:
        raise click.UsageError(str(exc)) from None


def _broker(data_dir: str, queue: str | None, url: str | None = None, embedded: bool = False,
            timeout_s: float | None = None) -> BrokerSettings:
    try:
        return resolve_broker(data_dir, queue=queue, url=url, embedded=embedded, timeout_s=timeout_s)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def check_broker(settings: BrokerSettings) -> None:
    """Fail early (exit 1) when a server broker cannot be reached."""
    if settings.kind == EMBEDDED:
        return
    from kombu import Connection

    try:
        with Connection(settings.url, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1, timeout=5)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is reported the same way
        raise click.ClickException(f"cannot reach the broker {settings.display_url}: {exc}") from None


def _manifest(data_dir: str, job_id: str):
    from jobs.manifest import load_manifest
    from jobs.store import StoreError

    try:
        return load_manifest(data_dir, job_id)
    except (FileNotFoundError, StoreError) as exc:
        raise click.UsageError(str(exc)) from None


def broker_for_job(manifest, data_dir: str) -> BrokerSettings:
    """The broker a job was submitted to; a server broker must be the one $BATCHGEN_BROKER_URL names."""
    if manifest.broker == EMBEDDED:
        return _broker(data_dir, manifest.queue, embedded=True, timeout_s=manifest.shard_timeout_s or None)
    settings = _broker(data_dir, manifest.queue, timeout_s=manifest.shard_timeout_s or None)
    if settings.display_url != manifest.broker:
        raise click.UsageError(f"job {manifest.job_id} was submitted to {manifest.broker}; set {BROKER_ENV} "
                               f"to that broker (now: {settings.display_url})")
    return settings


# ---------------------------------------------------------------- submit


@click.command()
@click.argument("prompts")
@engine_options
@sampling_options
@job_options
@_DATA_DIR_OPTION
@_BROKER_OPTION
@click.option("--queue", envvar=QUEUE_ENV, default=DEFAULT_QUEUE, show_default=True, help="Queue to use.")
def submit(prompts: str, data_dir: str, broker_url: str | None, queue: str, **opts) -> None:
    """Validate PROMPTS (a Parquet or JSONL file, directory or glob), shard it and queue it for workers."""
    from jobs.submit import publish_job

    _refuse_worker_settings(opts)
    config = engine_config(opts)
    data_dir = usable_data_dir(data_dir)
    settings = _broker(data_dir, queue, url=broker_url)
    check_broker(settings)
    manifest = _prepare(_job_request(prompts, data_dir, config, opts, None), settings)
    publish_job(manifest, settings)
    click.echo(f"job {manifest.job_id}: {manifest.num_requests} rows in {len(manifest.shards)} shard(s) "
               f"queued on {settings.display_url} queue {settings.queue!r}")
    click.echo(manifest.job_id)


def _refuse_worker_settings(opts: dict) -> None:
    """A worker serves one engine configuration: a job chooses its model, never the engine's limits."""
    limits = [flag_name(k) for k in given_engine_flags(opts) if k != "model"]
    if limits:
        raise click.UsageError(
            f"{', '.join(limits)}: engine settings belong to `batchgen worker` (each worker serves one "
            "engine configuration, whatever job its shards come from); `submit` takes only --model. "
            "Start the workers with these flags, or use `batchgen run`, whose own workers take them.")


# ---------------------------------------------------------------- worker


def worker_openmp_wait() -> None:
    """A worker started on its own may share its machine (several workers, other jobs), where OpenMP
    threads that spin between parallel regions slow every engine on the cores (engine/openmp.py): no
    spin, unless GOMP_SPINCOUNT was set for it, by the user or by `batchgen run` starting it as its
    only worker (which hands down the engine's spin). Called before torch loads, which is when libgomp
    reads it."""
    engine.set_openmp_defaults()
    engine.no_spin_unless_chosen(os.environ)


@click.command()
@engine_options
@_DATA_DIR_OPTION
@_BROKER_OPTION
@click.option("--queue", envvar=QUEUE_ENV, default=DEFAULT_QUEUE, show_default=True, help="Queue to consume.")
@click.option("--job", "job_id", help="Serve with the engine config recorded by this job (`batchgen "
              "run` starts its workers so); engine flags given as well override it.")
@click.option("--concurrency", type=click.IntRange(1, MAX_CONCURRENCY), default=2, show_default=True,
              help="Shards held in the engine at once (>= 2 keeps it busy across shard boundaries).")
@click.option("--worker-id", "-n", help="Worker name (default batchgen-<pid>@<host>).")
@click.option("--shard-timeout", type=float, help="Seconds a shard may hold its message (broker visibility / "
              "consumer timeout; default from the default shard size).")
@click.option("--loglevel", default="INFO", show_default=True)
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve Prometheus /metrics on this port (0 = any free one; default: off).")
@click.option("--metrics-host", default="0.0.0.0", show_default=True,
              help="Address --metrics-port binds (metrics hold counts and ids, never prompts or outputs).")
def worker(data_dir: str, broker_url: str | None, queue: str, job_id: str | None, concurrency: int,
           worker_id: str | None, shard_timeout: float | None, loglevel: str, metrics_port: int | None,
           metrics_host: str, **opts) -> None:
    """Serve shard tasks from the queue with one long-lived engine."""
    worker_openmp_wait()
    from jobs.logs import configure_logging
    from jobs.worker_main import run_worker

    data_dir = usable_data_dir(data_dir)
    config = engine_config(opts, **(_manifest(data_dir, job_id).engine if job_id else {}))
    _check_device(config.device)
    settings = _broker(data_dir, queue, url=broker_url, timeout_s=shard_timeout)
    check_broker(settings)
    worker_id = worker_id or f"batchgen-{os.getpid()}@{socket.gethostname()}"
    configure_logging(level=loglevel)
    metrics_at = (metrics_host, metrics_port) if metrics_port is not None else None
    sys.exit(run_worker(config, settings, data_dir, worker_id,
                        concurrency, loglevel, metrics_at))


# ---------------------------------------------------------------- run


@click.command()
@click.argument("prompts")
@engine_options
@sampling_options
@job_options
@_DATA_DIR_OPTION
@click.option("--output", type=click.Path(dir_okay=False), callback=_output_path,
              help="Write the job's output here: .parquet, or .jsonl (for OpenAI Batch input: the OpenAI "
                   "batch output, failed requests in <name>.errors.jsonl).")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Worker processes (each loads the model). With --device cuda worker i runs on "
                   "cuda:(i mod the visible GPUs): one engine per GPU.")
@click.option("--concurrency", type=click.IntRange(1, MAX_CONCURRENCY),
              help="Shards held in each engine at once (default: enough to fill --max-num-seqs, >= 2).")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="A progress bar on a terminal, else a progress line every few seconds.")
def run(prompts: str, data_dir: str, output: Path | None, workers: int, concurrency: int | None,
        progress: bool, **opts) -> None:
    """Run the whole job on this machine: embedded broker, local workers, progress, summary.

    The same command again resumes the job: committed shards are kept, the rest run, --output is
    written at the end. Ctrl-C hands the shards in flight back and prints the command that resumes."""
    config = engine_config(opts)
    _check_device(config.device)  # before anything is written
    data_dir = usable_data_dir(data_dir)
    request = _job_request(prompts, data_dir, config, opts, output, local=True)
    claim = _claim_run(request)
    try:
        code = _run_claimed(request, config, data_dir, output, workers, concurrency, progress)
    finally:
        claim.release()
    sys.exit(code)


def _run_claimed(request, config, data_dir: str, output: Path | None, workers: int, concurrency: int | None,
                 progress: bool) -> int:
    """`run` once this command holds its claim: find or create the job, run it; the exit code."""
    from dataclasses import asdict, replace

    from jobs.local_run import LocalRun, RunError, resume_command

    manifest, resumed = _run_job(request)
    broker = _broker(data_dir, manifest.queue, embedded=True)
    config = replace(config, model=manifest.model)  # an OpenAI file's body.model, when --model was not given
    if manifest.engine != asdict(config):  # resumed with other engine flags: the workers take these
        manifest = _record_engine(manifest, config)
    # enough shards to fill max_num_seqs, within what `batchgen worker --concurrency` accepts
    concurrency = concurrency or min(max(2, math.ceil(config.max_num_seqs / manifest.shard_size) + 1),
                                     MAX_CONCURRENCY)
    json_logs = os.environ.get(LOG_FORMAT_ENV) == "json"  # set by --log-format (jobs.logs)
    from jobs.placement import PlacementError, place_workers

    try:
        devices = place_workers(config.device, workers)  # worker i on cuda:(i mod GPUs) for --device cuda
    except PlacementError as exc:
        raise click.UsageError(str(exc)) from None
    local = LocalRun(manifest, broker, config, workers=workers, concurrency=concurrency, devices=devices,
                     show_progress=progress, progress_as_log=json_logs, resume=resumed,
                     output_path=str(output or ""),
                     resume_command=resume_command(sys.argv[1:], manifest.job_id, data_dir))
    try:
        return local.run()
    except RunError as exc:
        raise click.ClickException(str(exc)) from None


def _check_device(device: str) -> None:
    """A --device this host does not have is a usage error naming the flag (jobs.placement)."""
    from jobs.placement import PlacementError, check_device

    try:
        check_device(device)
    except PlacementError as exc:
        raise click.UsageError(str(exc)) from None


def _claim_run(request):
    """Hold this command's run claim (jobs.shards.resume.RunClaim): an identical `run` started at the
    same time waits here, then resumes the job the first one created."""
    from jobs.input_contract import InputError
    from jobs.shards.resume import RunClaim, run_fingerprint

    try:
        request.fingerprint = run_fingerprint(request)
    except InputError as exc:
        raise click.UsageError(str(exc)) from None

    def waiting(holder: dict) -> None:
        click.echo(f"the same `batchgen run` command is running (pid {holder.get('pid', '?')} on "
                   f"{holder.get('host', '?')}); waiting for it, then this one resumes its job", err=True)

    claim = RunClaim(request.data_dir, request.fingerprint)
    claim.take(on_wait=waiting)
    return claim


def _record_engine(manifest, config):
    """The manifest with `config` as the engine its local workers serve (`worker --job` reads it)."""
    from dataclasses import asdict, replace

    from jobs.manifest import JobPaths, write_manifest

    manifest = replace(manifest, engine=asdict(config))
    write_manifest(manifest, JobPaths.of(manifest.data_dir, manifest.job_id))
    return manifest


def _run_job(request):
    """(the job, resumed?): the job this command started before, else a new one on a queue of its own."""
    from jobs.input_contract import InputError
    from jobs.manifest import new_job_id
    from jobs.shards.resume import find_run_job

    try:
        found = find_run_job(request.data_dir, request.fingerprint, request.job_id)
    except InputError as exc:
        raise click.UsageError(str(exc)) from None
    if found is not None:
        return found, True
    request.job_id = request.job_id or new_job_id(time.time())
    # a queue of its own: no other worker on the embedded broker takes this job's shards
    return _prepare(request, _broker(request.data_dir, f"run.{request.job_id}", embedded=True)), False


# ---------------------------------------------------------------- status / cancel / retry


@click.command()
@click.argument("job_id", required=False)
@_DATA_DIR_OPTION
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--requeue/--no-requeue", default=True, show_default=True,
              help="Re-queue shards whose worker died (jobs on the broker in force).")
@click.option("--output", type=click.Path(dir_okay=False), callback=_output_path,
              help="With JOB: write its output (every input row once, input order) as .parquet or .jsonl "
                   "(OpenAI Batch input: the OpenAI batch output); the job must be finished.")
@click.option("--shards", "all_shards", is_flag=True,
              help="With JOB: list every shard (default: counts by state, then the failed and running ones).")
def status(job_id: str | None, data_dir: str, fmt: str, requeue: bool, output: Path | None,
           all_shards: bool) -> None:
    """Progress of every job, or of one job and its shards (like OpenAI Batch's request_counts)."""
    from jobs.status import engine_faults, job_status, jobs_status, render_job, render_jobs

    data_dir = str(Path(data_dir).expanduser().resolve())
    if not Path(data_dir).is_dir():
        raise click.UsageError(f"data dir {data_dir} does not exist (set --data-dir or ${DATA_DIR_ENV})")
    if requeue:
        _requeue(data_dir, job_id)
    if job_id is None:
        if output:
            raise click.UsageError("--output needs a JOB")
        rows = _unless_unreadable(jobs_status, data_dir)
        click.echo(json.dumps(rows, indent=1, default=str) if fmt == "json"
                   else render_jobs(rows, engine_faults(data_dir)))
        return
    manifest = _manifest(data_dir, job_id)
    info = _unless_unreadable(job_status, manifest, all_shards=all_shards)
    click.echo(json.dumps(info, indent=1, default=str) if fmt == "json" else render_job(info))
    if output:
        _export(manifest, output)


@click.command()
@click.argument("job_id")
@_DATA_DIR_OPTION
@click.option("--format", "fmt", type=click.Choice(["parquet", "jsonl"]),
              help="Default: the --output file's suffix, else parquet.")
@click.option("--output", type=click.Path(dir_okay=False), callback=_output_path,
              help="Where to write: .parquet or .jsonl (default ./<JOB>.outputs.<format>).")
def export(job_id: str, data_dir: str, fmt: str | None, output: Path | None) -> None:
    """Write a finished job's outputs as one clean table: every input row once, in input order
    (the views' committed rows only, never the raw parts under the data dir)."""
    manifest = _manifest(data_dir, job_id)
    if output is None:
        output = Path(f"{manifest.job_id}.outputs.{fmt or 'parquet'}").resolve()
    elif fmt is not None and output.suffix.lower() != f".{fmt}":
        raise click.UsageError(f"--output {output} and --format {fmt} disagree: the suffix says the format")
    _export(manifest, output)


def _unless_unreadable(read, *args, **kwargs):
    """read(...), or a one-line error (exit 1) naming the part file when the store cannot be read."""
    import duckdb

    from jobs.store import unreadable_part_message

    try:
        return read(*args, **kwargs)
    except duckdb.Error as exc:
        raise click.ClickException(unreadable_part_message(str(exc))) from None


def _export(manifest, output: Path) -> None:
    from jobs.export import ExportError, export_job

    try:
        written = export_job(manifest, output)
    except ExportError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(written.describe(), err=True)


def _requeue(data_dir: str, job_id: str | None) -> None:
    from jobs.shards.supervise import requeue_dead_shards

    settings = _broker(data_dir, None)
    try:
        done = requeue_dead_shards(data_dir, settings)
        if settings.kind != EMBEDDED:
            done += requeue_dead_shards(data_dir, _broker(data_dir, None, embedded=True))
    except Exception as exc:  # noqa: BLE001 - status still reports when a broker is down
        click.echo(f"warning: could not re-queue dead shards: {exc}", err=True)
        return
    for job, shard in done:
        click.echo(f"re-queued job {job} shard {shard} (its worker died or its message was lost)", err=True)


@click.command()
@click.argument("job_id")
@_DATA_DIR_OPTION
@click.option("--reason", default="cancelled by user", show_default=True)
def cancel(job_id: str, data_dir: str, reason: str) -> None:
    """Cancel a job: queued shards are skipped, running ones stop; finished rows stay."""
    from jobs.shards.control import cancel_job

    manifest = _manifest(data_dir, job_id)
    if not cancel_job(manifest, reason):
        click.echo(f"job {job_id}: already cancelled")
        return
    click.echo(f"job {job_id}: cancel requested; running shards stop within seconds, "
               "queued shards are skipped")


@click.command()
@click.argument("job_id")
@_DATA_DIR_OPTION
def retry(job_id: str, data_dir: str) -> None:
    """Queue the failed shards of a job again (those `batchgen store check --repair` marked for re-run
    included), and its stuck ones (waiting for a worker while the broker holds no message for them);
    completed shards are not redone."""
    from jobs.shards.control import retry_failed_shards, retry_stuck_shards
    from jobs.shards.supervise import requeue_dead_shards

    manifest = _manifest(data_dir, job_id)
    settings = broker_for_job(manifest, data_dir)
    check_broker(settings)
    try:
        failed = retry_failed_shards(manifest, settings)
        dead = sorted(s for j, s in requeue_dead_shards(data_dir, settings) if j == job_id)
        stuck = retry_stuck_shards(manifest, settings, skip=set(dead))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not (failed or dead or stuck):
        click.echo(f"job {job_id}: no failed or stuck shards to retry")
        return
    for what, shards in (("failed", failed), ("dead worker's", dead), ("stuck", stuck)):
        if shards:
            click.echo(f"job {job_id}: re-queued {what} shard(s) {', '.join(map(str, shards))}")
