"""Every error of issue 14 item 7 is one line naming its cause, exit 2 (usage, input) or 1 (the
environment); a full disk is never blamed on the input and never turns a completed job into a failed
command; racing commands on one --job-id get a message, not a traceback; a row with both `prompt` and
`messages` is an error row."""

from __future__ import annotations

import errno
import sys

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from engine.config import EngineConfig
from jobs import cli as jobs_cli
from jobs import submit as submit_module
from jobs.broker import resolve_broker
from jobs.commands import export, run, submit, worker
from jobs.input_contract import InputError
from jobs.local_run import LocalRun
from jobs.manifest import JobPaths, ShardWriter, list_job_ids
from jobs.shard_runner import ShardTask, process_shard
from jobs.submit import JobRequest, prepare_job, publish_job
from tests.jobs.helpers import MODEL, outputs_of, worker_runtime, write_prompts

NUM_ROWS = 6


def _request(data_dir, src, job_id=None) -> JobRequest:
    return JobRequest(str(src), str(data_dir), {"model": MODEL}, {"max_tokens": 3, "temperature": 0.0}, 3,
                      job_id=job_id, apply_chat_template="never")


def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "/data/jobs/x/shards/shard-000000.parquet")


def _main(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    """`batchgen ARGV` through the real entry point (its last-resort handler included)."""
    monkeypatch.setattr(sys, "argv", ["batchgen", *argv])
    with pytest.raises(SystemExit) as exit_:
        jobs_cli.main()
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("command", [run, submit, worker])
def test_an_unusable_data_dir_names_the_flag(command, tmp_path):
    args = ["--model", MODEL, "--data-dir", "/proc/x"]
    if command is not worker:
        args.insert(0, str(tmp_path / "in.parquet"))
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2 and result.exception is not None and "Traceback" not in result.output
    assert "Invalid value for '--data-dir': /proc/x cannot be used as a data dir: No such file or directory" \
        in result.output


@pytest.mark.parametrize("command", [run, submit])
def test_a_job_id_that_is_a_path_names_the_flag(command, tmp_path):
    src = tmp_path / "in.parquet"
    write_prompts(src, NUM_ROWS)
    data_dir = tmp_path / "d" / "data"
    result = CliRunner().invoke(command, [str(src), "--model", MODEL, "--data-dir", str(data_dir),
                                          "--job-id", "../../etc"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--job-id': job id '../../etc' is not a valid id" in result.output
    assert not (tmp_path / "d").exists() and not (tmp_path / "etc").exists()  # checked before anything


def test_disk_full_while_submitting_is_not_blamed_on_the_input(tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.parquet"
    write_prompts(src, NUM_ROWS)
    data_dir = tmp_path / "data"
    monkeypatch.setattr(ShardWriter, "_write", _no_space)
    code, err = _main(monkeypatch, capsys, "submit", str(src), "--model", MODEL, "--data-dir", str(data_dir),
                      "--broker", "embedded")
    assert code == 1, err
    assert err.strip() == ("Error: no space left on the device (/data/jobs/x/shards/shard-000000.parquet): "
                           "free some space and run the command again")
    assert list_job_ids(data_dir) == [] and not any((data_dir / "jobs").iterdir())  # no staging left


def test_two_commands_racing_on_one_job_id(tmp_path, monkeypatch):
    """The other command creates the job's directory between this one's check and its own mkdir."""
    src = tmp_path / "in.parquet"
    write_prompts(src, NUM_ROWS)
    data_dir = tmp_path / "data"
    real = submit_module._write_shards

    def the_other_command_wins(req, *args):
        manifest = real(req, *args)
        JobPaths.of(data_dir, req.job_id).root.mkdir(parents=True)
        return manifest

    monkeypatch.setattr(submit_module, "_write_shards", the_other_command_wins)
    with pytest.raises(InputError, match=r"^--job-id: job 'same' already exists under .* \(another command "
                                         r"created it a moment ago\)$"):
        prepare_job(_request(data_dir, src, "same"), resolve_broker(data_dir, embedded=True))
    monkeypatch.undo()
    result = CliRunner().invoke(submit, [str(src), "--model", MODEL, "--data-dir", str(data_dir),
                                         "--broker", "embedded", "--job-id", "same"])
    assert result.exit_code == 2 and "--job-id: job 'same' already exists" in result.output, result.output


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    with worker_runtime(tmp_path_factory.mktemp("errors") / "data", "w-errors", max_num_seqs=8) as rt:
        yield rt


def _completed_job(runtime, tmp_path, **columns):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table(columns or {"prompt": [f"row {i}" for i in range(NUM_ROWS)]}), src)
    broker = resolve_broker(runtime.data_dir, embedded=True)
    m = prepare_job(_request(runtime.data_dir, src), broker)
    publish_job(m, broker)
    outcomes = [process_shard(ShardTask(m.job_id, s, m.data_dir), runtime)
                for s in range(len(m.shards))]
    assert [o.result for o in outcomes] == ["committed"] * len(m.shards)
    return m


def _finish(m, output) -> int:
    local = LocalRun(m, resolve_broker(m.data_dir, embedded=True), EngineConfig(model=MODEL), workers=1,
                     concurrency=2, show_progress=False, output_path=str(output))
    return local._finish(1.0)


def test_disk_full_at_the_end_never_fails_a_completed_job(runtime, tmp_path, monkeypatch, capsys):
    import jobs.export
    import jobs.store

    m = _completed_job(runtime, tmp_path)
    out = tmp_path / "out.parquet"

    def compaction_hits_a_full_disk(*_args, **_kwargs):
        raise duckdb.IOException("IO Error: Could not write file \"x.parquet\": No space left on device")

    monkeypatch.setattr(jobs.store, "compact_job", compaction_hits_a_full_disk)
    assert _finish(m, out) == 0  # the compaction failed, the output was still written
    err = capsys.readouterr().err
    assert "warning: the job's parts were not compacted (IOException: IO Error: Could not write file" in err
    assert pq.read_table(out).num_rows == NUM_ROWS
    out.unlink()

    # and the output cannot be written (export's own writes only: pyarrow's write_table is also what
    # the worker's telemetry flush calls, on its engine thread, at any moment)
    monkeypatch.setattr(jobs.export, "_write_atomic", _no_space)
    assert _finish(m, out) == 0 and not out.exists()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    how = f"batchgen export {m.job_id} --data-dir {m.data_dir} --output {out}"
    assert line.startswith("output not written (OSError: [Errno 28] No space left on device") and \
        line.endswith(f"write it once there is room with: {how}")
    monkeypatch.undo()  # room again: the printed command writes it
    result = CliRunner().invoke(export, how.split()[2:])
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).num_rows == NUM_ROWS


def test_a_row_with_both_prompt_and_messages_is_an_error_row(runtime, tmp_path):
    user = [{"role": "user", "content": "hi"}]
    m = _completed_job(runtime, tmp_path, prompt=["a", "b", None], messages=[None, user, user])
    rows = outputs_of(runtime.data_dir, m.job_id)
    assert [(r["request_id"], r["finish_reason"]) for r in rows] == [("0", "length"), ("1", "error"),
                                                                     ("2", "length")]
    assert rows[1]["error"] == "both 'prompt' and 'messages' are set; give one of them"
