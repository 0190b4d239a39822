"""The gateway's bounds per connection and on request bodies, so that idle sockets, slow
or huge headers and bodies held one byte short cost a bounded number of fds and bytes.

- Connections: past ``[gateway] max_connections`` (lowered to what ``RLIMIT_NOFILE``
  leaves after a reserve for ZeroMQ's sockets) a new connection gets a 503 and is closed.
- Headers: a request whose head takes longer than ``header_timeout_s`` gets a 408, one
  past ``max_header_kb`` a 431; both close the connection. An idle keep-alive connection
  closes after ``keepalive_timeout_s`` (uvicorn's own timer).
- Bodies: at most ``max_body_reads`` bodies are read at once and at most
  ``body_memory_mb`` of them held while they arrive (503 past either: retry), and each
  must arrive within ``body_timeout_s`` (408).
"""

from __future__ import annotations

import asyncio
import json
import resource
from typing import Any, NamedTuple

from omniflow.roles.gateway.http import Receive, Send, header
from omniflow.roles.gateway.protocol import GatewayProtocol
from omniflow.roles.gateway.schema import ApiError
from omniflow.runtime.config import GatewayConfig

FD_RESERVE_MIN = 256  # ZeroMQ sockets (Outbox peers, inbox, registry), pool, logs
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}  # fmt: skip


class Limits(NamedTuple):
    max_connections: int
    header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_body_reads: int
    body_memory: int


def fd_room() -> int:
    """File descriptors this process may open: its soft RLIMIT_NOFILE, first raised to
    the hard limit (at most 65536)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 65536, 65536)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def limits_of(options: GatewayConfig, fds: int | None = None) -> Limits:
    """The configured limits, with connections capped below the fd limit: a quarter of
    it (at least ``FD_RESERVE_MIN``) stays for ZeroMQ, which aborts when it runs out."""
    fds = fd_room() if fds is None else fds
    reserve = max(FD_RESERVE_MIN, fds // 4)
    return Limits(
        max_connections=max(1, min(options.max_connections, fds - reserve)),
        header_bytes=int(options.max_header_kb * 1024),
        header_timeout_s=options.header_timeout_s,
        body_timeout_s=options.body_timeout_s,
        max_body_reads=options.max_body_reads,
        body_memory=int(options.body_memory_mb * 2**20),
    )


def refuse(transport: Any, status: int, message: str) -> None:
    """Answer ``status`` with an OpenAI-style error and close the connection."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, _REASONS.get(status, b"Error"), len(body))
    )
    if not transport.is_closing():
        transport.write(head + body)
        transport.close()


def limited_protocol(limits: Limits) -> type:
    """``GatewayProtocol`` bounding connections and request heads by ``limits``."""

    class LimitedProtocol(GatewayProtocol):
        _in_head = False
        _head_bytes = 0
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                message = f"more than {limits.max_connections} connections open; retry"
                refuse(self.transport, 503, message)
                return
            self._start_head()

        def _start_head(self) -> None:
            self._in_head, self._head_bytes = True, 0
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(limits.header_timeout_s, self._slow)

        def _end_head(self) -> None:
            self._in_head = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _slow(self) -> None:
            self._head_timer = None
            if self._in_head:
                message = f"the request head took more than {limits.header_timeout_s} s"
                refuse(self.transport, 408, message)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_head and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > limits.header_bytes:
                    self._end_head()
                    kb = limits.header_bytes // 1024
                    refuse(self.transport, 431, f"the request head is more than {kb} KiB")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._in_head:  # the next request on a kept-alive connection
                self._start_head()

        def on_headers_complete(self) -> None:
            self._end_head()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._end_head()
            super().connection_lost(exc)

    return LimitedProtocol


class BodyGuard:
    """An ASGI wrapper: bodies read at once, their bytes held and their time, bounded."""

    def __init__(self, app: Any, limits: Limits) -> None:
        self.app = app
        self.limits = limits
        self.reading = 0  # bodies being read now
        self.held = 0  # their bytes received so far

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body = _Body(self, scope, receive)
        try:
            await self.app(scope, body.receive, send)
        finally:
            body.finish()


class _Body:
    def __init__(self, guard: BodyGuard, scope: dict[str, Any], receive: Receive) -> None:
        self.guard, self.scope, self._receive = guard, scope, receive
        self.state = "new"  # new, reading, done
        self.held = 0
        self.deadline = 0.0

    async def receive(self) -> dict[str, Any]:
        if self.state == "done":
            return await self._receive()
        guard, limits = self.guard, self.guard.limits
        if self.state == "new":
            self._begin(guard, limits)
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self._receive()
        except TimeoutError:
            self.finish()
            raise ApiError(
                408, f"the body took more than {limits.body_timeout_s} s to arrive", "body"
            ) from None
        size = len(message.get("body", b""))
        self.held += size
        guard.held += size
        if guard.held > limits.body_memory:
            self.finish()
            raise ApiError(503, "the gateway holds all the request bodies it may; retry", "body")
        if message["type"] != "http.request" or not message.get("more_body"):
            self.finish()
        return message

    def _begin(self, guard: BodyGuard, limits: Limits) -> None:
        if guard.reading >= limits.max_body_reads:
            self.state = "done"
            raise ApiError(503, f"{limits.max_body_reads} bodies are being read; retry", "body")
        declared = header(self.scope, b"content-length") or b""
        if declared.isdigit() and guard.held + int(declared) > limits.body_memory:
            self.state = "done"
            raise ApiError(503, "the gateway holds all the request bodies it may; retry", "body")
        guard.reading += 1
        self.state = "reading"
        self.deadline = asyncio.get_running_loop().time() + limits.body_timeout_s

    def finish(self) -> None:
        """The body is complete (or abandoned): its slot and bytes go back."""
        if self.state == "reading":
            self.guard.reading -= 1
            self.guard.held -= self.held
        self.state = "done"
        self.held = 0
