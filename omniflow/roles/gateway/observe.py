"""What wraps every gateway request: its trace context, its span and its access log line.

An ASGI middleware around ``GatewayApp`` (kept apart from the routes): it takes the
request's W3C ``traceparent`` header (or starts a trace when ``[tracing]`` is on), opens
the gateway's span under it, makes that span the parent of every Call the request sends
(``tracing.CURRENT``, which the Client reads), and answers with ``x-request-id`` and the
``traceparent`` it used. When the response ends it writes one access line: method, path,
status, milliseconds, request id (the client's ``x-request-id``, else a new one) and the
trace id.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from typing import Any

from omniflow.roles.gateway.http import Receive, Send, header
from omniflow.runtime import tracing
from omniflow.runtime.logs import fields
from omniflow.runtime.tracing import Tracer

access_log = logging.getLogger("omniflow.gateway.access")


class Observe:
    def __init__(self, app: Any, tracer: Tracer) -> None:
        self.app = app
        self.tracer = tracer
        self._prefix = f"req-{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.time()
        given = header(scope, b"x-request-id")
        request_id = (
            given.decode("latin-1")[:128] if given else f"{self._prefix}{next(self._ids):x}"
        )
        parent = (header(scope, b"traceparent") or b"").decode("latin-1")
        span = self.tracer.start(parent, started) if parent else None
        # A trace of its own for model requests only (not every /metrics scrape): a span
        # under a new trace id (and a parent id of its own, as the client's would be).
        if span is None and self.tracer.on and scope["path"].startswith("/v1/"):
            span = tracing.Span.root(started)
        extra = [(b"x-request-id", request_id.encode("latin-1"))]
        if span is not None:
            extra.append((b"traceparent", span.traceparent.encode()))
        status = 0

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        token = tracing.CURRENT.set(span.traceparent if span is not None else "")
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            tracing.CURRENT.reset(token)
            ended = time.time()
            method, path = scope["method"], scope["path"]
            if span is not None and self.tracer.records:
                attributes = {
                    "http.request.method": method,
                    "url.path": path,
                    "http.response.status_code": status or 499,
                    "omniflow.request_id": request_id,
                }
                self.tracer.end(span, ended, attributes)
            access_log.info(
                "%s %s %d",
                method,
                path,
                status or 499,  # no response began: the client left (nginx's 499)
                extra=fields(
                    method=method,
                    path=path,
                    status=status or 499,
                    ms=round((ended - started) * 1e3, 2),
                    request_id=request_id,
                    trace_id=span.trace if span is not None else "",
                ),
            )
