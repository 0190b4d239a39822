"""uvicorn's httptools protocol, with the writes of one event-loop iteration sent as one.

uvicorn writes a response's status line and headers, then its body, each straight to the
socket: two send() calls and, with TCP_NODELAY, two segments the client wakes up for. A
response is written within one iteration (the app sends its start and body messages back
to back), so holding writes until the iteration ends halves the sends at the cost of one
``call_soon``. Streamed events that arrive in later iterations leave at the end of theirs:
nothing waits for more data.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _CoalescingTransport:
    """Forwards everything to ``transport``; ``write`` leaves once per loop iteration."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()  # a response followed by close (connection: close) still leaves
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayProtocol(HttpToolsProtocol):
    def connection_made(self, transport: Any) -> None:  # uvloop's is no asyncio.Transport
        coalescing: Any = _CoalescingTransport(transport, self.loop)
        super().connection_made(coalescing)
