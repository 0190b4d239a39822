"""W3C trace context across roles, and spans through the OpenTelemetry SDK.

A request's ``Call.trace`` is a ``traceparent`` (``00-TRACE-SPAN-FLAGS``): the span the
hop hangs under. Each role that handles a traced request opens a span of its own under
it (its queue wait and compute as attributes, the wait as a child span) and sends its
own span on as the next hops' parent; its ``Timing`` names both ids, so the client has
the span tree without a collector (``omniflow send --trace``).

With ``[tracing]`` on, spans are the SDK's (a ``TracerProvider`` of this process, not the
global one), exported by a ``BatchSpanProcessor`` over OTLP/HTTP when an endpoint is set
(no endpoint: recorded and dropped, what benchmarks/gateway.py measures). Off, a traced
request still gets span ids, with nothing recorded: the tree is there, no export.
"""

from __future__ import annotations

import contextvars
import random
import re
from typing import Any

from omniflow.runtime.config import TracingConfig

# The traceparent requests sent from this context hang under (the gateway sets it per
# HTTP request; Client.stream/call read it when not given one).
CURRENT = contextvars.ContextVar("omniflow_traceparent", default="")
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_rand = random.Random()


def parse(traceparent: str) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid W3C traceparent, else None."""
    m = _TRACEPARENT.match(traceparent.strip().lower()) if traceparent else None
    if m is None or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        return None
    return m.group(1), m.group(2), m.group(3)


def span_id() -> str:
    return f"{_rand.getrandbits(64) or 1:016x}"


def trace_id() -> str:
    return f"{_rand.getrandbits(128) or 1:032x}"


def traceparent(trace: str, span: str, flags: str = "01") -> str:
    return f"00-{trace}-{span}-{flags}"


class Span:
    """One role's span of one request: its ids, and the SDK's span when recording."""

    __slots__ = ("trace", "id", "parent", "flags", "sdk")

    def __init__(self, trace: str, parent: str, flags: str, sdk: Any = None) -> None:
        self.trace, self.parent, self.flags, self.sdk = trace, parent, flags, sdk
        self.id = f"{sdk.get_span_context().span_id:016x}" if sdk is not None else span_id()

    @property
    def traceparent(self) -> str:
        return traceparent(self.trace, self.id, self.flags)


class Tracer:
    """Opens and ends the spans of one process (one role replica, or a client)."""

    def __init__(self, config: TracingConfig, service: str, role: str, replica: int) -> None:
        self.on = config.on
        self.role = role
        self._sdk: Any = None
        self._provider: Any = None
        if not self.on:
            return
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
        except ImportError:
            raise RuntimeError(
                "[tracing] needs the OpenTelemetry SDK: pip install 'omniflow[tracing]'"
            ) from None

        resource = Resource.create(
            {
                "service.name": config.service or "omniflow",
                "service.instance.id": f"{role}/{replica}",
                "omniflow.deployment": service,
                "omniflow.role": role,
            }
        )
        self._provider = TracerProvider(resource=resource)
        if config.endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=5)
            self._provider.add_span_processor(
                BatchSpanProcessor(exporter, schedule_delay_millis=200)
            )
        self._sdk = self._provider.get_tracer("omniflow")

    def start(self, parent: str, start_s: float, name: str = "") -> Span | None:
        """A span under the traceparent ``parent`` from ``start_s`` (time.time()); None
        when ``parent`` is not a valid traceparent (an untraced request)."""
        ids = parse(parent)
        if ids is None:
            return None
        trace, parent_id, flags = ids
        if self._sdk is None:
            return Span(trace, parent_id, flags)
        from opentelemetry import trace as api

        context = api.set_span_in_context(
            api.NonRecordingSpan(
                api.SpanContext(
                    int(trace, 16), int(parent_id, 16), True, api.TraceFlags(int(flags, 16))
                )
            )
        )
        sdk = self._sdk.start_span(
            name or self.role,
            context=context,
            kind=api.SpanKind.SERVER if not name else api.SpanKind.INTERNAL,
            start_time=int(start_s * 1e9),
        )
        return Span(trace, parent_id, flags, sdk)

    def end(
        self,
        span: Span,
        end_s: float,
        attributes: dict[str, Any],
        queued: tuple[float, float] | None = None,
        error: str = "",
    ) -> None:
        """End ``span`` at ``end_s``; ``queued``: (from, to) of its wait for a slot."""
        sdk = span.sdk
        if sdk is None:
            return
        sdk.set_attributes(attributes)
        if error:
            from opentelemetry.trace import Status, StatusCode

            sdk.set_status(Status(StatusCode.ERROR, error))
        if queued is not None and queued[1] > queued[0]:
            from opentelemetry import trace as api

            wait = self._sdk.start_span(
                "queue", context=api.set_span_in_context(sdk), start_time=int(queued[0] * 1e9)
            )
            wait.end(end_time=int(queued[1] * 1e9))
        sdk.end(end_time=int(end_s * 1e9))

    def close(self) -> None:
        """Flush what is recorded (a few hundred ms at most) and stop the exporter."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
