"""Token check: when the app has a TOKEN, every request must prove it knows it.

The dashboard binds 127.0.0.1 and needs no token there; on any other host `batchgen dashboard`
refuses to start without BATCHGEN_DASHBOARD_TOKEN, and then this hook guards every request,
static files included. A request proves the token with `Authorization: Bearer <token>`, or with
`?token=<token>` once: that sets an HttpOnly cookie and redirects to the same URL without it, so
the token does not linger in the address bar or in links.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlencode

from flask import Flask, current_app, jsonify, redirect, request

COOKIE = "batchgen_dashboard_token"


def init_app(app: Flask) -> None:
    app.before_request(require_token)


def require_token():
    """before_request: None lets the request through; a response refuses or redirects it."""
    token = current_app.config.get("TOKEN")
    if not token:
        return None
    if _matches(token, _bearer()) or _matches(token, request.cookies.get(COOKIE)):
        return None
    if _matches(token, request.args.get("token")):
        return _set_cookie_and_redirect(token)
    return _refuse()


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


def _refuse():
    message = ("this dashboard needs its token: open it once as /?token=<BATCHGEN_DASHBOARD_TOKEN>, "
               "or send 'Authorization: Bearer <token>'")
    if request.path.startswith("/api/"):
        response = jsonify(error=message)
    else:
        response = current_app.response_class(message + "\n", mimetype="text/plain")
    response.status_code = 401
    return response
