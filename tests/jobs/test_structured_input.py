"""Structured output in job input: response_format / guided_regex / guided_choice columns and fields,
OpenAI body.response_format, --response-format; bad schemas refused before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from engine.structured_output import Constraint
from jobs.broker import resolve_broker
from jobs.cli import cli
from jobs.input_contract import InputError, row_request, sampling_defaults
from jobs.submit import JobRequest, prepare_job
from tests.jobs.helpers import LEASE_TTL_S, MODEL, query

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["kind", "n"]}
RF = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
BAD_RF = {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}


def _prepare(tmp_path, source, **sampling):
    data_dir = tmp_path / "data"
    req = JobRequest(source=str(source), data_dir=str(data_dir), engine={"model": MODEL},
                     sampling=sampling, shard_size=10)
    return prepare_job(req, resolve_broker(data_dir, embedded=True))


def _no_job_left(tmp_path) -> bool:
    jobs = tmp_path / "data" / "jobs"
    return not jobs.exists() or not any(p.name.startswith("job-") for p in jobs.iterdir())


def _write_jsonl(path, *objs) -> str:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def test_parquet_constraint_columns_become_each_rows_constraint(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c", "d"],
                             "response_format": [json.dumps(RF), None, None, None],
                             "guided_regex": [None, "[0-9]+", None, None],
                             "guided_choice": [None, None, ["x", "y"], None]}), src)
    m = _prepare(tmp_path, src, response_format={"type": "json_object"})
    shard = pq.read_table(m.shards[0].path).to_pylist()
    kinds = [row_request(r, m.sampling_defaults).params.constraint.kind for r in shard]
    assert kinds == ["json_schema", "regex", "choice", "json_object"]  # a row's own replaces the job's


@pytest.mark.parametrize("cell, message", [
    (json.dumps(BAD_RF), 'bad.parquet row 1: JSON constraint refused: Unsupported type "bogus"'),
    ("{not json", "bad.parquet row 1: response_format is not JSON"),
    (json.dumps({"type": "xml"}), "bad.parquet row 1: response_format must be an object with type one of"),
])
def test_a_bad_response_format_refuses_the_job_naming_the_row(tmp_path, cell, message):
    src = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "response_format": [json.dumps(RF), cell]}), src)
    with pytest.raises(InputError) as info:
        _prepare(tmp_path, src)
    assert message in str(info.value)
    assert _no_job_left(tmp_path)


def test_bad_regex_and_two_constraints_in_one_row_are_refused(tmp_path):
    src = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "guided_regex": ["ok", "a("],
                             "guided_choice": [None, None]}), src)
    with pytest.raises(InputError, match=r"bad.parquet row 1: regex match constraint refused: Regex parsing"):
        _prepare(tmp_path, src)
    pq.write_table(pa.table({"prompt": ["a"], "guided_regex": ["ok"], "guided_choice": [["x"]]}), src)
    with pytest.raises(InputError, match="row 0: guided_regex and guided_choice are both set"):
        _prepare(tmp_path, src)
    pq.write_table(pa.table({"prompt": ["a"], "response_format": [1]}), src)
    with pytest.raises(InputError, match="column 'response_format' must be a string of JSON"):
        _prepare(tmp_path, src)


def test_jsonl_rows_and_openai_lines_carry_response_format(tmp_path):
    plain = _write_jsonl(tmp_path / "plain.jsonl", {"prompt": "a", "response_format": RF},
                         {"prompt": "b", "guided_choice": ["yes", "no"]})
    m = _prepare(tmp_path, plain)
    rows = pq.read_table(m.shards[0].path).to_pylist()
    assert [row_request(r, {}).params.constraint.kind for r in rows] == ["json_schema", "choice"]
    chat = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": RF}}
    vllm = {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hi", "guided_json": SCHEMA}}
    m = _prepare(tmp_path, _write_jsonl(tmp_path / "batch.jsonl", chat, vllm))
    rows = pq.read_table(m.shards[0].path).to_pylist()
    constraints = [row_request(r, {}).params.constraint for r in rows]
    want = Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    assert constraints[0] == constraints[1] == want


def test_jsonl_bad_schema_and_shape_name_the_line(tmp_path):
    chat = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": RF}}
    bad = {**chat, "custom_id": "c2", "body": {**chat["body"], "response_format": BAD_RF}}
    with pytest.raises(InputError, match=r"bad.jsonl line 2: JSON constraint refused: Unsupported type"):
        _prepare(tmp_path, _write_jsonl(tmp_path / "bad.jsonl", chat, bad))
    with pytest.raises(InputError, match=r"shape.jsonl line 1: response_format must be a JSON object"):
        _prepare(tmp_path, _write_jsonl(tmp_path / "shape.jsonl", {"prompt": "a", "response_format": "json"}))
    completion = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "hi", "response_format": RF}}
    with pytest.raises(InputError, match="body.response_format is not supported on /v1/completions"):
        _prepare(tmp_path, _write_jsonl(tmp_path / "c.jsonl", completion))
    assert _no_job_left(tmp_path)


def test_job_default_response_format_is_checked():
    assert sampling_defaults(response_format=RF) == {"response_format": RF}
    with pytest.raises(InputError, match='job sampling defaults: JSON constraint refused: Unsupported type'):
        sampling_defaults(response_format=BAD_RF)


def test_response_format_flag_reads_a_file_and_refuses_a_bad_one(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a"]}), src)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))
    data = str(tmp_path / "data")
    result = CliRunner().invoke(cli, ["submit", str(src), "--model", MODEL, "--data-dir", data,
                                      "--response-format", str(bad)])
    assert result.exit_code == 2 and "bad.json: JSON constraint refused" in result.output, result.output
    result = CliRunner().invoke(cli, ["submit", str(src), "--model", MODEL, "--data-dir", data,
                                      "--response-format", str(tmp_path / "missing.json")])
    assert result.exit_code == 2 and "missing.json: cannot read" in result.output, result.output
    assert _no_job_left(tmp_path)


def test_run_with_response_format_writes_outputs_that_validate(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "bb", "ccc"], "id": ["r0", "r1", "r2"],
                             "guided_choice": [None, None, ["left", "right"]]}), src)
    schema_file = tmp_path / "pet.json"
    schema_file.write_text(json.dumps(SCHEMA))  # a bare schema: the json_schema response_format
    out = tmp_path / "out.parquet"
    env = dict(os.environ, BATCHGEN_LEASE_TTL_S=LEASE_TTL_S, OMP_NUM_THREADS="1")
    env.pop("BATCHGEN_BROKER_URL", None)
    cmd = [sys.executable, "-m", "jobs.cli", "run", str(src), "--model", MODEL,
           "--data-dir", str(tmp_path / "data"), "--max-tokens", "40", "--temperature", "1", "--seed", "3",
           "--response-format", str(schema_file), "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = pq.read_table(out).to_pylist()
    for row in rows[:2]:
        assert row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["output_text"]), SCHEMA)
    assert rows[2]["output_text"] in ("left", "right")
    steps = query(tmp_path / "data", "SELECT num_constrained_seqs, mask_fill_s FROM iterations")
    assert steps and all(s["num_constrained_seqs"] >= 1 and s["mask_fill_s"] > 0 for s in steps)
