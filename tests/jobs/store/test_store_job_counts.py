"""Request outcome counts carried by the commits (store schema v3) against the full scan of the outputs.

`status` and the dashboard's job summaries read a job's request counts and error rows from its winning
commits (the `jobs` view's requests_* and error_rows columns) instead of grouping every output row;
these tests hold them equal to the old scan (jobs.request_counts.fetch_counts, the _SCAN queries) on
jobs with duplicate commits, retries, failures, revoked commits, copies of the data dir, and data dirs
whose commits were written before the counts existed.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dashboard import queries
from jobs.cli import cli
from jobs.request_counts import OUTCOMES, fetch_counts, job_counts
from jobs.store import STATUS_VIEWS, Store, connect, connect_reporting
from jobs.store.catalog import USER_VIEWS, view_definitions
from jobs.store.layout import Layout
from jobs.store.schemas import JobRecord, ShardEvent
from tests.jobs.helpers import MODEL

NEW_COMMIT_COLUMNS = ("requests_completed", "requests_failed", "requests_cancelled", "error_rows")
JOB, OTHER = "counted", "plain"


def _rows(shard: int, reasons: list[tuple[str, ...]]) -> list[dict]:
    """Output rows: request i of the shard has one sample per reason in reasons[i]."""
    return [{"request_id": f"{shard}-{i}", "sample_index": k, "output_text": "o", "finish_reason": reason,
             "prompt_tokens": 3, "output_tokens": 2, "error": "boom" if reason == "error" else None}
            for i, samples in enumerate(reasons) for k, reason in enumerate(samples)]


def _attempt(store: Store, shard: int, attempt: int, reasons, *, end: str = "commit", job: str = JOB):
    att = store.begin_attempt(job, shard, attempt, f"w{attempt}", num_requests=len(reasons))
    rows = _rows(shard, reasons)
    att.add_outputs(rows[: len(rows) // 2])  # a request's samples may land in two parts
    att.flush()
    att.add_outputs(rows[len(rows) // 2:])
    if end == "commit":
        return att.commit()
    if end == "fail":
        att.fail("engine died")
    else:
        att.flush()  # killed: rows written, never committed nor failed
    return None


def make_jobs(data_dir: Path) -> None:
    """A job whose shards take every path a commit can take, and a plain one beside it."""
    store = Store(data_dir)
    now = time.time()
    store.record_job(JobRecord(JOB, "tiny", 24, 7, now - 60))
    store.record_job(JobRecord(OTHER, "tiny", 4, 1, now - 30))
    store.record_shard_events([ShardEvent(JOB, s, "queued", now - 60) for s in range(7)])
    mixed = [("stop", "stop"), ("stop", "error"), ("cancelled", "length"), ("error", "cancelled")]
    # 0: mixed outcomes, samples split across parts
    _attempt(store, 0, 1, mixed)
    # 1: two attempts commit (a duplicate): the first commit counts, not the second's errors
    _attempt(store, 1, 1, [("stop",)] * 4)
    time.sleep(0.01)
    _attempt(store, 1, 2, [("error",)] * 4)
    # 2: a failed attempt with error rows, then a retry that commits
    _attempt(store, 2, 1, [("error",)] * 4, end="fail")
    _attempt(store, 2, 2, [("length",), ("cancelled",), ("stop",), ("stop",)])
    # 3: a killed attempt (rows, no commit) still running: nothing counts
    _attempt(store, 3, 1, [("error",)] * 4, end="kill")
    # 4: out of retries
    _attempt(store, 4, 1, [("error",)] * 4, end="fail")
    # 5: committed, revoked (its rows were lost: `store check --repair`), committed again
    lost = _attempt(store, 5, 1, [("error",)] * 4)
    store.revoke_commit(lost, "part file lost")
    _attempt(store, 5, 2, [("stop",), ("error",), ("stop",), ("cancelled",)])
    # 6: queued
    _attempt(store, 0, 1, [("stop",), ("error", "error"), ("length",), ("stop",)], job=OTHER)


def scanned(data_dir: Path) -> dict[str, dict]:
    """The old answers: request outcomes and error rows grouped from every output row."""
    con = connect(data_dir)
    try:
        counts = {r["job_id"]: {**{k: r[k] for k in OUTCOMES}, "error_rows": 0} for r in fetch_counts(con)}
        for job_id, n in con.execute("SELECT job_id, count(*) FROM outputs WHERE finish_reason = 'error' "
                                     "GROUP BY job_id").fetchall():
            counts[job_id]["error_rows"] = n
    finally:
        con.close()
    return counts


def summarised(data_dir: Path) -> dict[str, dict]:
    con = connect(data_dir)
    try:
        cur = con.execute("SELECT job_id, requests_completed, requests_failed, requests_cancelled, "
                          "error_rows, counts_complete FROM jobs")
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    finally:
        con.close()
    assert all(r.pop("counts_complete") for r in rows)
    return {r.pop("job_id"): {k.removeprefix("requests_"): v for k, v in r.items()} for r in rows}


def drop_commit_counts(data_dir: Path, only: str | None = None) -> int:
    """Rewrite commit files as a batchgen before schema v3 wrote them (no count columns); with `only`,
    just the files whose name contains it. How many files."""
    files = [p for p in (Path(data_dir) / "store" / "tables" / "commits").rglob("*.parquet")
             if p.name != "_schema.parquet" and (only is None or only in p.name)]
    for path in files:
        table = pq.read_table(path)
        pq.write_table(table.drop_columns([c for c in NEW_COMMIT_COLUMNS if c in table.column_names]), path)
    return len(files)


def test_the_commits_counts_equal_the_scan_of_the_outputs(tmp_path):
    make_jobs(tmp_path)
    old = scanned(tmp_path)
    assert old == {JOB: {"completed": 10, "failed": 3, "cancelled": 3, "error_rows": 3},  # as built
                   OTHER: {"completed": 3, "failed": 1, "cancelled": 0, "error_rows": 2}}
    assert summarised(tmp_path) == old
    copy = tmp_path.parent / f"{tmp_path.name}-copy"  # a copied data dir counts the same, from its own files
    shutil.copytree(tmp_path, copy)
    shutil.rmtree(tmp_path)
    assert summarised(copy) == old == scanned(copy)


def test_status_and_the_job_summaries_read_the_counts_from_the_commits(tmp_path):
    from jobs.status import jobs_status

    make_jobs(tmp_path)
    old = scanned(tmp_path)
    by_job = {r["job_id"]: r["request_counts"] for r in jobs_status(str(tmp_path))}
    assert by_job == {j: {"total": n, **{k: old[j][k] for k in OUTCOMES}} for j, n in ((JOB, 24), (OTHER, 4))}
    con = connect(tmp_path)
    try:
        one = {"job_id": JOB, "limit": 1}
        for summary, scan, params in ((queries.JOBS_SUMMARY, queries.JOBS_SUMMARY_SCAN, {"limit": 10}),
                                      (queries.JOB_SUMMARY, queries.JOB_SUMMARY_SCAN, one)):
            # (the view's name, not a column such as the commits' num_outputs)
            assert not re.search(r"\boutputs\b", summary) and re.search(r"\boutputs\b", scan)
            new, was = con.execute(summary, params).fetchall(), con.execute(scan, params).fetchall()
            assert new == was and len(new) == (1 if "job_id" in params else 2)
    finally:
        con.close()


def test_a_data_dir_written_before_the_counts_is_counted_from_the_outputs(tmp_path):
    make_jobs(tmp_path)
    old = scanned(tmp_path)
    assert drop_commit_counts(tmp_path) == 8  # 7 of the job's commits and revocations, 1 of the other
    (tmp_path / "store" / "version.json").write_text(json.dumps({"schema_version": 2}))
    con = connect(tmp_path)  # migrates the data dir (nothing to rewrite: old commits read null)
    try:
        rows = con.execute("SELECT job_id, counts_complete, requests_completed FROM jobs ORDER BY job_id")
        assert rows.fetchall() == [(JOB, False, 0), (OTHER, False, 0)]
    finally:
        con.close()
    jobs = _jobs_rows(tmp_path)
    assert job_counts(str(tmp_path), jobs) == {j: {k: old[j][k] for k in OUTCOMES} for j in (JOB, OTHER)}
    from dashboard import create_app

    client = create_app({"TESTING": True, "DATA_DIR": tmp_path}).test_client()
    listed = {j["job_id"]: j["error_rows"] for j in client.get("/api/jobs").get_json()["jobs"]}
    assert listed == {JOB: old[JOB]["error_rows"], OTHER: old[OTHER]["error_rows"]}
    assert client.get(f"/api/jobs/{JOB}").get_json()["job"]["error_rows"] == old[JOB]["error_rows"]


def test_a_job_with_some_commits_from_before_the_counts_is_counted_from_the_outputs(tmp_path):
    """A data dir upgraded while a job ran: its older commits lack the counts, its newer ones carry
    them; summing the newer ones alone would undercount."""
    make_jobs(tmp_path)
    old = scanned(tmp_path)
    assert drop_commit_counts(tmp_path, only=f"{JOB}~s000000~") == 1
    jobs = {j["job_id"]: j for j in _jobs_rows(tmp_path)}
    assert (jobs[JOB]["counts_complete"], jobs[OTHER]["counts_complete"]) == (False, True)
    assert jobs[JOB]["requests_failed"] < old[JOB]["failed"]  # what the new commits alone would say
    counts = job_counts(str(tmp_path), list(jobs.values()))
    assert counts == {j: {k: old[j][k] for k in OUTCOMES} for j in (JOB, OTHER)}


def test_unreadable_outputs_leave_the_counts_unknown(tmp_path, caplog):
    make_jobs(tmp_path)
    assert job_counts(str(tmp_path), _jobs_rows(tmp_path), "outputs part x.parquet is corrupt") is None
    assert "request counts unknown: outputs part x.parquet is corrupt" in caplog.text
    drop_commit_counts(tmp_path)  # the fallback's scan fails too: unknown, not a traceback
    bad = next((tmp_path / "store" / "tables" / "outputs" / "raw").rglob("*.parquet"))
    bad.write_bytes(bad.read_bytes()[:100])
    con, broken = connect_reporting(tmp_path, views=STATUS_VIEWS)
    con.close()
    assert str(bad) in broken["outputs"]
    rows = [dict(r, counts_complete=False) for r in _jobs_rows(tmp_path)]
    assert job_counts(str(tmp_path), rows) is None


def _jobs_rows(data_dir: Path) -> list[dict]:
    con = connect(data_dir, views=STATUS_VIEWS)
    try:
        cur = con.execute("SELECT * FROM jobs ORDER BY job_id")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    finally:
        con.close()


@pytest.mark.parametrize("view", USER_VIEWS)
def test_a_connection_with_some_views_answers_them(tmp_path, view):
    make_jobs(tmp_path)
    full = connect(tmp_path)
    some = connect(tmp_path, views=[view])
    try:
        sql = f"SELECT * FROM {view} ORDER BY ALL"
        assert some.execute(sql).fetchall() == full.execute(sql).fetchall()
        made = {r[0] for r in some.execute("SELECT schema_name || '.' || view_name FROM duckdb_views() "
                                           "WHERE NOT internal").fetchall()}
        assert len(made) < len(view_definitions(Layout.of(tmp_path)))  # only what it reads
    finally:
        full.close()
        some.close()


def test_a_connection_refuses_an_unknown_view(tmp_path):
    with pytest.raises(ValueError, match=r"no such view\(s\) \['jobz'\]"):
        connect(tmp_path, views=["jobz"])


def test_status_of_one_job_counts_from_the_commits(tmp_path):
    from jobs.manifest import load_manifest
    from jobs.status import job_status

    data = tmp_path / "data"
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(6)]}), src)
    sub = CliRunner().invoke(cli, ["submit", str(src), "--model", MODEL, "--data-dir", str(data),
                                   "--shard-size", "3", "--queue", "q.counts"])
    job_id = sub.output.strip().splitlines()[-1]
    store = Store(data)
    for shard, reasons in ((0, [("stop",), ("error",), ("cancelled",)]), (1, [("length",)] * 3)):
        att = store.begin_attempt(job_id, shard, 1, "w1", num_requests=3)
        att.add_outputs([dict(r, request_id=str(3 * shard + i)) for i, r in enumerate(_rows(shard, reasons))])
        att.commit()
    info = job_status(load_manifest(str(data), job_id), all_shards=False)
    assert info["request_counts"] == {"total": 6, "completed": 4, "failed": 1, "cancelled": 1}
    assert "requests_completed" not in info and "counts_complete" not in info
    drop_commit_counts(data, only="~s000001~")
    info = job_status(load_manifest(str(data), job_id), all_shards=False)
    assert info["request_counts"] == {"total": 6, "completed": 4, "failed": 1, "cancelled": 1}


def test_a_part_deleted_while_the_views_are_bound_binds_them_again(tmp_path, monkeypatch):
    """Garbage collection may delete a listed part before a view over it is bound (the benchmark's
    `status` met it): the connection binds again, and gives up only after BIND_TRIES."""
    import duckdb

    from jobs.store import catalog

    make_jobs(tmp_path)
    real, calls = catalog.create_views, []

    def flaky(con, layout, relative_to=None, views=None, fail=1):
        calls.append(views)
        if len(calls) <= fail:
            raise duckdb.IOException('IO Error: Cannot open file "x.parquet": No such file or directory')
        return real(con, layout, relative_to, views)

    monkeypatch.setattr(catalog, "create_views", flaky)
    con = connect(tmp_path, views=STATUS_VIEWS)
    assert con.execute("SELECT count(*) FROM jobs").fetchone() == (2,) and calls == [STATUS_VIEWS] * 2
    con.close()
    calls.clear()
    monkeypatch.setattr(catalog, "create_views", lambda *a, **k: flaky(*a, **k, fail=99))
    with pytest.raises(duckdb.IOException, match="x.parquet"):
        connect(tmp_path)
    assert len(calls) == catalog.BIND_TRIES


def test_a_scan_whose_part_vanished_while_bound_is_listed_again(tmp_path):
    """A part deleted between a scan's listing and its bind (garbage collection) is not an unreadable
    kind: the scan is bound again; one that stays unreadable is reported after BIND_TRIES."""
    import duckdb

    from jobs.store import catalog

    class Con:
        def __init__(self, fails: int) -> None:
            self.fails, self.calls = fails, 0

        def execute(self, sql: str):
            self.calls += 1
            if self.calls <= self.fails:
                raise duckdb.IOException('IO Error: Cannot open file "x.parquet": No such file or directory')

    once = Con(fails=1)
    catalog._create_scan(once, "_bg.scan_commits", "SELECT 1")
    assert once.calls == 2
    always = Con(fails=99)
    with pytest.raises(duckdb.IOException):
        catalog._create_scan(always, "_bg.scan_commits", "SELECT 1")
    assert always.calls == catalog.BIND_TRIES


def test_every_finish_reason_has_a_request_outcome():
    """A commit folds each output row's finish_reason into its request's outcome: a reason added to
    the schema without a rank would fail the commit."""
    from jobs.store import parts, schemas

    assert set(parts._REASON_RANK) == set(schemas.FINISH_REASONS)
    assert set(parts._REASON_RANK.values()) == set(parts._OUTCOME_RANK.values())


def test_status_of_one_job_lists_only_that_jobs_parts(tmp_path, monkeypatch):
    """`status JOB`'s queries run over a listing of that job's parts (another job's are not opened),
    with the same answers as over every part."""
    from jobs.manifest import load_manifest
    from jobs.status import job_status
    from jobs.store import listing

    data = tmp_path / "data"
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(6)]}), src)
    ids = []
    for queue in ("q.one", "q.two"):
        sub = CliRunner().invoke(cli, ["submit", str(src), "--model", MODEL, "--data-dir", str(data),
                                       "--shard-size", "3", "--queue", queue])
        ids.append(sub.output.strip().splitlines()[-1])
    store = Store(data)
    for job_id in ids:
        att = store.begin_attempt(job_id, 0, 1, "w1", num_requests=3)
        att.add_outputs([dict(r, request_id=str(i)) for i, r in enumerate(_rows(0, [("stop",)] * 3))])
        att.commit()
    scopes = []
    real = listing.list_files
    monkeypatch.setattr(listing, "list_files",
                        lambda layout, job_id=None: scopes.append(job_id) or real(layout, job_id))
    scoped = job_status(load_manifest(str(data), ids[0]))
    assert ids[0] in scopes and ids[1] not in scopes
    monkeypatch.setattr(listing, "list_files", lambda layout, job_id=None: real(layout))  # every part
    assert job_status(load_manifest(str(data), ids[0])) == scoped
    assert scoped["shard_counts"]["completed"] == 1 and scoped["request_counts"]["completed"] == 3
