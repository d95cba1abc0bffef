"""Issue 14 item 3: user SQL under limits that hold, in `batchgen sql` and the dashboard's /api/sql.

Every attack query of the issue is refused or stopped with a one-line error (or answered, for
list_resize, within the query process's own memory cap), the time limit is met within 2 s, results
are capped in bytes, concurrent queries beyond the cap are refused (429 / exit 1), and the serving
dashboard's peak RSS (VmHWM, read from /proc) stays far under 2 GB throughout.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from jobs.store.layout import init_data_dir
from jobs.store.sqlsandbox import (
    QueryBusy,
    QueryOutOfMemory,
    QueryTimeout,
    ResultTooLarge,
    SqlLimits,
    run_sandboxed,
)
from jobs.store.usersql import UserSqlError

GB = 1 << 30
STOPPED = "out of memory|s limit and was"  # stopped by the memory cap or (on a loaded machine) the clock
ATTACKS = {  # the queries -> what the error says (None: may answer, within the child's cap)
    "SELECT len(list_resize([1], 100000000))": None,
    "SELECT repeat('x', 2000000000)": STOPPED,
    "SELECT repeat('x', 1000000) FROM range(1500)": STOPPED + "|cap on results",
    "SELECT len(list_resize([1], 2000000000))": STOPPED,
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sql-limits")
    init_data_dir(path)
    return path


def test_result_bytes_are_capped(data_dir):
    one_mib = SqlLimits(max_result_bytes=1 << 20)
    with pytest.raises(ResultTooLarge, match=r"over the 1 MiB cap on results"):
        run_sandboxed(data_dir, "SELECT repeat('x', 10000) FROM range(200)", one_mib)
    result = run_sandboxed(data_dir, "SELECT repeat('x', 10000) FROM range(50)", one_mib)
    assert len(result.rows) == 50 and not result.truncated


def test_time_limit_is_met_within_2_s(data_dir):
    """A long streaming scan in constant memory is interrupted at the limit; one huge value DuckDB
    cannot interrupt is stopped too, by the kill at the limit or, on a fast machine, by the memory cap
    first: either way within the limit + 2 s."""
    for sql, stopped_by in (("SELECT sum(hash(a)) FROM range(100000000000) t(a)", QueryTimeout),
                            ("SELECT length(string_agg(repeat('y', 1000), '')) FROM range(1000000)",
                             (QueryTimeout, QueryOutOfMemory))):
        start = time.monotonic()
        with pytest.raises(stopped_by, match=r"past its 1 s limit|ran out of memory"):
            run_sandboxed(data_dir, sql, SqlLimits(timeout_s=1.0))
        assert time.monotonic() - start < 1.0 + 2.0, sql


def test_refusals_still_say_why(data_dir):
    with pytest.raises(UserSqlError, match="read_text"):
        run_sandboxed(data_dir, "SELECT * FROM read_text('/etc/passwd')")
    with pytest.raises(UserSqlError, match="only SELECT"):
        run_sandboxed(data_dir, "COPY (SELECT 1) TO '/tmp/x.csv'")
    assert run_sandboxed(data_dir, "SELECT count(*) AS n FROM jobs").rows == [(0,)]


def test_concurrent_queries_beyond_the_cap_are_refused(data_dir):
    layout = init_data_dir(data_dir)
    held = [os.open(layout.locks / f"sql-slot-{i}.lock", os.O_RDWR | os.O_CREAT) for i in range(2)]
    try:
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(QueryBusy, match="2 queries are already running"):
            run_sandboxed(data_dir, "SELECT 1", SqlLimits(max_concurrent=2))
        assert run_sandboxed(data_dir, "SELECT 1", SqlLimits(max_concurrent=3)).rows == [(1,)]
        done = _cli(data_dir, "SELECT 1", "--max-concurrent", "2")
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [
            f"Error: 2 queries are already running over {layout.root} (the cap on concurrent queries); "
            "try again when one has finished"]
    finally:
        for fd in held:
            os.close(fd)
    assert _cli(data_dir, "SELECT 1", "--max-concurrent", "2").returncode == 0


@pytest.mark.parametrize("sql", list(ATTACKS))
def test_cli_attacks_end_in_one_line(data_dir, sql):
    done = _cli(data_dir, sql, "--format", "json")
    expected = ATTACKS[sql]
    if expected is None and done.returncode == 0:
        assert json.loads(done.stdout)[0] == {"len(list_resize(list_value(1), 100000000))": 100000000}
        return
    assert done.returncode == 1, done.stdout[-500:]
    [line] = done.stderr.strip().splitlines()
    assert re.search(expected or STOPPED, line), line


def test_dashboard_survives_every_attack_with_low_rss(data_dir):
    """A real `batchgen dashboard` (waitress): every attack answered 400 with its reason, a 429 beyond
    the cap, and the server's peak RSS under 2 GB (it stays near its idle size)."""
    proc, base = _serve(data_dir)
    try:
        for sql, expected in ATTACKS.items():
            status, body = _post(base, sql)
            if expected is None and status == 200:
                continue
            assert status == 400, (sql, status, body)
            assert re.search(expected or STOPPED, body["error"]), body
        status, body = _post(base, "SELECT sum(a * b) FROM range(1000000) t1(a), range(1000000) t2(b)")
        assert status == 400 and "limit" in body["error"]
        peak = _vm_hwm(proc.pid)
        assert peak < 2 * GB, f"dashboard peak RSS {peak / GB:.2f} GB"
        assert peak < 0.5 * GB, f"dashboard peak RSS {peak / GB:.2f} GB: results reached the server"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_dashboard_answers_429_beyond_the_cap(data_dir):
    from dashboard import create_app

    layout = init_data_dir(data_dir)
    fd = os.open(layout.locks / "sql-slot-0.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        client = create_app({"TESTING": True, "DATA_DIR": data_dir, "SQL_MAX_CONCURRENT": 1}).test_client()
        response = client.post("/api/sql", json={"sql": "SELECT 1"})
        assert response.status_code == 429 and "already running" in response.json["error"]
        assert client.post("/api/sql.csv", data={"sql": "SELECT 1"}).status_code == 429
    finally:
        os.close(fd)
    assert client.post("/api/sql", json={"sql": "SELECT 1"}).json["rows"] == [[1]]


# ---------------------------------------------------------------- helpers


def _cli(data_dir, sql: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs.cli", "sql", sql, "--data-dir", str(data_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _serve(data_dir) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_DASHBOARD_TOKEN"}
    cmd = [sys.executable, "-m", "jobs.cli", "dashboard", "--data-dir", str(data_dir), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline()).group(0)
    for _ in range(100):
        try:
            urllib.request.urlopen(base + "/api/jobs", timeout=5).close()
            break
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    return proc, base


def _post(base: str, sql: str) -> tuple[int, dict]:
    request = urllib.request.Request(base + "/api/sql", data=json.dumps({"sql": sql}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def _vm_hwm(pid: int) -> int:
    """Peak resident set size of a process, in bytes (Linux /proc)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def test_the_query_child_picks_its_own_arrow_pool_whatever_the_parent_uses(monkeypatch):
    """`batchgen` gives its own process the system allocator (jobs.cli); the capped query child keeps
    mimalloc, with which an oversize query fails in under a second instead of ~10 s."""
    from jobs.store import sqlsandbox

    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "system")
    env = sqlsandbox.child_env()
    assert env["ARROW_DEFAULT_MEMORY_POOL"] == sqlsandbox.CHILD_ARROW_POOL == "mimalloc"
    assert env["MALLOC_ARENA_MAX"] == "2" and sqlsandbox._import_root() in env["PYTHONPATH"]
