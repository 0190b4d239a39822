"""A client's requests in flight: what the caller gets back (``Output``, ``Result``,
``RequestFailed``) and what the client keeps per request (``Pending``)."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from omniflow.control.routing import Fanout
from omniflow.messages import TOKEN_BYTES, Code, Timing


class RequestFailed(RuntimeError):
    """A request ended with ``Fail``: ``code``, ``role`` and ``request_id`` say where and why."""

    def __init__(self, code: str, message: str, role: str, request_id: str) -> None:
        super().__init__(f"[{code}] {role}: {message} (request {request_id})")
        self.code = code
        self.role = role
        self.request_id = request_id
        self.detail = message


@dataclass
class Output:
    """One streamed chunk of output from ``role``."""

    role: str
    seq: int
    data: dict[str, Any]
    tensors: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    """The end of a request: usage counters and each role's compute time."""

    request_id: str
    usage: dict[str, int]
    timings: list[Timing]
    latency_ms: float
    migrations: int = 0  # times it moved to another replica after one died holding it


class Pending:
    """A request in flight: where its events go, the credit that came back, and what it
    takes to send it again (migrate it) if a replica dies holding it."""

    __slots__ = (
        "push",
        "credit",
        "usage",
        "timings",
        "started",
        "patience",
        "request_id",
        "attempt",
        "fanout",
        "resend",
        "migrations",
        "exclude",
        "delivered",
        "skip",
        "offset",
        "tokens",
        "token_role",
        "text_done",
        "heard",
        "migratable",
        "token",
    )

    def __init__(
        self, push: Any, patience: float, request_id: str, migratable: bool = True
    ) -> None:
        self.push = push  # called with each Output, then a Result or a RequestFailed
        self.credit = 0
        self.usage: dict[str, int] = {}
        self.timings: list[Timing] = []
        self.started = time.perf_counter()
        self.patience = patience  # time.time() after which the client stops waiting
        self.request_id = request_id  # the caller's id; an attempt after a migration differs
        self.attempt = request_id
        self.fanout: Fanout | None = None
        self.resend: tuple[dict, dict, str, float] = ({}, {}, "", 0.0)
        self.migrations = 0
        self.exclude: frozenset[int] = frozenset()  # pids of replicas that died holding it
        self.delivered: dict[str, int] = {}  # role -> output chunks handed to the caller
        self.skip: dict[str, int] = {}  # role -> chunks of a new attempt it already has
        self.offset: dict[str, int] = {}  # role -> seq shift of the role that resumes
        self.tokens: list[int] = []  # ids of the text streamed so far (outputs' "tokens")
        self.token_role = ""
        self.text_done = False
        self.heard = False  # anything came back for the current attempt
        # False with migration off: nothing above is kept for a resend (inputs, tokens).
        self.migratable = migratable
        # Drawn for this request and sent in its Call: what comes back must show it.
        self.token = secrets.token_bytes(TOKEN_BYTES)

    def deliver(self, output: Output) -> None:
        """Hand one output to the caller, once: after a migration, what the new attempt
        sends again is dropped and the resuming role's chunks go on numbering."""
        if not self.migratable:
            self.push(output)
            return
        role = output.role
        if role in self.offset:
            output.seq += self.offset[role]
        elif output.seq < self.skip.get(role, 0):
            return
        self.delivered[role] = max(self.delivered.get(role, 0), output.seq + 1)
        tokens = output.data.get("tokens")
        if isinstance(tokens, list):
            self.tokens += tokens
            self.token_role = role
            self.text_done = self.text_done or bool(output.data.get("finished"))
        self.push(output)


class Collect:
    """``push`` for ``call``: outputs into a list, the end into one future."""

    __slots__ = ("outputs", "done")

    def __init__(self, done: asyncio.Future) -> None:
        self.outputs: list[Output] = []
        self.done = done

    def __call__(self, item: Any) -> None:
        if isinstance(item, Output):
            self.outputs.append(item)
        elif not self.done.done():
            if isinstance(item, RequestFailed):
                self.done.set_exception(item)
            else:
                self.done.set_result(item)


def cancel_is_moot(pending: Pending, failure: RequestFailed) -> bool:
    """Whether a failed request needs no Cancel: the failing role cancels only what it
    sent itself, so the other branches (parts waiting at a join, a producer still
    streaming) must be cancelled from here, unless the client opened one branch only and
    that is the role that failed (as a request refused at its first hop)."""
    fanout = pending.fanout
    return fanout is not None and len(fanout.branches) == 1 and failure.role in fanout.branches


TIMEOUT = object()  # queued by stream()'s timer at the deadline's patience


def patience(deadline: float) -> float:
    """How long the client waits: roles enforce the deadline, this bounds a dead path."""
    return max(0.0, deadline - time.time()) + 1.0


def no_answer(request_id: str) -> RequestFailed:
    return RequestFailed(Code.DEADLINE.value, "no answer before the deadline", "client", request_id)
