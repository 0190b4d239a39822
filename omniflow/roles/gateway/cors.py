"""CORS for the gateway: off unless ``[gateway] cors_origins`` names the origins a browser
page may call it from (``["*"]``: any). A preflight (``OPTIONS``) is answered here; other
responses to an allowed origin get ``Access-Control-Allow-Origin``. Host and Origin checks
against DNS rebinding are the limits module's; this only grants what the config names."""

from __future__ import annotations

from typing import Any

from omniflow.roles.gateway.http import Receive, Send, header

_ALLOW_HEADERS = b"authorization, content-type, x-session-id, openai-beta"


class Cors:
    """An ASGI wrapper granting cross-origin calls from ``origins``."""

    def __init__(self, app: Any, origins: list[str]) -> None:
        self.app = app
        self.any = "*" in origins
        self.origins = {o.rstrip("/").encode() for o in origins}

    def allowed(self, origin: bytes | None) -> bool:
        return origin is not None and (self.any or origin.rstrip(b"/") in self.origins)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        origin = header(scope, b"origin") if scope["type"] == "http" else None
        if not self.allowed(origin):
            await self.app(scope, receive, send)
            return
        granted = [
            (b"access-control-allow-origin", b"*" if self.any else origin or b""),
            (b"vary", b"origin"),
        ]
        if scope["method"] == "OPTIONS" and header(scope, b"access-control-request-method"):
            headers = granted + [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", _ALLOW_HEADERS),
                (b"access-control-max-age", b"600"),
                (b"content-length", b"0"),
            ]
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *granted]}
            await send(message)

        await self.app(scope, receive, with_headers)
