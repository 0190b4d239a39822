"""W3C trace context across roles, and spans through the OpenTelemetry SDK.

A request's ``Call.trace`` is a ``traceparent`` (``00-TRACE-SPAN-FLAGS``): the span the
hop hangs under. Each role that handles a traced request opens a span of its own under
it (its queue wait and compute as attributes, the wait as a child span) and sends its
own span on as the next hops' parent; its ``Timing`` names both ids, so the client has
the span tree without a collector (``omniflow send --trace``).

With ``[tracing]`` on, spans are the SDK's ``ReadableSpan``s, exported by its
``BatchSpanProcessor`` over OTLP/HTTP when an endpoint is set; with no endpoint (and no
processor added) no SDK span is built at all, since nothing would read it: the ids, the
traceparents and the ``Timing``s still go out, so ``omniflow send --trace`` has its tree
(what benchmarks/gateway.py measures). A traceparent whose sampled flag is off is
followed, not recorded. Off, a traced request still gets span ids, with nothing
recorded: the tree is there, no export.
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
# A valid one as every hop gets it (lower case, no zero ids): one C call checks it whole
# (a hop's own cost is microseconds).
_OURS = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}").fullmatch
_bits = random.Random().getrandbits
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


def parse(traceparent: str) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid W3C traceparent, else None."""
    if _OURS(traceparent) is None:
        m = _TRACEPARENT.match(traceparent.strip().lower()) if traceparent else None
        if m is None or m.group(1) == _ZERO_TRACE or m.group(2) == _ZERO_SPAN:
            return None
        return m.group(1), m.group(2), m.group(3)
    return traceparent[3:35], traceparent[36:52], traceparent[53:]


def span_id() -> str:
    return (_bits(64) or 1).to_bytes(8, "little").hex()


def trace_id() -> str:
    return (_bits(128) or 1).to_bytes(16, "little").hex()


def traceparent(trace: str, span: str, flags: str = "01") -> str:
    return f"00-{trace}-{span}-{flags}"


class Span:
    """One role's span of one request: its ids and start; ``sampled``: it is recorded.

    Built from the traceparent it hangs under (``under``, valid and lower case): the
    parent's id is sliced out, the trace id and flags only when asked for (an export).
    """

    __slots__ = ("under", "id", "parent", "start", "traceparent")

    def __init__(self, under: str, start: float) -> None:
        self.under, self.start = under, start
        self.parent = under[36:52]
        self.id = span_id()
        # What the next hops hang under: formatted once (read per hop and per header).
        self.traceparent = f"{under[:36]}{self.id}{under[52:]}"

    @classmethod
    def root(cls, start: float) -> Span:
        """A span under a new trace, with a parent id of its own (as a client's would be)."""
        return cls(traceparent(trace_id(), span_id()), start)

    @property
    def trace(self) -> str:
        return self.under[3:35]

    @property
    def flags(self) -> str:
        return self.under[53:]

    @property
    def sampled(self) -> bool:
        return self.under[-1] in "13579bdf"  # the W3C "sampled" bit


class Tracer:
    """Opens and ends the spans of one process (one role replica, or a client).

    A span is built once, when it ends, as the SDK's ``ReadableSpan`` (with the ids this
    module chose when it opened, since the next hops already hang under them) and handed
    to the SDK's ``BatchSpanProcessor`` with its OTLP/HTTP exporter. The SDK's own
    ``Tracer.start_span`` is passed by: it costs ten times as much per span (its sampler,
    context and attribute plumbing run per call), which benchmarks/gateway.py measured
    as most of tracing's cost.
    """

    def __init__(self, config: TracingConfig, service: str, role: str, replica: int) -> None:
        self.on = config.on
        self.role = role
        self._processor: Any = None
        # On, with somewhere for spans to go: callers build a span's attributes only then.
        self.records = False
        if not self.on:
            return
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import ReadableSpan
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
            from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
        except ImportError:
            raise RuntimeError(
                "[tracing] needs the OpenTelemetry SDK: pip install 'omniflow[tracing]'"
            ) from None
        self._sdk = (ReadableSpan, SpanContext, SpanKind, Status, StatusCode)
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._unset = Status(StatusCode.UNSET)  # one object for every span that ended well
        self._scope = InstrumentationScope("omniflow")
        self._resource = Resource.create(
            {
                "service.name": config.service or "omniflow",
                "service.instance.id": f"{role}/{replica}",
                "omniflow.deployment": service,
                "omniflow.role": role,
            }
        )
        if config.endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=5)
            self.add_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))

    def add_processor(self, processor: Any) -> None:
        """Where ended spans go (an SDK SpanProcessor): the exporter's, or a test's."""
        self._processor = processor
        self.records = self.on and processor is not None

    def start(self, parent: str, start_s: float) -> Span | None:
        """A span under the traceparent ``parent`` from ``start_s`` (time.time()); None
        when ``parent`` is not a valid traceparent (an untraced request)."""
        if _OURS(parent) is None:
            ids = parse(parent)  # not ours as sent: another case, spaces, or not valid
            if ids is None:
                return None
            parent = traceparent(*ids)
        return Span(parent, start_s)

    def end(
        self,
        span: Span,
        end_s: float,
        attributes: dict[str, Any],
        queued: tuple[float, float] | None = None,
        error: str = "",
        name: str = "",
    ) -> None:
        """End ``span`` at ``end_s``; ``queued``: (from, to) of its wait for a slot, a
        child span ``queue`` when it waited longer than ``QUEUE_SPAN_S``."""
        if not self.records or not span.sampled:
            return  # off, or on with no exporter: nothing would read the span
        readable, context, kind, status, code = self._sdk
        trace = int(span.trace, 16)
        own = context(trace, int(span.id, 16), False, self._sampled)
        parent = context(trace, int(span.parent, 16), True, self._sampled)
        done = readable(
            name or self.role,
            own,
            parent,
            self._resource,
            attributes,
            kind=kind.SERVER,
            status=status(code.ERROR, error) if error else self._unset,
            start_time=int(span.start * 1e9),
            end_time=int(end_s * 1e9),
            instrumentation_scope=self._scope,
        )
        spans = [done]
        if queued is not None and queued[1] - queued[0] > QUEUE_SPAN_S:
            wait = context(trace, int(span_id(), 16), False, self._sampled)
            spans.append(
                readable(
                    "queue",
                    wait,
                    own,
                    self._resource,
                    kind=kind.INTERNAL,
                    start_time=int(queued[0] * 1e9),
                    end_time=int(queued[1] * 1e9),
                    instrumentation_scope=self._scope,
                )
            )
        if self._processor is not None:
            for item in spans:
                self._processor.on_end(item)

    def close(self) -> None:
        """Flush what is recorded (a few hundred ms at most) and stop the exporter."""
        if self._processor is not None:
            self._processor.shutdown()
            self._processor = None
            self.records = False


# A wait for a slot shorter than this is an attribute of the role's span, not a span.
QUEUE_SPAN_S = 0.0005
