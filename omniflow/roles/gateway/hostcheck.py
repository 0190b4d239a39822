"""Who may call the gateway from a browser: Host and Origin checked, JSON bodies typed.

A web page on another site must not reach a gateway on loopback (CSRF: a form POST is a
"simple" request, sent without a preflight) nor, by pointing its own DNS name at
127.0.0.1, read its answers (DNS rebinding). So, before any route runs:

- ``Host`` must name an allowed host: the loopback names, the bind host, and
  ``[gateway] allowed_hosts`` (``"*"``: any; a wildcard bind with none listed checks
  none). Else 403, naming the header.
- ``Origin``, when a browser sends one, must be the gateway itself (same host and port)
  or one of ``[gateway] cors_origins``. Else 403. Both apply to WebSocket upgrades
  (``/v1/realtime``) too: a refused one is closed before it is accepted (HTTP 403).
- A POST to a JSON route must say ``Content-Type: application/json`` (a form cannot);
  else 415. Multipart routes (``/v1/images/edits``) check their own type.
"""

from __future__ import annotations

from typing import Any

from omniflow.roles.gateway.http import Receive, Send, answer, header

LOOPBACK = ("localhost", "127.0.0.1", "::1", "localhost.localdomain")
WILDCARD = ("0.0.0.0", "::", "")
JSON_ROUTES = frozenset(
    ("/v1/chat/completions", "/v1/completions", "/v1/audio/speech", "/v1/images/generations")
)


def host_name(value: bytes) -> str:
    """The host of a ``Host`` header or an origin's authority, without the port."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):  # [::1]:8000
        return text[1 : text.find("]")] if "]" in text else text
    return text.rpartition(":")[0] if text.count(":") == 1 else text


class HostCheck:
    """An ASGI wrapper refusing foreign Host and Origin headers and untyped JSON posts."""

    def __init__(
        self, app: Any, bind_host: str, allowed_hosts: list[str], cors_origins: list[str]
    ) -> None:
        self.app = app
        listed = [h.lower() for h in allowed_hosts]
        self.any_host = "*" in listed or (bind_host in WILDCARD and not listed)
        self.hosts = {*LOOPBACK, bind_host.lower().strip("[]"), *listed}
        self.any_origin = "*" in cors_origins
        self.origins = {o.rstrip("/").lower().encode() for o in cors_origins}

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            refusal = self.refusal(scope)
            if refusal is not None and scope["type"] == "websocket":  # a 403 to the upgrade
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 1008, "reason": refusal[1][:120]})
                return
            if refusal is not None:
                status, message, param = refusal
                error = {"message": message, "type": "invalid_request_error", "param": param}
                await answer(send, status, {"error": {**error, "code": None}})
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: dict[str, Any]) -> tuple[int, str, str] | None:
        host = header(scope, b"host")
        if host is not None and not self.any_host and host_name(host) not in self.hosts:
            shown = host.decode("latin-1")[:100]
            return 403, f"Host {shown!r} is not served here ([gateway] allowed_hosts)", "Host"
        origin = header(scope, b"origin")
        if origin is not None and not self._origin_ok(origin, host):
            shown = origin.decode("latin-1")[:100]
            return (
                403,
                f"Origin {shown!r} may not call this gateway ([gateway] cors_origins)",
                ("Origin"),
            )
        if scope.get("method") == "POST" and scope["path"] in JSON_ROUTES:
            kind = (header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                shown = kind.decode("latin-1")[:100] or "none"
                return (
                    415,
                    f"Content-Type {shown!r}: this route takes application/json",
                    ("Content-Type"),
                )
        return None

    def _origin_ok(self, origin: bytes, host: bytes | None) -> bool:
        if self.any_origin or origin.rstrip(b"/").lower() in self.origins:
            return True
        scheme, sep, authority = origin.lower().partition(b"://")
        # Same origin: the page was served by this gateway, under the Host it asked for.
        same = scheme in (b"http", b"https", b"ws", b"wss")
        return bool(sep) and same and authority == (host or b"").lower()
