"""The log formats and the trace context, in process: one timestamp format, JSON lines,
W3C traceparent parsing, SDK spans under a given parent, and a Call from a peer that
knows no trace fields."""

from __future__ import annotations

import json
import logging
import re

import msgspec
import pytest

from omniflow.messages import Call, Timing
from omniflow.runtime import tracing
from omniflow.runtime.config import TracingConfig
from omniflow.runtime.logs import JsonFormatter, TextFormatter, fields, timestamp
from tests.helpers import cli

TS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def record(msg: str, *args, exc=None, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("omniflow.test", logging.INFO, __file__, 1, msg, args, exc)
    rec.created = 1764650400.25
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_one_timestamp_format_in_text_and_json():
    assert timestamp(1764650400.25) == "2025-12-02T04:40:00.250Z"
    text = TextFormatter("llm/0").format(record("loaded %s", "x", **fields(dtype="bf16", n=2)))
    assert re.fullmatch(rf"{TS} INFO llm/0 omniflow.test: loaded x dtype=bf16 n=2", text), text
    line = json.loads(JsonFormatter("llm/0").format(record("hi", **fields(ms=1.5))))
    assert line == {
        "ts": "2025-12-02T04:40:00.250Z",
        "level": "INFO",
        "actor": "llm/0",
        "logger": "omniflow.test",
        "msg": "hi",
        "ms": 1.5,
    }


def test_a_traceback_stays_inside_its_json_line():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        exc = sys.exc_info()
    out = JsonFormatter("llm/0").format(record("failed", exc=exc))
    assert "\n" not in out and "ValueError: boom" in json.loads(out)["exc"]


def test_log_format_is_checked_before_anything_starts(tmp_path):
    proc = cli("up", str(tmp_path / "none.toml"), "--log-format", "xml", check=False)
    assert proc.returncode == 2 and "--log-format" in proc.stderr


@pytest.mark.parametrize(
    "header, ok",
    [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", True),
        ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-00", True),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),
        ("garbage", False),
        ("", False),
    ],
)
def test_traceparent_parsing(header, ok):
    assert (tracing.parse(header) is not None) == ok


def test_spans_hang_under_the_given_parent_through_the_sdk():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracer = tracing.Tracer(TracingConfig(enabled=True), "dep", "llm", 0)
    exported = InMemorySpanExporter()
    tracer.add_processor(SimpleSpanProcessor(exported))
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    span = tracer.start(parent, 100.0)
    assert span is not None and span.parent == "00f067aa0ba902b7"
    assert span.traceparent.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    tracer.end(span, 100.5, {"omniflow.compute_ms": 3.0}, queued=(100.0, 100.1))
    short = tracer.start(parent, 200.0)
    tracer.end(short, 200.5, {}, queued=(200.0, 200.0001), error="boom")  # no queue span
    tracer.close()
    by_name = {s.name: s for s in exported.get_finished_spans()}
    llm, queue = exported.get_finished_spans()[0], by_name["queue"]
    assert llm.parent.span_id == 0x00F067AA0BA902B7
    assert f"{llm.context.span_id:016x}" == span.id
    assert queue.parent.span_id == llm.context.span_id
    assert (llm.start_time, llm.end_time) == (100_000_000_000, 100_500_000_000)
    assert llm.resource.attributes["service.instance.id"] == "llm/0"
    assert llm.attributes["omniflow.compute_ms"] == 3.0
    assert [s.name for s in exported.get_finished_spans()] == ["llm", "queue", "llm"]
    assert exported.get_finished_spans()[2].status.description == "boom"
    unsampled = tracer.start("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", 1.0)
    assert unsampled is not None and not unsampled.sampled  # followed, never recorded
    assert tracer.start("not a traceparent", 1.0) is None


def test_tracing_off_still_names_spans_for_the_tree():
    tracer = tracing.Tracer(TracingConfig(), "dep", "llm", 0)
    span = tracer.start("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", 1.0)
    assert span is not None and re.fullmatch(r"[0-9a-f]{16}", span.id)
    tracer.end(span, 2.0, {})  # nothing recorded, nothing raised


def test_a_call_from_a_peer_without_trace_fields_still_decodes():
    plain = Call("r1", "llm", "ipc://x", timings=[Timing("llm", 0, 1.0, 2.0, 3.0)])
    fields_ = msgspec.msgpack.decode(msgspec.msgpack.encode(plain))
    assert fields_[-2:] == ["", b""] and fields_[14][0][-3:] == ["", "", 0.0]
    fields_[14][0] = fields_[14][0][:5]  # a Timing as it was: five fields
    before = msgspec.msgpack.encode(fields_[:-2])  # a Call as it was: no trace, no token
    back = msgspec.msgpack.decode(before, type=Call)
    assert back.trace == "" and back.timings[0].span == "" and back.timings[0].compute_ms == 1.0
    traced = Call("r1", "llm", "ipc://x", trace="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(traced), type=Call).trace == traced.trace
