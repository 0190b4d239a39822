"""One log format for every process of a deployment: the supervisor and each replica.

Every line starts with one timestamp format, ISO 8601 in UTC to the millisecond
(``2026-12-02T04:40:00.123Z``). ``text`` (the default) reads ``TIME LEVEL ACTOR LOGGER:
MESSAGE key=value...``; ``json`` (``omniflow up --log-format json``) makes each line one
JSON object: ``ts``, ``level``, ``actor``, ``logger``, ``msg``, the record's fields, and
``exc`` for a traceback. Fields come as ``log.info(msg, extra=fields(...))``. The format
reaches the workers through ``OMNIFLOW_LOG_FORMAT`` (the supervisor's environment).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

FORMAT_ENV = "OMNIFLOW_LOG_FORMAT"
FORMATS = ("text", "json")


def timestamp(seconds: float) -> str:
    whole = int(seconds)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + (
        f".{int((seconds - whole) * 1000):03d}Z"
    )


def fields(**values: Any) -> dict[str, Any]:
    """``extra=`` for a log call whose line carries these key/values."""
    return {"fields": values}


class TextFormatter(logging.Formatter):
    def __init__(self, actor: str) -> None:
        super().__init__()
        self.actor = actor

    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{timestamp(record.created)} {record.levelname} {self.actor} "
            f"{record.name}: {record.getMessage()}"
        )
        extra = getattr(record, "fields", None)
        if extra:
            line += " " + " ".join(f"{k}={_text(v)}" for k, v in extra.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def __init__(self, actor: str) -> None:
        super().__init__()
        self.actor = actor

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": timestamp(record.created),
            "level": record.levelname,
            "actor": self.actor,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if extra:
            line.update(extra)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(actor: str, fmt: str | None = None, level: str | None = None) -> str:
    """Route every logger of this process to stderr in ``fmt`` (else the environment's,
    else text); the format in effect, also left in the environment for children."""
    fmt = fmt or os.environ.get(FORMAT_ENV) or "text"
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    os.environ[FORMAT_ENV] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(actor) if fmt == "json" else TextFormatter(actor))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("OMNIFLOW_LOG", "INFO"))
    return fmt


def _text(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if not text or " " in text or '"' in text else text
