"""Issue 14 item 4: DNS rebinding (Host allow-list), cross-origin POSTs and tokens in the access log."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from werkzeug.serving import make_server

from dashboard import create_app
from dashboard.auth import ALLOWED_HOSTS_ENV, redact

TOKEN = "s3cret-token-for-the-log-test"


@pytest.fixture
def client(tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOWED_HOSTS_ENV, raising=False)
    return create_app({"TESTING": True, "DATA_DIR": tmp_path}).test_client()


@pytest.mark.parametrize("host", ["localhost", "localhost:8265", "127.0.0.1:8265", "[::1]:8265"])
def test_loopback_names_are_served(client, host):
    assert client.get("/api/jobs", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("url", ["/", "/api/jobs", "/jobs/j1/outputs.parquet", "/static/app.css"])
def test_a_rebinding_host_reads_nothing(client, url):
    response = client.get(url, headers={"Host": "attacker.example:8265"})
    assert response.status_code == 400
    assert b"attacker.example" in response.data and ALLOWED_HOSTS_ENV.encode() in response.data


def test_allowed_hosts_from_the_flag_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ALLOWED_HOSTS_ENV, "dash.internal, other.example")
    app = create_app({"TESTING": True, "DATA_DIR": tmp_path, "ALLOWED_HOSTS": ["10.0.0.5"]})
    client = app.test_client()
    for host in ("dash.internal:8265", "OTHER.example", "10.0.0.5:8265", "localhost"):
        assert client.get("/api/jobs", headers={"Host": host}).status_code == 200, host
    assert client.get("/api/jobs", headers={"Host": "10.0.0.6"}).status_code == 400


@pytest.mark.parametrize("headers", [
    {"Origin": "http://attacker.example"},
    {"Origin": "null"},
    {"Origin": "http://localhost:9999"},  # another port is another origin
    {"Referer": "http://attacker.example/page.html"},
])
def test_cross_origin_form_post_is_refused(client, headers):
    response = client.post("/api/sql", data={"sql": "SELECT 1"}, headers={"Host": "localhost:8265"} | headers)
    assert response.status_code == 403
    assert "cross-origin" in response.get_json()["error"]


@pytest.mark.parametrize("headers", [{"Origin": "http://localhost:8265"},
                                     {"Referer": "http://localhost:8265/sql"}, {}])
def test_same_origin_and_non_browser_posts_pass(client, headers):
    response = client.post("/api/sql", json={"sql": "SELECT 1"}, headers={"Host": "localhost:8265"} | headers)
    assert response.status_code != 403  # 400 here: the data dir has no store; the origin check passed


def test_token_never_reaches_the_dev_servers_access_log(tmp_path, caplog):
    app = create_app({"DATA_DIR": tmp_path, "TOKEN": TOKEN})
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.INFO, logger="werkzeug"):
            url = f"http://127.0.0.1:{server.port}/api/jobs?token={TOKEN}&x=1"
            with pytest.raises(urllib.error.HTTPError):  # the redirect drops the token; no cookie jar here
                urllib.request.urlopen(urllib.request.Request(url), timeout=10).close()
    finally:
        server.shutdown()
        thread.join(5)
    lines = [r.getMessage() for r in caplog.records if r.name == "werkzeug"]
    assert any("/api/jobs?token=[redacted]&x=1" in line for line in lines), lines
    assert not any(TOKEN in line for line in lines)


def test_redact():
    assert redact('"GET /jobs/a?x=1&token=abc&TOKEN=def HTTP/1.1" 302') == \
        '"GET /jobs/a?x=1&token=[redacted]&TOKEN=[redacted] HTTP/1.1" 302'


def test_waitress_refuses_rebinding_and_cross_origin_posts(tmp_path):
    """The production server runs the same checks (they are the app's, not the server's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHGEN_DASHBOARD_TOKEN", ALLOWED_HOSTS_ENV)}
    cmd = [sys.executable, "-m", "jobs.cli", "dashboard", "--data-dir", str(tmp_path), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        base = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline()).group(0)

        def status(headers, data=None):
            request = urllib.request.Request(base + "/api/sql" if data else base + "/api/jobs", data=data,
                                             headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                exc.close()
                return exc.code

        assert _retry(lambda: status({})) == 200
        assert status({"Host": "rebind.attacker.example"}) == 400
        form = b"sql=SELECT+1"
        assert status({"Origin": "http://attacker.example",
                       "Content-Type": "application/x-www-form-urlencoded"}, form) == 403
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def _retry(call, tries: int = 50):
    for _ in range(tries - 1):
        try:
            return call()
        except (urllib.error.URLError, ConnectionError):
            threading.Event().wait(0.2)
    return call()
