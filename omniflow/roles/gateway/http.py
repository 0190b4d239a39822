"""Plain ASGI plumbing: read a bounded body, answer JSON, stream server-sent events, and
notice a client that went away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from omniflow.roles.gateway.schema import ApiError

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
T = TypeVar("T")

_json = msgspec.json.Encoder()
JSON = b"application/json"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Disconnected(Exception):
    """The HTTP client went away before its answer was complete."""


def header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def read_body(scope: dict[str, Any], receive: Receive, limit: int) -> bytes:
    """The whole request body; 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {int(declared)} bytes, more than {limit}", "body")
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is more than {limit} bytes", "body")
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def answer(
    send: Send, status: int, body: Any, content_type: bytes = JSON, extra: list | None = None
) -> None:
    data = body if isinstance(body, bytes) else _json.encode(body)
    headers = [(b"content-type", content_type), (b"content-length", str(len(data)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": data})


async def open_sse(send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})


def event(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


# A request that ends sooner never starts a watcher: most model calls on small inputs.
WATCH_AFTER_S = 0.02


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (which cancels the
    request along the graph) and raise ``Disconnected``.

    ``work`` runs in this task. The wait for a disconnect gets a task of its own, started
    only once ``work`` has taken ``WATCH_AFTER_S``: a task per request costs more than a
    timer, and a disconnect noticed 20 ms late cancels the request just as well.
    """
    current = asyncio.current_task()
    assert current is not None
    state = {"gone": False, "over": False}
    watch: asyncio.Task | None = None

    def on_disconnect(task: asyncio.Task) -> None:
        # Scheduled, not run inline: the request may have ended since.
        if not state["over"] and not task.cancelled() and task.exception() is None:
            state["gone"] = True
            current.cancel()

    def start_watching() -> None:
        nonlocal watch
        if not state["over"]:
            watch = asyncio.ensure_future(_disconnect(receive))
            watch.add_done_callback(on_disconnect)

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, start_watching)
    try:
        return await work
    except asyncio.CancelledError:
        if state["gone"]:
            current.uncancel()
            raise Disconnected from None
        raise
    finally:
        state["over"] = True
        timer.cancel()
        if watch is not None:
            watch.cancel()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
