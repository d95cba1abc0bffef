"""Loopback by default; any other host needs BATCHGEN_DASHBOARD_TOKEN, then every request carries it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from dashboard import create_app
from dashboard.auth import COOKIE
from dashboard.cli import check_bind, dashboard, is_loopback
from jobs.cli import cli

TOKEN = "s3cret-token-for-tests"


@pytest.fixture
def guarded(tmp_path):
    return create_app({"TESTING": True, "DATA_DIR": tmp_path, "TOKEN": TOKEN}).test_client()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts(host):
    assert is_loopback(host)
    check_bind(host, None)  # no token needed


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.5", "example.com", "my-host"])
def test_other_hosts_need_a_token(host):
    assert not is_loopback(host)
    with pytest.raises(Exception, match="BATCHGEN_DASHBOARD_TOKEN"):
        check_bind(host, None)
    check_bind(host, TOKEN)


def test_command_refuses_a_public_host_without_a_token(tmp_path, monkeypatch):
    monkeypatch.delenv("BATCHGEN_DASHBOARD_TOKEN", raising=False)
    result = CliRunner().invoke(cli, ["dashboard", "--host", "0.0.0.0", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "BATCHGEN_DASHBOARD_TOKEN" in result.output


def test_command_is_the_batchgen_subcommand():
    from jobs.cli import COMMANDS, _targets

    # plugged in by its entry point (jobs never imports the dashboard)
    assert "dashboard" not in COMMANDS and _targets()["dashboard"] == "dashboard.cli:dashboard"
    assert cli.get_command(None, "dashboard") is dashboard
    result = CliRunner().invoke(cli, ["dashboard", "--help"])
    assert result.exit_code == 0 and "--host" in result.output and "127.0.0.1" in result.output


@pytest.mark.parametrize("url", ["/", "/workers", "/sql", "/api/jobs", "/static/app.js",
                                 "/static/vendor/uplot/uPlot.iife.min.js", "/jobs/x"])
def test_every_request_needs_the_token(guarded, url):
    response = guarded.get(url)
    assert response.status_code == 401
    assert guarded.post("/api/sql", json={"sql": "SELECT 1"}).status_code == 401


def test_wrong_token_is_refused(guarded):
    assert guarded.get("/api/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert guarded.get("/api/jobs?token=nope").status_code == 401
    guarded.set_cookie(COOKIE, "nope")
    assert guarded.get("/").status_code == 401


def test_bearer_header(guarded):
    response = guarded.get("/api/jobs", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200 and response.json["jobs"] == []


def test_token_in_url_sets_a_cookie_and_leaves_the_url(guarded):
    response = guarded.get(f"/workers?token={TOKEN}&x=1")
    assert response.status_code == 302
    assert response.headers["Location"] == "/workers?x=1"
    cookie = response.headers["Set-Cookie"]
    assert f"{COOKIE}={TOKEN}" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert guarded.get("/workers").status_code == 200  # the cookie now carries it
    with guarded.get("/static/app.js") as static:
        assert static.status_code == 200


def test_no_token_configured_needs_none(client):
    assert client.get("/api/jobs").status_code == 200


def test_token_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_DASHBOARD_TOKEN", TOKEN)
    app = create_app({"TESTING": True, "DATA_DIR": tmp_path})
    assert app.test_client().get("/api/jobs").status_code == 401
