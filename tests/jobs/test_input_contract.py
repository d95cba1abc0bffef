"""Input validation and sharding (no engine, no broker): jobs.input_contract, jobs.submit.prepare_job."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.sampling_params import SamplingParams
from jobs.broker import resolve_broker
from jobs.input_contract import InputError, resolve_input_files, row_request, sampling_defaults
from jobs.manifest import REQUEST_ID_COLUMN, ROW_COLUMN, JobPaths, load_manifest
from jobs.submit import JobRequest, prepare_job


def _write(path, **columns) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


def _prepare(tmp_path, source, shard_size=2, **sampling):
    data_dir = tmp_path / "data"
    req = JobRequest(source=str(source), data_dir=str(data_dir), engine={"model": "tiny-random"},
                     sampling=sampling, shard_size=shard_size)
    return prepare_job(req, resolve_broker(data_dir, embedded=True))


def test_shards_keep_input_order_ids_and_extra_columns(tmp_path):
    src = _write(tmp_path / "in.parquet", prompt=[f"p{i}" for i in range(5)], topic=list("abcde"),
                 max_tokens=[1, None, 3, None, 5])
    m = _prepare(tmp_path, src, shard_size=2, max_tokens=7)
    assert (m.num_requests, [s.num_requests for s in m.shards]) == (5, [2, 2, 1])
    assert [s.first_row for s in m.shards] == [0, 2, 4]
    assert m.extra_columns == ["topic"] and m.sampling_defaults == {"max_tokens": 7}
    shard = pq.read_table(m.shards[1].path)
    assert shard.column(ROW_COLUMN).to_pylist() == [2, 3]
    assert shard.column(REQUEST_ID_COLUMN).to_pylist() == ["2", "3"]
    assert shard.column("topic").to_pylist() == ["c", "d"]
    assert load_manifest(m.data_dir, m.job_id) == m
    assert all(p.startswith("/") for p in [m.data_dir, *m.inputs, *(s.path for s in m.shards)])


def test_directory_and_glob_inputs_concatenate_in_name_order(tmp_path):
    d = tmp_path / "many"
    d.mkdir()
    _write(d / "b.parquet", prompt=["b0"], id=["x"])
    _write(d / "a.parquet", prompt=["a0", "a1"], id=["y", "z"])
    m = _prepare(tmp_path, d, shard_size=10)
    ids = pq.read_table(m.shards[0].path).column(REQUEST_ID_COLUMN).to_pylist()
    assert ids == ["y", "z", "x"]
    assert len(resolve_input_files(str(d / "*.parquet"))) == 2


@pytest.mark.parametrize("columns, message", [
    ({"text": ["a"]}, "needs a 'prompt' (string) or 'messages'"),
    ({"prompt": [1, 2]}, "column 'prompt' must be a string, got int64"),
    ({"prompt": ["a"], "max_tokens": ["many"]}, "column 'max_tokens' must be an integer"),
    ({"prompt": ["a"], "temperature": ["hot"]}, "column 'temperature' must be a number"),
    ({"prompt": ["a"], "ignore_eos": [1]}, "column 'ignore_eos' must be a boolean"),
    ({"prompt": ["a"], "stop": [1]}, "column 'stop' must be a string or a list of strings"),
    ({"prompt": ["a"], "id": [1.5]}, "column 'id' must be an integer or a string"),
    ({"messages": [["hi"]]}, "column 'messages' must be a list of struct<role: string, content: string>"),
    ({"prompt": ["a", "b"], "id": [7, 7]}, "row 1: duplicate id '7' (first used by input row 0)"),
    ({"prompt": ["a", "b"], "id": ["x", None]}, "row 1: column 'id' is null"),
    ({"prompt": ["a", "b"], "max_tokens": [4.0, 2.5]}, "row 1: column 'max_tokens' must be an integer"),
    ({"prompt": ["a"], "output_text": ["x"]}, "column 'output_text' clashes with an output column"),
    ({"prompt": ["a"], "request_id": ["x"]}, "the row id column is 'id'"),
    ({"prompt": ["a"], "_bg_row": [1]}, "reserved prefix '_bg_'"),
])
def test_bad_columns_and_ids_name_the_column_and_row(tmp_path, columns, message):
    src = _write(tmp_path / "bad.parquet", **columns)
    with pytest.raises(InputError, match=None) as info:
        _prepare(tmp_path, src)
    assert message in str(info.value) and "bad.parquet" in str(info.value)
    assert not (tmp_path / "data" / "jobs").exists() or not any(
        p.name.startswith("job-") for p in (tmp_path / "data" / "jobs").iterdir()), "no job left behind"


def test_unreadable_missing_and_mismatched_files(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"this is not parquet")
    with pytest.raises(InputError, match="junk.parquet: not a readable Parquet file"):
        _prepare(tmp_path, junk)
    with pytest.raises(InputError, match="does not exist"):
        _prepare(tmp_path, tmp_path / "nope.parquet")
    with pytest.raises(InputError, match="no file matches"):
        _prepare(tmp_path, tmp_path / "nope*.parquet")
    d = tmp_path / "mixed"
    d.mkdir()
    _write(d / "a.parquet", prompt=["a"])
    _write(d / "b.parquet", prompt=["b"], topic=["t"])
    with pytest.raises(InputError, match=r"b.parquet: columns differ .* extra \['topic'\]"):
        _prepare(tmp_path, d)
    empty = _write(tmp_path / "empty.parquet", prompt=pa.array([], pa.string()))
    with pytest.raises(InputError, match="has no rows"):
        _prepare(tmp_path, empty)


def test_job_level_checks(tmp_path):
    src = _write(tmp_path / "in.parquet", prompt=["a"])
    with pytest.raises(InputError, match="--shard-size must be >= 1"):
        _prepare(tmp_path, src, shard_size=0)
    with pytest.raises(InputError, match="temperature must be a finite number in \\[0, inf\\)"):
        _prepare(tmp_path, src, temperature=-1.0)
    m = _prepare(tmp_path, src)
    with pytest.raises(InputError, match="already exists"):
        req = JobRequest(str(src), m.data_dir, {}, {}, 1, job_id=m.job_id)
        prepare_job(req, resolve_broker(m.data_dir, embedded=True))
    assert JobPaths.of(m.data_dir, m.job_id).manifest.exists()


def test_rows_that_cannot_run_get_an_error_and_overrides_apply():
    defaults = sampling_defaults(max_tokens=8, temperature=0.0, top_p=None)
    assert defaults == {"max_tokens": 8, "temperature": 0.0}
    ok = row_request({"prompt": "hi", "max_tokens": 3, "stop": "x", "seed": 5.0}, defaults)
    assert ok.error is None and ok.params == SamplingParams(max_tokens=3, temperature=0.0, stop=["x"], seed=5)
    assert row_request({"prompt": "hi", "max_tokens": None}, defaults).params.max_tokens == 8
    assert row_request({"prompt": ""}, defaults).error == "empty prompt"
    assert row_request({"prompt": None, "messages": None}, defaults).error.startswith("empty prompt")
    bad_max = row_request({"prompt": "a", "max_tokens": 0}, defaults)
    assert "max_tokens must be an integer >= 1" in bad_max.error
    bad_top_p = row_request({"prompt": "a", "top_p": 2.0}, defaults)
    assert "top_p must be a finite number in (0, 1]" in bad_top_p.error
    chat = row_request({"messages": [{"role": "user", "content": "hi"}], "prompt": None}, defaults)
    assert chat.prompt is None and chat.messages == [{"role": "user", "content": "hi"}]
    both = row_request({"messages": [{"role": "user", "content": "hi"}], "prompt": "which?"}, defaults)
    assert both.error == "both 'prompt' and 'messages' are set; give one of them"  # never dropped silently
    bad = row_request({"messages": [{"role": "user", "content": None}]}, defaults)
    assert "messages[0]" in bad.error
