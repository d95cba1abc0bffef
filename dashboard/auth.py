"""Who may ask: the Host allow-list, the same-origin rule for POSTs, and the token.

Three before_request hooks guard every request, static files included:

- **Host**: the `Host` header must name an allowed host (loopback names by default; `--host` and
  BATCHGEN_DASHBOARD_ALLOWED_HOSTS, comma-separated, add more). A DNS-rebinding page reaches the
  loopback dashboard under its own name, so it gets a 400 and reads nothing.
- **Origin**: a POST that a browser marks as coming from another site (an `Origin`, else a
  `Referer`, whose host:port is not this request's) is refused with 403 in every mode (waitress or
  the dev server). Clients that send neither header (curl, scripts) are not browsers and pass.
- **Token**: when the app has a TOKEN, a request proves it with `Authorization: Bearer <token>`, or
  with `?token=<token>` once: that sets an HttpOnly cookie and redirects to the same URL without it,
  so the token does not linger in the address bar or in links. `RedactTokens` keeps `token=` values
  out of the access log of werkzeug's server (waitress writes none).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from urllib.parse import urlencode, urlsplit

from flask import Flask, current_app, jsonify, redirect, request

COOKIE = "batchgen_dashboard_token"
ALLOWED_HOSTS_ENV = "BATCHGEN_DASHBOARD_ALLOWED_HOSTS"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_TOKEN_IN_TEXT = re.compile(r"(?i)(token=)[^&\s\"']+")


def init_app(app: Flask) -> None:
    app.config["ALLOWED_HOSTS"] = allowed_hosts(app.config.get("ALLOWED_HOSTS"))
    app.before_request(check_host)
    app.before_request(check_origin)
    app.before_request(require_token)
    redact_access_log()


def allowed_hosts(extra=None) -> frozenset[str]:
    """Loopback names, plus `extra` (names or addresses) and those in BATCHGEN_DASHBOARD_ALLOWED_HOSTS."""
    names = [*LOOPBACK_HOSTS, *(extra or ()), *os.environ.get(ALLOWED_HOSTS_ENV, "").split(",")]
    return frozenset(_bare_host(n) for n in names if n.strip())


def _bare_host(host: str) -> str:
    """'Example.org:8265' -> 'example.org', '[::1]:80' -> '::1' (no port, no brackets, lower case)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def check_host():
    """before_request: a Host header not on the allow-list is a 400 (DNS rebinding, a stray proxy)."""
    host = _bare_host(request.host or "")
    if host in current_app.config["ALLOWED_HOSTS"]:
        return None
    return _refuse(400, f"Host {host!r} is not served here: add it with --host or {ALLOWED_HOSTS_ENV}")


def check_origin():
    """before_request: refuse a POST (or other write) that a browser sent from another origin."""
    if request.method not in UNSAFE_METHODS:
        return None
    source = request.headers.get("Origin") or request.headers.get("Referer")
    if source is None:
        return None
    if source != "null" and urlsplit(source).netloc.lower() == (request.host or "").lower():
        return None
    return _refuse(403, f"cross-origin {request.method} refused (from {source[:100]!r}); "
                        "use the dashboard's own pages or a client without an Origin header")


def require_token():
    """before_request: None lets the request through; a response refuses or redirects it."""
    token = current_app.config.get("TOKEN")
    if not token:
        return None
    if _matches(token, _bearer()) or _matches(token, request.cookies.get(COOKIE)):
        return None
    if _matches(token, request.args.get("token")):
        return _set_cookie_and_redirect(token)
    return _refuse(401, "this dashboard needs its token: open it once as /?token=<BATCHGEN_DASHBOARD_TOKEN>, "
                        "or send 'Authorization: Bearer <token>'")


def _bearer() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def _matches(token: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(token.encode(), given.encode())


def _set_cookie_and_redirect(token: str):
    query = urlencode([(k, v) for k, v in request.args.items(multi=True) if k != "token"])
    response = redirect(request.path + (f"?{query}" if query else ""))
    response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", secure=request.is_secure)
    return response


def _refuse(status: int, message: str):
    if request.path.startswith("/api/"):
        response = jsonify(error=message)
    else:
        response = current_app.response_class(message + "\n", mimetype="text/plain")
    response.status_code = status
    return response


# ---------------------------------------------------------------- the access log


def redact(text: str) -> str:
    """`text` with every `token=<value>` replaced by `token=[redacted]`."""
    return _TOKEN_IN_TEXT.sub(r"\1[redacted]", text)


class RedactTokens(logging.Filter):
    """Rewrites a log record's message so no `token=` value reaches any handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "token=" in message.lower():
            record.msg, record.args = redact(message), ()
        return True


def redact_access_log() -> None:
    """Install RedactTokens on werkzeug's request logger (once per process)."""
    logger = logging.getLogger("werkzeug")
    if not any(isinstance(f, RedactTokens) for f in logger.filters):
        logger.addFilter(RedactTokens())
