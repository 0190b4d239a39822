"""CORS: off by default, granted only to the origins [gateway] cors_origins names."""

from __future__ import annotations

import asyncio

from omniflow.roles.gateway.cors import Cors
from omniflow.runtime.config import GatewayConfig


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(app, method: str, origin: str | None, preflight: bool = False) -> list[dict]:
    headers = [(b"origin", origin.encode())] if origin else []
    if preflight:
        headers.append((b"access-control-request-method", b"POST"))
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": method, "path": "/v1/models", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent


def _headers(sent: list[dict]) -> dict[bytes, bytes]:
    return dict(sent[0]["headers"])


def test_cors_is_off_by_default():
    assert GatewayConfig().cors_origins == []


def test_an_allowed_origin_is_granted_and_its_preflight_answered():
    app = Cors(_app, ["http://localhost:3000"])
    granted = _headers(_call(app, "GET", "http://localhost:3000"))
    assert granted[b"access-control-allow-origin"] == b"http://localhost:3000"
    preflight = _call(app, "OPTIONS", "http://localhost:3000", preflight=True)
    assert preflight[0]["status"] == 204
    assert b"x-session-id" in _headers(preflight)[b"access-control-allow-headers"]
    other = _headers(_call(app, "GET", "http://evil.example"))
    assert b"access-control-allow-origin" not in other
    assert b"access-control-allow-origin" not in _headers(_call(app, "GET", None))


def test_a_wildcard_grants_any_origin():
    app = Cors(_app, ["*"])
    assert _headers(_call(app, "GET", "http://a.example"))[b"access-control-allow-origin"] == b"*"
