"""What a job gives back, in-process (process_shard over one engine, no broker): n samples with derived
seeds, the logprobs column, the chat template, the model and prompt columns, the sampling values
plumbed into SamplingParams, the export formats (Parquet, JSONL, the OpenAI batch output and its
errors file), and an interrupted worker handing its shard back."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from engine import LLM, SamplingParams
from jobs.broker import resolve_broker
from jobs.cli import cli
from jobs.export import ExportError, errors_path, export_job
from jobs.manifest import JobPaths, load_manifest, write_manifest
from jobs.shard_runner import ShardTask, plan_requests, process_shard, sample_seed
from jobs.shards.leases import ShardLeases
from jobs.shards.supervise import every_shard_progress, job_progress
from jobs.submit import JobRequest, prepare_job
from tests.jobs.helpers import MODEL, one_torch_thread, outputs_of, query, shards_of, wait_for, worker_runtime
from tests.jobs.test_jsonl_input import COMPLETIONS, chat, request, write_jsonl

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("outputs") / "data"


@pytest.fixture(scope="module")
def runtime(data_dir):
    with worker_runtime(data_dir, "w-out", max_num_seqs=8) as rt:
        yield rt


@pytest.fixture(scope="module")
def llm():
    with one_torch_thread():
        yield LLM(MODEL)


def _job(data_dir, src, shard_size=100, max_retries=3, **kw):
    req = JobRequest(str(src), str(data_dir), {"model": MODEL}, {"max_tokens": MAX_TOKENS}, shard_size,
                     max_retries=max_retries, retry_backoff_s=0.01, **kw)
    return prepare_job(req, resolve_broker(data_dir, embedded=True))


def _parquet(tmp_path, name="in.parquet", **columns) -> Path:
    path = tmp_path / name
    pq.write_table(pa.table(columns), path)
    return path


def _run(m, runtime, *shards) -> list:
    return [process_shard(ShardTask(m.job_id, s, m.data_dir), runtime)
            for s in (shards or range(len(m.shards)))]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_n_samples_are_rows_with_derived_seeds(runtime, data_dir, tmp_path, llm):
    src = _parquet(tmp_path, prompt=["tell", "greedy", "tell"], n=[3, 2, None], seed=[7, None, 7],
                   temperature=[1.0, 0.0, 1.0])
    m = _job(data_dir, src)
    assert [o.result for o in _run(m, runtime)] == ["committed"]
    rows = outputs_of(data_dir, m.job_id)
    rows.sort(key=lambda r: (int(r["request_id"]), r["sample_index"]))
    assert [(r["request_id"], r["sample_index"]) for r in rows] == \
        [("0", 0), ("0", 1), ("0", 2), ("1", 0), ("1", 1), ("2", 0)]
    # sample s of a row seeded 7 is what seed 7 + s gives (vLLM's rule), whatever else ran beside it
    ref = llm.chat([_user("tell")] * 3, [SamplingParams(max_tokens=MAX_TOKENS, seed=7 + s) for s in range(3)])
    assert [r["output_text"] for r in rows[:3]] == [o.text for o in ref]
    assert len({r["output_text"] for r in rows[:3]}) > 1, "samples differ"
    assert rows[5]["output_text"] == rows[0]["output_text"], "a seeded row is reproducible"
    assert rows[3]["output_text"] == rows[4]["output_text"], "greedy samples are the same"
    assert shards_of(data_dir, m.job_id)[0]["rows_done"] == 3, "rows done counts rows, not samples"
    timing = query(data_dir, "SELECT request_id, sample_index FROM requests WHERE job_id = ? ORDER BY ALL",
                   [m.job_id])
    assert len(timing) == 6 and {t["sample_index"] for t in timing} == {0, 1, 2}
    status = CliRunner().invoke(cli, ["status", m.job_id, "--data-dir", str(data_dir), "--format", "json"])
    counts = json.loads(status.output)["request_counts"]
    assert counts == {"total": 3, "completed": 3, "failed": 0, "cancelled": 0}


def test_sample_seeds_stay_in_range():
    assert [sample_seed(None, 1), sample_seed(5, 0), sample_seed(5, 2)] == [None, 5, 7]
    top = (1 << 64) - 1
    assert sample_seed(top, 1) == -(1 << 63)  # wraps inside SamplingParams' seed range
    SamplingParams(seed=sample_seed(top, 1))


def test_logprobs_column(runtime, data_dir, tmp_path, llm):
    src = _parquet(tmp_path, prompt=["a", "b", "c"], logprobs=[True, None, True],
                   top_logprobs=[2, None, None], temperature=[0.0, 0.0, 0.0])
    m = _job(data_dir, src)
    _run(m, runtime)
    rows = outputs_of(data_dir, m.job_id)
    ref = llm.chat([_user("a")], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2))[0]
    entries = rows[0]["logprobs"]
    assert [e["token_id"] for e in entries] == ref.token_ids and len(entries) == rows[0]["output_tokens"]
    for e, per_token, token in zip(entries, ref.logprobs, ref.token_ids, strict=True):
        assert e["logprob"] == pytest.approx(per_token[token])
        assert e["token"] == llm.tokenizer.decode([token], skip_special_tokens=False)
        assert [t["logprob"] for t in e["top_logprobs"]] == sorted((t["logprob"] for t in e["top_logprobs"]),
                                                                   reverse=True)
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["logprob"]
    assert rows[1]["logprobs"] is None, "not asked"
    assert all(e["top_logprobs"] == [] for e in rows[2]["logprobs"]), "logprobs without top_logprobs"


def test_chat_template_modes_and_completions_lines():
    """auto: a prompt through the template when the model has one, except /v1/completions lines."""
    class M:
        sampling_defaults, apply_chat_template, model = {}, "auto", "m"

    rows = [{"prompt": "p"}, {"prompt": "p", "_bg_url": COMPLETIONS}, {"messages": _user("m")}]
    cases = {("auto", True): [True, False, True], ("auto", False): [False, False, True],
             ("never", True): [False, False, True], ("always", True): [True, True, True]}
    for (mode, has_template), chats in cases.items():
        M.apply_chat_template = mode
        plan = plan_requests(rows, M, "k", has_template)
        assert [r.messages is not None for r in plan.requests] == chats, (mode, has_template)
        assert plan.requests[0].messages in (None, _user("p"))
    M.apply_chat_template = "always"
    plan = plan_requests(rows, M, "k", False)
    assert plan.errors == {0: "--apply-chat-template always: model 'm' has no chat template",
                           1: "--apply-chat-template always: model 'm' has no chat template"}


def test_sampling_values_reach_sampling_params():
    class M:
        apply_chat_template, model = "never", "m"
        sampling_defaults = {"min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                             "repetition_penalty": 1.1, "max_tokens": 4}

    rows = [{"prompt": "a"}, {"prompt": "b", "min_p": 0.3, "presence_penalty": -1.0, "frequency_penalty": 2.0,
                              "repetition_penalty": 1.5, "logprobs": 3},
            {"prompt": "c", "presence_penalty": 2.5}, {"prompt": "d", "logprobs": False, "top_logprobs": 1}]
    plan = plan_requests(rows, M, "k", False)
    got = [(p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logprobs)
           for p in (r.params for r in plan.requests)]
    assert got == [(0.1, 0.5, 0.25, 1.1, None), (0.3, -1.0, 2.0, 1.5, 3)]
    assert "presence_penalty must be a finite number in [-2, 2], got 2.5" in plan.errors[2]
    assert "top_logprobs needs logprobs true" in plan.errors[3]


def test_cli_sampling_defaults_reach_the_manifest(tmp_path):
    src = str(_parquet(tmp_path, prompt=["a"]))
    data = str(tmp_path / "data")
    args = ["submit", src, "--model", MODEL, "--data-dir", data, "--queue", "q.defaults"]
    ok = CliRunner().invoke(cli, [*args, "--min-p", "0.2", "--presence-penalty", "1", "--frequency-penalty",
                                  "0.5", "--repetition-penalty", "1.1", "--n", "2", "--top-logprobs", "3",
                                  "--apply-chat-template", "never", "--keep-prompt"])
    assert ok.exit_code == 0, ok.output
    m = load_manifest(data, ok.output.strip().splitlines()[-1])
    assert {k: m.sampling_defaults[k] for k in ("min_p", "presence_penalty", "frequency_penalty",
                                                "repetition_penalty", "n", "top_logprobs")} == \
        {"min_p": 0.2, "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "n": 2,
         "top_logprobs": 3}
    assert (m.apply_chat_template, m.extra_columns) == ("never", ["prompt"])
    for flag, value, message in (
            ("--presence-penalty", "5", "presence_penalty must be a finite number in [-2, 2]"),
            ("--n", "0", "n must be an integer in [1, 128]"),
            ("--repetition-penalty", "0", "repetition_penalty must be a finite number")):
        bad = CliRunner().invoke(cli, [*args, flag, value])
        assert bad.exit_code == 2 and message in bad.output, bad.output


def test_keep_prompt_and_model_columns(runtime, data_dir, tmp_path):
    src = _parquet(tmp_path, prompt=["a", "b"], topic=["x", "y"])
    m = _job(data_dir, src, keep_prompt=True)
    _run(m, runtime)
    rows = outputs_of(data_dir, m.job_id)
    assert [(r["prompt"], r["topic"], r["model"]) for r in rows] == [("a", "x", MODEL), ("b", "y", MODEL)]
    plain = _job(data_dir, _parquet(tmp_path, "p.parquet", prompt=["a"]))
    _run(plain, runtime)
    table = pq.read_table(export_job(plain, tmp_path / "plain.parquet").path)
    assert "prompt" not in table.column_names and table.column("model").to_pylist() == [MODEL]


# ---------------------------------------------------------------- export


def test_parquet_and_plain_jsonl_outputs_hold_the_same_rows(runtime, data_dir, tmp_path):
    src = _parquet(tmp_path, prompt=["a", "b", ""], id=["x", "y", "z"], n=[2, None, None],
                   note=["1", "2", "3"])
    m = _job(data_dir, src, shard_size=2)
    _run(m, runtime)
    table = pq.read_table(export_job(m, tmp_path / "out.parquet").path).to_pylist()
    written = export_job(m, tmp_path / "out.jsonl")
    lines = [json.loads(line) for line in written.path.read_text().splitlines()]
    assert written.lines == len(lines) == len(table) == 4 and written.errors_path is None
    assert [(r["request_id"], r["sample_index"], r["note"]) for r in lines] == \
        [("x", 0, "1"), ("x", 1, "1"), ("y", 0, "2"), ("z", 0, "3")]
    assert lines == [{k: v for k, v in r.items()} for r in table]
    assert lines[3]["finish_reason"] == "error" and lines[3]["error"] == "empty prompt"
    with pytest.raises(ExportError, match="give a .parquet or .jsonl file"):
        export_job(m, tmp_path / "out.csv")


def _openai_file(tmp_path) -> str:
    return write_jsonl(
        tmp_path / "batch.jsonl",
        chat("chat-1", "hello", n=2, temperature=0, logprobs=True, top_logprobs=2),
        request("text-1", {"prompt": "once upon", "logprobs": 1, "temperature": 0}, COMPLETIONS),
        chat("bad-1", "x", max_tokens=0),
        chat("chat-2", "bye"),
    )


def test_openai_batch_output_and_errors_file(runtime, data_dir, tmp_path):
    m = _job(data_dir, _openai_file(tmp_path))
    _run(m, runtime)
    written = export_job(m, tmp_path / "results.jsonl")
    assert written.errors_path == errors_path(written.path) == tmp_path / "results.errors.jsonl"
    ok = [json.loads(line) for line in written.path.read_text().splitlines()]
    failed = [json.loads(line) for line in written.errors_path.read_text().splitlines()]
    assert [line["custom_id"] for line in ok] == ["chat-1", "text-1", "chat-2"]
    assert [line["custom_id"] for line in failed] == ["bad-1"]
    rows = {(r["request_id"], r["sample_index"]): r for r in outputs_of_any(data_dir, m.job_id)}
    chat_body = ok[0]["response"]["body"]
    assert ok[0]["response"]["status_code"] == 200 and ok[0]["error"] is None
    assert chat_body["object"] == "chat.completion" and chat_body["model"] == MODEL
    assert [c["index"] for c in chat_body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in chat_body["choices"]] == \
        [rows[("chat-1", s)]["output_text"] for s in (0, 1)]
    tokens = rows[("chat-1", 0)]["output_tokens"] + rows[("chat-1", 1)]["output_tokens"]
    assert chat_body["usage"] == {"prompt_tokens": rows[("chat-1", 0)]["prompt_tokens"],
                                  "completion_tokens": tokens,
                                  "total_tokens": rows[("chat-1", 0)]["prompt_tokens"] + tokens}
    content = chat_body["choices"][0]["logprobs"]["content"]
    assert len(content) == rows[("chat-1", 0)]["output_tokens"]
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 2
    text_body = ok[1]["response"]["body"]
    assert text_body["object"] == "text_completion"
    legacy = text_body["choices"][0]["logprobs"]
    assert set(legacy) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(legacy["tokens"]) == len(legacy["text_offset"]) == rows[("text-1", 0)]["output_tokens"]
    assert all(len(top) <= 1 for top in legacy["top_logprobs"])
    assert ok[2]["response"]["body"]["choices"][0]["logprobs"] is None
    error = failed[0]["response"]
    assert error["status_code"] == 400 and error["body"]["error"]["type"] == "invalid_request_error"
    assert "max_tokens must be an integer >= 1" in error["body"]["error"]["message"]
    assert len({line["id"] for line in ok + failed}) == 4


def outputs_of_any(data_dir, job_id) -> list[dict]:
    return query(data_dir, "SELECT * FROM outputs WHERE job_id = ?", [job_id])


def test_openai_output_for_failed_and_cancelled_shards(runtime, data_dir, tmp_path):
    m = _job(data_dir, _openai_file(tmp_path), shard_size=2, max_retries=0)
    paths = JobPaths.of(m.data_dir, m.job_id)
    m.engine["model"] = "smollm2-135m"  # this worker refuses the job: its shard fails for good
    write_manifest(m, paths)
    assert _run(m, runtime, 0)[0].result == "failed"
    m.engine["model"] = MODEL
    write_manifest(m, paths)
    JobPaths.of(m.data_dir, m.job_id).cancel_marker.write_text("test\n")
    assert _run(m, runtime, 1)[0].reason == "job cancelled"
    written = export_job(m, tmp_path / "res.jsonl")
    assert written.lines == 0
    failed = [json.loads(line) for line in written.errors_path.read_text().splitlines()]
    assert [line["custom_id"] for line in failed] == ["chat-1", "text-1", "bad-1", "chat-2"]
    assert [line["response"]["status_code"] for line in failed[:2]] == [500, 500]
    assert "shard 0 failed" in failed[0]["response"]["body"]["error"]["message"]
    assert [line["error"]["code"] for line in failed[2:]] == ["batch_cancelled"] * 2
    assert [line["response"] for line in failed[2:]] == [None, None]
    Path(m.shard(1).path).write_bytes(b"garbage")
    with pytest.raises(ExportError, match="shard-000001.parquet is unreadable"):
        export_job(m, tmp_path / "again.jsonl")


# ---------------------------------------------------------------- an interrupted worker


def test_hand_back_ends_the_attempt_and_queues_the_shard_without_a_retry(data_dir, tmp_path):
    src = _parquet(tmp_path, prompt=["a", "b", "c", "d"], max_tokens=[1900] * 4, ignore_eos=[True] * 4)
    m = _job(data_dir, src, apply_chat_template="never")
    with worker_runtime(data_dir, "w-handback", max_num_seqs=8) as rt:
        engine, step = rt.loop.engine, rt.loop.engine.step
        engine.step = lambda: (time.sleep(0.003), step())[1]  # pace the tiny model: seconds, not ms
        result = {}
        task = ShardTask(m.job_id, 0, m.data_dir)
        worker = threading.Thread(target=lambda: result.update(out=process_shard(task, rt)))
        start = rt.iterations
        worker.start()
        wait_for(lambda: rt.iterations > start + 20, 30, "the shard to be running")
        rt.hand_back()
        worker.join(60)
        assert result["out"].result == "handed_back"
        late = process_shard(ShardTask(m.job_id, 0, m.data_dir), rt)
        assert late.result == "handed_back", "a delivery after the interrupt is handed back unstarted"
    leases = ShardLeases(JobPaths.of(m.data_dir, m.job_id).leases)
    assert leases.view(0, 1).state.state == "handed_back"
    assert every_shard_progress(m)[0].state == "queued"
    assert [s.state for s in job_progress(m).active if s.shard_id == 0] == ["queued"]
    assert shards_of(data_dir, m.job_id)[0]["status"] == "queued"
    assert outputs_of(data_dir, m.job_id) == [], "a handed-back attempt's rows never count"


def test_attempts_of_a_killed_worker_are_handed_back_for_it(data_dir, tmp_path):
    """What `batchgen run` does after Ctrl-C for a worker it had to kill inside a long engine step."""
    import subprocess

    from jobs.shards.supervise import hand_back_dead_attempts, retries_used
    from jobs.store.parts import Store

    m = _job(data_dir, _parquet(tmp_path, prompt=["a", "b"]), shard_size=1)
    leases = ShardLeases(JobPaths.of(m.data_dir, m.job_id).leases)
    lease = leases.try_claim(0, "w-killed")
    gone = subprocess.Popen(["true"])
    gone.wait()
    lease.state.pid = gone.pid  # its worker process no longer exists
    lease.write()
    assert leases.try_claim(1, "w-alive") is not None  # alive: left alone
    store = Store(m.data_dir)
    assert hand_back_dead_attempts(m, store) == [0]
    assert hand_back_dead_attempts(m, store) == [], "once"
    assert leases.view(0, 1).state.state == "handed_back" and leases.view(1, 1).state.state == "running"
    assert shards_of(data_dir, m.job_id)[0]["status"] == "queued"
    assert retries_used(leases, 0, [1]) == 0, "a hand-back uses no retry"


def test_export_command_writes_the_clean_table(runtime, data_dir, tmp_path, monkeypatch):
    m = _job(data_dir, _parquet(tmp_path, prompt=["a", "b", "c"], id=["1", "2", "3"]), shard_size=2)
    _run(m, runtime)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    plain = runner.invoke(cli, ["export", m.job_id, "--data-dir", str(data_dir)])
    assert plain.exit_code == 0, plain.output
    default = tmp_path / f"{m.job_id}.outputs.parquet"
    assert pq.read_table(default).column("request_id").to_pylist() == ["1", "2", "3"]
    as_jsonl = runner.invoke(cli, ["export", m.job_id, "--data-dir", str(data_dir), "--format", "jsonl"])
    assert as_jsonl.exit_code == 0, as_jsonl.output
    lines = (tmp_path / f"{m.job_id}.outputs.jsonl").read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["1", "2", "3"]
    for args, message in ((["--format", "jsonl", "--output", "x.parquet"], "disagree"),
                          (["--output", "x.csv"], "give a .parquet or .jsonl file")):
        bad = runner.invoke(cli, ["export", m.job_id, "--data-dir", str(data_dir), *args])
        assert bad.exit_code == 2 and message in bad.output, bad.output
    missing = runner.invoke(cli, ["export", "job-nope", "--data-dir", str(data_dir)])
    assert missing.exit_code == 2 and "no job 'job-nope'" in missing.output
