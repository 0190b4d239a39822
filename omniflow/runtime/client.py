"""The client: the first producer of every request, and where its outputs arrive.

It binds its own ROUTER for replies, holds a registry view, picks the entry
replicas itself, and finishes a request when every share of its completion
credit came back in a ``Done`` (or at the first ``Fail``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import zmq

from omniflow.control.balance import make_policy
from omniflow.control.discovery import open_registry
from omniflow.control.discovery.view import RegistryView
from omniflow.control.graph import INPUT
from omniflow.control.routing import FULL_CREDIT, Fanout, RouteError, Router
from omniflow.messages import (
    Call,
    Cancel,
    Code,
    DataMessage,
    Done,
    Emit,
    Fail,
    Timing,
    add_usage,
)
from omniflow.runtime.config import Config
from omniflow.transport.codec import (
    BadMessage,
    check_parts,
    decode,
    decoder_for,
    encode,
    materialize_tensors,
    release_tensors,
)
from omniflow.transport.endpoint import Inbox, Outbox

_decoder = decoder_for(DataMessage)
_client_ids = itertools.count()
_PATIENCE_TICK = 0.1  # seconds: how often waits past their deadline are ended


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


class _Pending:
    """A request in flight: where its events go, and the credit that came back."""

    __slots__ = ("push", "credit", "usage", "timings", "started", "patience")

    def __init__(self, push: Any, patience: float) -> None:
        self.push = push  # called with each Output, then a Result or a RequestFailed
        self.credit = 0
        self.usage: dict[str, int] = {}
        self.timings: list[Timing] = []
        self.started = time.perf_counter()
        self.patience = patience  # time.time() after which the client stops waiting


class _Collect:
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


class Client:
    def __init__(self, config: Config, registry_address: str, run_dir: Path) -> None:
        self.config = config
        self.registry_address = registry_address
        self.run_dir = Path(run_dir)
        self._pending: dict[str, _Pending] = {}
        self.ctx: zmq.Context | None = None
        self._id_prefix = uuid.uuid4().hex[:16]  # unique per client; a counter after it
        self._ids = itertools.count()
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        self.ctx = zmq.Context()
        if self.config.runtime.transport == "tcp":
            address = f"tcp://{self.config.runtime.bind_host}:*"
        else:
            address = f"ipc://{self.run_dir}/client-{os.getpid()}-{next(_client_ids)}.sock"
        keys = self.config.security.load_keys()
        self.inbox = Inbox(self.ctx, address, self._on_message, keys=keys)
        self.inbox.start()
        self.registry = open_registry(self.registry_address)
        self.view = RegistryView(self.registry, self.config.name)
        await self.view.start()
        self.outbox = Outbox(self.ctx, self.config.runtime.send_timeout_s, keys=keys)
        policies = {
            name: make_policy(rc.policy, role=name) for name, rc in self.config.roles.items()
        }
        idempotent = frozenset(n for n, rc in self.config.roles.items() if rc.idempotent)
        self.router = Router(
            self.config.plan(), self.view, self.outbox, policies, idempotent, socket.gethostname()
        )

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pending in list(self._pending.values()):
            pending.push(RequestFailed(Code.CANCELLED.value, "client closed", "client", ""))
        self.inbox.close()
        await self.view.close()
        await self.registry.close()
        self.outbox.close()
        assert self.ctx is not None
        self.ctx.term()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until every role has a live replica."""
        for role in self.config.roles:
            if not await self.view.wait_for(role, timeout):
                raise RequestFailed(Code.UNAVAILABLE.value, "no live replica", role, "")

    def _on_message(self, identity: bytes, parts: list[Any]) -> None:
        try:
            msg = decode(parts[0], _decoder)
        except BadMessage:
            return
        pending = self._pending.get(getattr(msg, "request_id", ""))
        try:
            check_parts(msg, parts)
        except BadMessage as e:
            release_tensors(getattr(msg, "tensors", {}).values())
            if pending is not None:
                role = getattr(msg, "role", "")
                pending.push(RequestFailed(Code.BAD_REQUEST.value, str(e), role, msg.request_id))
            return
        if pending is None:
            return  # a late message of a request that already ended
        if isinstance(msg, Emit):
            tensors = materialize_tensors(msg.tensors, parts) if msg.tensors else {}
            pending.push(Output(msg.role, msg.seq, msg.data, tensors))
        elif isinstance(msg, Done):
            if msg.seq >= 0:
                tensors = materialize_tensors(msg.tensors, parts) if msg.tensors else {}
                pending.push(Output(msg.role, msg.seq, msg.data, tensors))
            pending.credit += msg.credit
            pending.timings += msg.timings
            add_usage(pending.usage, msg.usage)
            if pending.credit >= FULL_CREDIT:
                latency = (time.perf_counter() - pending.started) * 1e3
                pending.push(Result(msg.request_id, pending.usage, pending.timings, latency))
        elif isinstance(msg, Fail):
            pending.push(RequestFailed(msg.code, msg.message, msg.role, msg.request_id))

    async def stream(
        self,
        inputs: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        session: str = "",
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Output | Result]:
        """Send one request; yield its ``Output`` chunks, then one ``Result``.

        Raises ``RequestFailed`` if any role fails it. Leaving the loop early
        cancels the request everywhere it went.
        """
        queue: asyncio.Queue = asyncio.Queue()
        request_id, deadline, fanout, rest = self._open(
            inputs, params, session, timeout, request_id, queue.put_nowait
        )
        if rest is not None:
            await self._sent(request_id, fanout, rest)
        finished = False
        try:
            while True:
                if deadline:
                    try:
                        item = await asyncio.wait_for(queue.get(), _patience(deadline))
                    except TimeoutError:
                        raise _no_answer(request_id) from None
                else:
                    item = await queue.get()
                if isinstance(item, RequestFailed):
                    finished = _cancel_is_moot(fanout, item)
                    raise item
                if isinstance(item, Result):
                    finished = True  # before the yield: the caller may stop iterating here
                    yield item
                    return
                yield item
        finally:
            self._end(request_id, fanout, finished)

    def _open(
        self,
        inputs: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
        session: str,
        timeout: float | None,
        request_id: str | None,
        push: Any,
    ) -> tuple[str, float, Fanout, Awaitable[None] | None]:
        """Start a new request: route its first hop; its events go to ``push``.

        The first hop leaves from here when the entry replica's queue takes it; else
        the last item is what is left to await (``_sent`` it).
        """
        request_id = request_id or f"{self._id_prefix}{next(self._ids):x}"
        # Every request gets a deadline: a branch lost with a dead replica ends in
        # `deadline` instead of a wait without end.
        timeout = timeout or self.config.runtime.request_timeout_s
        deadline = time.time() + timeout if timeout else 0.0
        call = Call(
            request_id,
            "",
            self.inbox.endpoint,
            params=dict(params or {}),
            deadline=deadline,
            session=session,
            origin="client",
        )
        self._pending[request_id] = _Pending(push, deadline + 1.0 if deadline else 0.0)
        fanout = Fanout(self.router, INPUT, call)
        try:
            rest = fanout.finish_now(FULL_CREDIT, [], {}, dict(inputs or {}))
        except BaseException as e:
            self._failed_to_send(request_id, fanout, e)
        return request_id, deadline, fanout, rest

    async def _sent(self, request_id: str, fanout: Fanout, rest: Awaitable[None]) -> None:
        try:
            await rest
        except BaseException as e:
            self._failed_to_send(request_id, fanout, e)

    def _failed_to_send(self, request_id: str, fanout: Fanout, error: BaseException) -> NoReturn:
        self._end(request_id, fanout, False)
        if isinstance(error, RouteError):
            raise RequestFailed(error.code, str(error), "client", request_id) from None
        raise error

    def _end(self, request_id: str, fanout: Fanout, finished: bool) -> None:
        """Forget a request; one left unfinished is cancelled everywhere it went."""
        self._pending.pop(request_id, None)
        if not finished:
            cancel = [encode(Cancel(request_id))]
            for address in fanout.addresses:
                with contextlib.suppress(Exception):
                    self.outbox.post(address, cancel)

    async def call(
        self,
        inputs: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        session: str = "",
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> tuple[list[Output], Result]:
        """Run one request to its end; every output chunk and the result.

        The same as collecting ``stream``, without a generator and a queue in the
        way: outputs are appended as they arrive and one future ends the wait. The
        wait is bounded by one sweep timer per client, not a timer per call.
        """
        collect = _Collect(asyncio.get_running_loop().create_future())
        request_id, deadline, fanout, rest = self._open(
            inputs, params, session, timeout, request_id, collect
        )
        if rest is not None:
            await self._sent(request_id, fanout, rest)
        finished = False
        if deadline and self._sweeper is None:
            self._watch_patience()
        try:
            result = await collect.done
            finished = True
            return collect.outputs, result
        except RequestFailed as e:
            finished = _cancel_is_moot(fanout, e)
            raise
        finally:
            self._end(request_id, fanout, finished)

    def _watch_patience(self) -> None:
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(_PATIENCE_TICK, self._sweep_patience)

    def _sweep_patience(self) -> None:
        """End the waits of ``call``s whose deadline passed a second ago with no answer."""
        self._sweeper = None
        now = time.time()
        waiting = False
        for request_id, pending in list(self._pending.items()):
            if not pending.patience or not isinstance(pending.push, _Collect):
                continue
            if pending.patience <= now:
                pending.push(_no_answer(request_id))
            else:
                waiting = True
        if waiting:
            self._watch_patience()


def _cancel_is_moot(fanout: Fanout, failure: RequestFailed) -> bool:
    """Whether a failed request needs no Cancel: the failing role cancels only what it
    sent itself, so the other branches (parts waiting at a join, a producer still
    streaming) must be cancelled from here, unless the client opened one branch only and
    that is the role that failed (as a request refused at its first hop)."""
    return len(fanout.branches) == 1 and failure.role in fanout.branches


def _patience(deadline: float) -> float:
    """How long the client waits: roles enforce the deadline, this bounds a dead path."""
    return max(0.0, deadline - time.time()) + 1.0


def _no_answer(request_id: str) -> RequestFailed:
    return RequestFailed(Code.DEADLINE.value, "no answer before the deadline", "client", request_id)
