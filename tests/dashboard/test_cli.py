"""`batchgen dashboard` serves the app: started as a real process on 127.0.0.1 and asked over HTTP."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner

from jobs.cli import cli
from tests.dashboard.conftest import JOB_ID


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def wait_until_up(proc: subprocess.Popen, url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"batchgen dashboard exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            get(url)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    pytest.fail(f"batchgen dashboard did not answer on {url} within {timeout_s} s")


def start(data_dir, port: int, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jobs.cli", "dashboard", "--data-dir", str(data_dir), "--port", str(port)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=10)
    proc.stdout.close()


def test_command_serves_the_data_dir_on_loopback(job_data_dir):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_DASHBOARD_TOKEN"}
    proc = start(job_data_dir, port, env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(proc, base + "/api/jobs")
        status, body = get(base + "/")
        assert status == 200 and JOB_ID.encode() in body
        status, body = get(f"{base}/api/jobs/{JOB_ID}")
        assert status == 200 and b'"status":"completed"' in body
    finally:
        stop(proc)


def test_command_with_a_token_guards_every_request(job_data_dir):
    port = free_port()
    proc = start(job_data_dir, port, {**os.environ, "BATCHGEN_DASHBOARD_TOKEN": "tok-123"})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(proc, base + "/api/jobs")
        assert get(base + "/api/jobs")[0] == 401
        assert get(base + "/static/app.js")[0] == 401
        assert get(base + "/api/jobs", token="tok-123")[0] == 200
    finally:
        stop(proc)


def test_serving_pages_never_imports_torch(job_data_dir):
    """The dashboard reads the store only: no model code, so it starts fast on any machine."""
    code = (
        "import sys\n"
        "from dashboard import create_app\n"
        f"client = create_app({{'DATA_DIR': {str(job_data_dir)!r}}}).test_client()\n"
        f"for url in ('/', '/jobs/{JOB_ID}', '/api/jobs/{JOB_ID}/iterations', '/workers', '/sql'):\n"
        "    assert client.get(url).status_code == 200, url\n"
        "print(sorted(m for m in ('torch', 'triton', 'engine.llm_engine') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_command_serves_with_waitress_and_logs_json(job_data_dir):
    """Production server by default; --port 0 binds a free port and the JSON log line says which."""
    cmd = [sys.executable, "-m", "jobs.cli", "dashboard", "--data-dir", str(job_data_dir), "--port", "0",
           "--log-format", "json"]
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_DASHBOARD_TOKEN"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        first = json.loads(proc.stdout.readline())
        assert (first["level"], first["logger"]) == ("INFO", "dashboard.cli")
        assert "waitress" in first["message"]
        base = re.search(r"http://127\.0\.0\.1:\d+", first["message"]).group(0)
        wait_until_up(proc, base + "/api/jobs")
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            assert response.headers["Server"] == "waitress"
            assert b"batchgen:jobs" in response.read()
    finally:
        stop(proc)


def test_dev_flag_serves_with_werkzeugs_reloader(job_data_dir, monkeypatch):
    import werkzeug.serving

    calls = []
    monkeypatch.setattr(werkzeug.serving, "run_simple", lambda *a, **kw: calls.append((a, kw)))
    args = ["dashboard", "--dev", "--data-dir", str(job_data_dir), "--port", "8999"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    [(args, kwargs)] = calls
    assert args[:2] == ("127.0.0.1", 8999)
    assert kwargs["use_reloader"] is True and kwargs["use_debugger"] is False


def test_a_taken_port_exits_1_naming_it(job_data_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "jobs.cli", "dashboard", "--data-dir", str(job_data_dir),
               "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"cannot serve on --host 127.0.0.1 --port {port}" in done.stderr
