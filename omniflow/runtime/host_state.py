"""What an actor host keeps per request, and how a request ends there: its stream and
holding-file entry, its one ``Fail`` and the ``Cancel`` downstream, its deadline, the
memory of where a finished request went (for a late ``Cancel``), and the drain."""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from omniflow.control.join import JoinBuffer
from omniflow.control.routing import Fanout, Router
from omniflow.messages import TOKEN_BYTES, Call, Cancel, Code, Fail, Frame, Timing, add_usage
from omniflow.runtime.actor import Actor, Context
from omniflow.runtime.config import TracingConfig
from omniflow.runtime.holding import HoldingFile
from omniflow.runtime.inflight import Slots, Stream
from omniflow.runtime.tracing import Span, Tracer
from omniflow.transport.codec import encode, release_tensors
from omniflow.transport.throttle import Throttled

log = logging.getLogger("omniflow.runtime.host")
FINISHED_MEMORY = 4096  # finished requests whose downstream a late Cancel must still reach
_DEADLINE_TICK = 0.02  # seconds: how late past its deadline a request may be failed


class HostState:
    """The base of ``ActorHost``: its bookkeeping, failures and shutdown."""

    def __init__(
        self,
        actor: Actor,
        router: Router,
        max_concurrency: int = 64,
        max_queue: int = 1024,
        holding: HoldingFile | None = None,
        max_stream_chunks: int = 1024,
    ) -> None:
        self.actor = actor
        self.role = actor.role
        self.router = router
        self._slots = Slots(max_concurrency)
        self._max_pending = max_concurrency + max_queue
        # Chunks of one streamed request waiting for its handler: a producer that outruns
        # it fails that request as overloaded instead of growing the queue without end.
        self._max_chunks = max_stream_chunks
        self._streams: dict[tuple[str, int], Stream] = {}  # (request id, hops)
        self._joins = JoinBuffer(self.role)
        # Where each ended request's hops went, and its token (what a late Cancel shows).
        self._finished: OrderedDict[tuple[str, int], tuple[bytes, set[str]]] = OrderedDict()
        self._refused_joins: OrderedDict[str, None] = OrderedDict()  # their later parts too
        self._is_gen = inspect.isasyncgenfunction(actor.handle)
        self._eager = actor.eager and not self._is_gen
        self.accepting = True
        self.accepting_new = True  # False: only hops of requests already in the graph
        self.served = 0
        self.bad_messages = 0
        # Garbage from a stranger: one warning per window, with a count of the rest.
        self._garbage = Throttled(log, "%s: dropped %s")
        self._forged = Throttled(log, "%s: dropped a Cancel of %s: %s")
        self._sweeper: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._holding = holding
        self._held: dict[str, list[int]] = {}  # request id -> [its slot there, holders here]
        # Answers the sending socket itself (the Inbox's ``reply``), for a message too
        # malformed to name a reply address.
        self.reply: Callable[[bytes, list[Any]], bool] | None = None
        # Spans of traced requests: ids only until the worker gives one that records.
        self.tracer = Tracer(TracingConfig(), "", self.role, actor.replica)

    @property
    def inflight(self) -> int:
        return len(self._streams)

    @property
    def queued(self) -> int:
        """Requests here waiting for a handler slot (/metrics' queue depth)."""
        return len(self._slots._waiters)

    def holding(self, limit: int = 1000) -> list[tuple[str, str]]:
        """(request id, reply address) of requests in flight here, at most ``limit``."""
        held = {(s.call.request_id, s.call.reply_to) for s in self._streams.values()}
        held.update(self._joins.waiting())
        return sorted(held)[:limit]

    def _open(
        self,
        call: Call,
        key: tuple[str, int],
        fanout: Fanout | None = None,
        ctx: Any = None,
        span: Span | None = None,
    ) -> Stream:
        if ctx is None:
            fanout = Fanout(self.router, self.role, call)
            ctx = Context(call.request_id, self.role, self.actor.replica, call.deadline, None)
            ctx._sink, ctx._peer = fanout.output, fanout.peer
            if call.trace:
                span = self._trace(call, fanout, time.time())
        assert fanout is not None
        stream = Stream(call, fanout, ctx)
        stream.span = span
        self._streams[key] = stream
        self._idle.clear()
        self._hold(call)
        return stream

    def _trace(self, call: Call, fanout: Fanout, arrived: float) -> Span | None:
        """Open this role's span of a traced request; its hops hang under it."""
        span = self.tracer.start(call.trace, arrived)
        if span is not None:
            fanout.trace = span.traceparent
        return span

    def _end_span(self, stream: Stream) -> None:
        span, stream.span = stream.span, None
        if not self.tracer.records:
            return  # nothing would read its attributes
        now = time.time()
        started = stream.started or now
        attributes = {
            "omniflow.request_id": stream.call.request_id,
            "omniflow.replica": self.actor.replica,
            "omniflow.queue_ms": (started - stream.arrived) * 1e3,
            "omniflow.compute_ms": stream.compute * 1e3,
        }
        self.tracer.end(span, now, attributes, (stream.arrived, started))

    def _hold(self, call: Call) -> None:
        """Name the request in the holding file while anything of it is here."""
        if self._holding is None:
            return
        held = self._held.get(call.request_id)
        if held is None:
            slot = self._holding.add(call.request_id, call.reply_to, call.token)
            self._held[call.request_id] = [slot, 1]
        else:
            held[1] += 1

    def _unhold(self, request_id: str) -> None:
        held = self._held.get(request_id)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del self._held[request_id]
            assert self._holding is not None
            self._holding.remove(held[0])

    def _on_cancel(self, cancel: Cancel) -> None:
        """Stop a request here and pass the Cancel on, where it shows the request's token
        (the one its Call brought here): a peer that never saw the Call cannot cancel it."""
        rid, token = cancel.request_id, cancel.token
        if len(token) != TOKEN_BYTES:
            self._forged.note(self.role, rid, "it has no token")
            return
        found = matched = False
        joined = self._joins.token(rid)
        if joined is not None:
            found = True
            if hmac.compare_digest(token, joined):
                matched = True
                for call in self._joins.drop(rid):
                    self._drop(call)
                self._unhold(rid)
        for key, stream in list(self._streams.items()):
            if key[0] == rid:
                found = True
                if hmac.compare_digest(token, stream.call.token):
                    matched = True
                    stream.ctx.cancelled.set()
                    if stream.task is not None:
                        cancel_soon(stream.task)  # its handler cancels what it sent onward
        for key, (theirs, addresses) in list(self._finished.items()):
            if key[0] == rid:
                found = True
                if hmac.compare_digest(token, theirs):
                    matched = True
                    for address in addresses:
                        self._send_cancel(address, cancel)
        if found and not matched:
            self._forged.note(self.role, rid, "not the request's token")

    @staticmethod
    def _account(stream: Stream, call: Call) -> None:
        """What a chunk brings besides its input: credit, upstream timings and usage."""
        stream.credit += call.credit
        if call.timings:
            stream.timings += call.timings
        add_usage(stream.usage, call.usage)

    @staticmethod
    def _take_usage(stream: Stream) -> None:
        """Move what the handler counted (``ctx.add_usage``) into the request's usage."""
        if stream.ctx.usage:
            add_usage(stream.usage, stream.ctx.usage)
            stream.ctx.usage = {}

    async def _fail(self, stream: Stream, code: str, message: str, replica: str = "") -> None:
        call = stream.call
        self._cancel_downstream(stream, code)
        code = code.value if isinstance(code, Code) else str(code)
        fail = Fail(code, message, self.role, call.request_id, replica, call.token)
        try:
            await self.router.send(call.reply_to, fail, {})
        except Exception:
            log.warning("%s: could not deliver the failure of %s", self.role, call.request_id)

    def _reject(self, call: Call, code: Code, message: str) -> None:
        self._drop(call)
        fail = Fail(code.value, message, self.role, call.request_id, token=call.token)
        try:
            self.router.outbox.post(call.reply_to, [encode(fail)])
        except Exception:
            log.warning("%s: could not reject %s", self.role, call.request_id)

    def _cancel_downstream(self, stream: Stream, reason: str) -> None:
        cancel = Cancel(stream.call.request_id, str(reason), stream.call.token)
        for address in stream.fanout.addresses:
            self._send_cancel(address, cancel)

    def _send_cancel(self, address: str, cancel: Cancel) -> None:
        try:
            self.router.outbox.post(address, [encode(cancel)])
        except Exception:
            pass

    def _drop(self, call: Call) -> None:
        """A call that never reaches the handler: its tensors go back, and the actor gives
        back what its data holds (``Actor.discard``: leases, say)."""
        release_tensors(call.tensors.values(), opened=False)
        self._discard(call)

    def _discard(self, call: Call) -> None:
        try:
            self.actor.discard(call.data)
        except Exception:
            log.exception("%s: discarding request %s failed", self.role, call.request_id)

    def _close(self, stream: Stream) -> None:
        if stream.span is not None:
            self._end_span(stream)
        # Outputs that reuse an input's block were shared onward before this release.
        release_inputs(stream.refs, stream.ctx)
        if not stream.handled and stream.queue is None:  # expired or cancelled before a slot
            self._drop(stream.call)
        stream.refs = []
        # Chunks never handled (a stream's first chunk waits in its queue: dropped here once).
        while stream.queue is not None and not stream.queue.empty():
            call, _ = stream.queue.get_nowait()
            self._drop(call)
        key = (stream.call.request_id, stream.call.hops)
        if self._streams.pop(key, None) is not None:
            self._unhold(stream.call.request_id)
        self._remember(key, stream.call.token, stream.fanout.addresses)
        if not self._streams:
            self._idle.set()

    def _remember(self, key: tuple[str, int], token: bytes, addresses: set[str]) -> None:
        self._finished[key] = (token, addresses)
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def _timing(
        self, compute: float, arrived: float, span: Span | None = None, started: float = 0.0
    ) -> Timing:
        """This actor's Timing for a request: ``compute`` seconds, leaving now (a traced
        one's: its span, and how long it waited for a slot from ``arrived``)."""
        timing = Timing(self.role, self.actor.replica, compute * 1e3, arrived, time.time())
        if span is not None:
            timing.span, timing.parent = span.id, span.parent
            timing.queued_ms = max(0.0, (started or arrived) - arrived) * 1e3
        return timing

    def _watch_deadlines(self) -> None:
        """One timer for every deadline in flight: cheaper than a timeout per request."""
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(_DEADLINE_TICK, self._sweep_deadlines)

    def _sweep_deadlines(self) -> None:
        self._sweeper = None
        now = time.time()
        self._expire_joins(now)
        pending = self._joins.has_deadlines()
        for stream in self._streams.values():
            deadline = stream.call.deadline
            if not deadline or stream.finishing or stream.expired:
                continue
            if deadline <= now and stream.task is not None:
                stream.expired = True
                stream.task.cancel()
            else:
                pending = True
        if pending:
            self._watch_deadlines()

    def _expire_joins(self, now: float) -> None:
        """Fail requests whose parts waited at the join past the deadline; free the parts."""
        failed: set[str] = set()
        for call in self._joins.expire(now):
            if call.request_id in failed:
                self._drop(call)
                continue
            failed.add(call.request_id)
            self._unhold(call.request_id)
            message = f"deadline exceeded while {self.role} waited for the other branches"
            self._reject(call, Code.DEADLINE, message)  # releases its tensors too

    def close_intake(self) -> None:
        """Refuse new requests (``shutting_down``); requests already in the graph go on
        through this actor, which stays registered for them."""
        self.accepting_new = False

    async def drain(self, timeout: float) -> bool:
        """Stop intake and wait for in-flight requests; True if all finished in time."""
        self.accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            for stream in list(self._streams.values()):
                if stream.task is not None:
                    stream.task.cancel()
            return False


def cancel_soon(task: asyncio.Task) -> None:
    """Cancel ``task`` once it has taken its first step: a Task cancelled before it ever
    ran never enters its body, so no ``finally`` of it would fail, close and release the
    request (all its chunks may come in one read, before the Task that takes them ran)."""
    asyncio.get_running_loop().call_soon(task.cancel)


def pool_refs(call: Call) -> list[Any]:
    """The call's tensor refs that hold a pool block (every kind but an inline Frame)."""
    if not call.tensors:
        return []
    return [ref for ref in call.tensors.values() if not isinstance(ref, Frame)]


def release_inputs(refs: list[Any], ctx: Context) -> None:
    """Give back what a finished request held: its inputs' pool blocks, its leases."""
    if refs:
        release_tensors(refs)
    if ctx.held:
        for lease in ctx.held:
            lease.release()
        ctx.held = []
