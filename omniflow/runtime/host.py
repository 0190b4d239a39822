"""Runs one ``Actor`` inside a worker process: intake, ordering, limits, failures.

Each Call is one chunk of one request's input. A request's chunks are handled
in order by one task; a plain (single-chunk) request gets its task directly.
Branches meeting at a join are buffered until every part arrived, then handled
once. An exception, a missed deadline or a cancel ends that request alone with
one ``Fail`` to the client and a ``Cancel`` to everything downstream.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from omniflow.control.graph import INPUT
from omniflow.control.join import JoinBuffer
from omniflow.control.routing import Fanout, RouteError, Router
from omniflow.messages import (
    TOKEN_BYTES,
    Call,
    Cancel,
    Code,
    DataMessage,
    Fail,
    Frame,
    Timing,
    add_usage,
)
from omniflow.runtime.actor import Actor, BadRequest, Context, Request
from omniflow.runtime.config import TracingConfig
from omniflow.runtime.holding import HoldingFile
from omniflow.runtime.inflight import Slots, Stream, carry_on, resume
from omniflow.runtime.tracing import Span, Tracer
from omniflow.transport.codec import (
    BadMessage,
    check_parts,
    decode,
    decoder_for,
    encode,
    materialize_tensors,
    release_tensors,
)
from omniflow.transport.links import TensorError
from omniflow.transport.throttle import Throttled

log = logging.getLogger(__name__)
_decoder = decoder_for(DataMessage)
_FINISHED_MEMORY = 4096  # finished requests whose downstream a late Cancel must still reach
_DEADLINE_TICK = 0.02  # seconds: how late past its deadline a request may be failed


class ActorHost:
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

    # ------------------------------------------------------------------ intake

    def on_message(self, identity: bytes, parts: list[Any]) -> None:
        try:
            msg = decode(parts[0], _decoder)
        except BadMessage as e:
            self.bad_messages += 1
            self._garbage.note(self.role, f"a malformed message: {e}")
            if self.reply is not None:  # no reply address to trust: answer the socket
                self.reply(identity, [encode(Fail(Code.BAD_REQUEST.value, str(e), self.role, ""))])
            return
        if isinstance(msg, Call):
            try:
                check_parts(msg, parts)
            except BadMessage as e:
                self.bad_messages += 1
                return self._reject(msg, Code.BAD_REQUEST, f"{self.role}: {e}")
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "%s got %s seq %d from %s", self.role, msg.request_id, msg.seq, msg.origin
                )
            if len(msg.token) != TOKEN_BYTES:
                self.bad_messages += 1
                message = (
                    f"{self.role}: Call.token must be {TOKEN_BYTES} bytes, not {len(msg.token)}"
                )
                return self._reject(msg, Code.BAD_REQUEST, message)
            if not self.accepting_new and self._is_new_request(msg):
                return self._reject(msg, Code.SHUTTING_DOWN, f"{self.role} is shutting down")
            self._on_call(msg, parts)
        elif isinstance(msg, Cancel):
            self._on_cancel(msg)
        else:
            self.bad_messages += 1
            self._garbage.note(self.role, f"an unexpected {type(msg).__name__}")
            if self.reply is not None:
                what = f"an actor takes Call and Cancel messages, not {type(msg).__name__}"
                self.reply(identity, [encode(Fail(Code.BAD_REQUEST.value, what, self.role, ""))])

    def _is_new_request(self, call: Call) -> bool:
        """A client's first hop of a request this actor knows nothing of yet."""
        if call.origin != INPUT:
            return False
        return (call.request_id, call.hops) not in self._streams and not self._joins.holds(
            call.request_id
        )

    def _on_call(self, call: Call, parts: list[Any]) -> None:
        if call.role != self.role:
            return self._reject(
                call, Code.BAD_REQUEST, f"sent to {self.role}, meant for {call.role}"
            )
        if call.join is not None and call.join.role == self.role and call.join.parts > 1:
            return self._join_part(call, parts)
        key = (call.request_id, call.hops)  # a loop may bring a request back here
        stream = self._streams.get(key)
        if stream is None:
            if key in self._finished:
                if call.seq == 0:  # not a late chunk: a first chunk again (a replay)
                    message = f"request id {call.request_id!r} already ended at {self.role}"
                    return self._reject(call, Code.BAD_REQUEST, message)
                self._drop(call)
                return  # a late chunk of a request that already ended here
            if not self.accepting:
                return self._reject(call, Code.SHUTTING_DOWN, f"{self.role} is shutting down")
            if len(self._streams) >= self._max_pending:
                return self._reject(call, Code.OVERLOADED, f"{self.role} queue is full")
            if call.deadline and call.deadline <= time.time():
                return self._reject(call, Code.DEADLINE, "deadline passed before it started")
            if call.seq == 0 and call.last:
                if self._eager and self._slots.take():
                    return self._run_eager(call, key, parts)
                stream = self._open(call, key)
                run = self._run_single(stream, call, parts)
                if self.actor.eager:  # an eager generator: no Task until it suspends
                    self._start(stream, run)
                else:
                    stream.task = asyncio.create_task(run)
                return
            stream = self._open(call, key)
            stream.queue = asyncio.Queue()
            stream.task = asyncio.create_task(self._run_stream(stream))
        assert stream.queue is not None, "a single-chunk request got a second chunk"
        if stream.queue.qsize() >= self._max_chunks or stream.overflowed:
            self._drop(call)
            if not stream.overflowed and stream.task is not None:
                stream.overflowed = True
                _cancel_soon(stream.task)  # fails it as overloaded (_failed)
            return
        stream.queue.put_nowait((call, parts))

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
        span, now = stream.span, time.time()
        stream.span = None
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

    def _join_part(self, call: Call, parts: list[Any]) -> None:
        rid = call.request_id
        if not self._joins.holds(rid):
            if rid in self._refused_joins:  # a later part of a request refused here
                self._drop(call)
                return
            # Waiting parts count against the same bound as requests in flight: a flood
            # of parts whose partners are slow is refused at once, not buffered.
            if len(self._streams) + len(self._joins) >= self._max_pending:
                self._refused_joins[rid] = None
                while len(self._refused_joins) > _FINISHED_MEMORY:
                    self._refused_joins.popitem(last=False)
                return self._reject(call, Code.OVERLOADED, f"{self.role} queue is full")
            self._hold(call)
        ready = self._joins.add(call, parts)
        if ready is not None:
            self._on_call(*ready)
            self._unhold(call.request_id)  # the merged call holds it now, if it was taken
        elif call.deadline:  # parts wait at most until the request's deadline
            self._watch_deadlines()

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
                        _cancel_soon(stream.task)  # its handler cancels what it sent onward
        for key, (theirs, addresses) in list(self._finished.items()):
            if key[0] == rid:
                found = True
                if hmac.compare_digest(token, theirs):
                    matched = True
                    for address in addresses:
                        self._send_cancel(address, cancel)
        if found and not matched:
            self._forged.note(self.role, rid, "not the request's token")

    # ------------------------------------------------------------------ running

    def _run_eager(self, call: Call, key: tuple[str, int], parts: list[Any]) -> None:
        """A single-chunk request to an eager actor, run inside the reader callback.

        It holds a slot already. A handler that returns without suspending, and whose
        output leaves with one send, costs no Task, no ``Stream`` and no coroutine
        besides the handler's own: the Done (or the next hop's Call) goes out from
        here. Anything else (a suspension, an exception, a finish that must wait)
        moves the request into the general path from where it stands.
        """
        arrived = time.time()
        fanout = Fanout(self.router, self.role, call)
        span = self._trace(call, fanout, arrived) if call.trace else None
        ctx = Context(call.request_id, self.role, self.actor.replica, call.deadline, fanout.output)
        ctx._peer = fanout.peer
        started = time.perf_counter()
        try:
            tensors = materialize_tensors(call.tensors, parts) if call.tensors else {}
        except Exception as e:  # a refused ref: none of the call's refs counts as opened
            self._slots.release()
            release_tensors(call.tensors.values(), opened=False)
            return self._hand_over(
                call, key, fanout, ctx, (arrived, span), self._end_failed, e, opened=False
            )
        try:
            request = Request(call.request_id, call.data, tensors, call.params, call.session)
            coro = self.actor.handle(request, ctx)
            suspended = coro.send(None)
        except StopIteration as stop:
            out = stop.value
        except Exception as e:
            self._slots.release()
            return self._hand_over(call, key, fanout, ctx, (arrived, span), self._end_failed, e)
        else:  # it waits for something: the rest runs in a Task, under the same slot
            return self._hand_over(
                call, key, fanout, ctx, (arrived, span), self._continue, coro, suspended, started
            )
        compute = time.perf_counter() - started
        self._slots.release()
        usage = add_usage(dict(call.usage), ctx.usage) if ctx.usage else call.usage
        timings = [*call.timings, self._timing(compute, arrived, span, arrived)]
        try:
            rest = fanout.finish_now(call.credit, timings, usage, out)
        except Exception as e:
            return self._hand_over(call, key, fanout, ctx, (arrived, span), self._end_failed, e)
        if rest is not None:  # a peer's queue is full, or tensors must be exported
            return self._hand_over(call, key, fanout, ctx, (arrived, span), self._end_after, rest)
        self.served += 1
        if span is not None:
            self.tracer.end(span, time.time(), {"omniflow.compute_ms": compute * 1e3})
        _release_inputs(_pool_refs(call), ctx)
        if fanout.addresses:  # a late Cancel must still reach the next hop
            self._remember(key, call.token, fanout.addresses)

    def _hand_over(
        self,
        call: Call,
        key: tuple[str, int],
        fanout: Fanout,
        ctx: Context,
        opened_at: tuple[float, Span | None],
        then: Callable[..., Coroutine[Any, Any, None]],
        *args: Any,
        opened: bool = True,
    ) -> None:
        """Move an eager request that could not end inline into the general path: give it
        a ``Stream`` and run ``then(stream, *args)`` (a Task only if that suspends).
        ``opened``: its tensors were materialized (else they went back already)."""
        arrived, span = opened_at
        stream = self._open(call, key, fanout, ctx, span)
        stream.arrived = stream.started = arrived
        stream.handled = True  # it started inline
        self._account(stream, call)
        if opened:
            stream.refs += _pool_refs(call)
        self._start(stream, then(stream, *args))

    async def _continue(self, stream: Stream, coro: Any, suspended: Any, started: float) -> None:
        """The rest of a handler that suspended inline, under the slot it holds."""
        work = functools.partial(self._resume_handler, stream, coro, suspended, started)
        await self._run_with_limits(stream, work, slotted=True)

    async def _resume_handler(
        self, stream: Stream, coro: Any, suspended: Any, started: float
    ) -> None:
        try:
            out = await carry_on(coro, suspended)
        finally:
            stream.compute += time.perf_counter() - started
        self._take_usage(stream)
        stream.last_output = out

    async def _end_after(self, stream: Stream, rest: Any) -> None:
        """Await what an inline finish left to wait for (usually a full send queue)."""
        stream.finishing = True
        try:
            await rest
            self.served += 1
        except (asyncio.CancelledError, Exception) as e:
            await self._failed(stream, e)
        finally:
            self._close(stream)

    async def _end_failed(self, stream: Stream, error: BaseException) -> None:
        try:
            await self._failed(stream, error)
        finally:
            self._close(stream)

    def _start(self, stream: Stream, coro: Any) -> None:
        """Run a request now, up to its first suspension; it gets a Task only if it suspends.

        Most hops (a pass-through, a cache hit, a handler that only enqueues work) end
        without suspending: their Done leaves from this reader callback, with no Task
        to create, schedule and collect.
        """
        try:
            suspended = coro.send(None)
        except StopIteration:
            return
        resumed = resume(coro, suspended)
        resumed.send(None)
        stream.task = asyncio.get_running_loop().create_task(resumed)

    async def _run_single(self, stream: Stream, call: Call, parts: list[Any]) -> None:
        await self._run_with_limits(stream, lambda: self._handle_chunk(stream, call, parts))

    async def _run_with_limits(self, stream: Stream, work: Any, slotted: bool = False) -> None:
        try:
            await self._with_limits(stream, work, slotted)
        finally:
            self._close(stream)

    async def _run_stream(self, stream: Stream) -> None:
        async def consume() -> None:
            assert stream.queue is not None
            while True:
                call, parts = await stream.queue.get()
                is_marker = call.last and call.seq > 0 and not call.data and not call.tensors
                if not is_marker:
                    await self._handle_chunk(stream, call, parts)
                else:
                    self._account(stream, call)
                if call.last:
                    return

        try:
            await self._with_limits(stream, consume)
        finally:
            self._close(stream)

    async def _with_limits(self, stream: Stream, work: Any, slotted: bool = False) -> None:
        """Run ``work()`` under the concurrency slots and the deadline, then finish.

        ``slotted``: the request holds its slot already.
        """
        call = stream.call
        try:
            if call.deadline and self._sweeper is None:
                self._watch_deadlines()
            if not slotted and not self._slots.take():
                await self._slots.wait()
            if not slotted:
                stream.started = time.time()
            try:
                await work()
            finally:
                self._slots.release()
            stream.finishing = True  # past the deadline sweep: its outputs go out whole
            stream.timings.append(
                self._timing(stream.compute, stream.arrived, stream.span, stream.started)
            )
            await stream.fanout.finish(
                stream.credit, stream.timings, stream.usage, stream.last_output
            )
            self.served += 1
        except (asyncio.CancelledError, Exception) as e:
            await self._failed(stream, e)

    async def _failed(self, stream: Stream, error: BaseException) -> None:
        """End a request that raised ``error``: one Fail to the client, Cancels downstream."""
        if isinstance(error, asyncio.CancelledError):
            if stream.overflowed:
                message = f"{self.role}: more than {self._max_chunks} chunks waiting"
                await self._fail(stream, Code.OVERLOADED, message)
            elif stream.expired:
                await self._fail(stream, Code.DEADLINE, f"deadline exceeded in {self.role}")
            else:
                self._cancel_downstream(stream, Code.CANCELLED)
        elif isinstance(error, BadRequest):
            await self._fail(stream, Code.BAD_REQUEST, str(error))
        elif isinstance(error, (TensorError, RouteError)):
            code = getattr(error, "code", Code.BAD_REQUEST)
            # A replica that did not take the next hop: the client may move the request on.
            await self._fail(stream, code, str(error), getattr(error, "replica", ""))
        else:  # the handler's bug fails this request, not the actor
            log.error(
                "%s: request %s failed",
                self.role,
                stream.call.request_id,
                exc_info=(type(error), error, error.__traceback__),
            )
            await self._fail(stream, Code.ERROR, f"{type(error).__name__}: {error}")

    @staticmethod
    def _account(stream: Stream, call: Call) -> None:
        """What a chunk brings besides its input: credit, upstream timings and usage."""
        stream.credit += call.credit
        if call.timings:
            stream.timings += call.timings
        add_usage(stream.usage, call.usage)

    async def _handle_chunk(self, stream: Stream, call: Call, parts: list[Any]) -> None:
        self._account(stream, call)
        stream.handled = True
        try:
            tensors = materialize_tensors(call.tensors, parts) if call.tensors else {}
        except Exception:  # a refused ref: none of the call's refs counts as opened
            release_tensors(call.tensors.values(), opened=False)
            raise
        stream.refs += _pool_refs(call)  # opened: released when the request ends
        request = Request(
            call.request_id, call.data, tensors, call.params, call.session, call.seq, call.last
        )
        try:
            if self._is_gen:
                await self._drive_generator(stream, self.actor.handle(request, stream.ctx))
            else:
                started = time.perf_counter()
                try:
                    out = await self.actor.handle(request, stream.ctx)
                finally:
                    stream.compute += time.perf_counter() - started
                if out is not None:
                    if stream.queue is None:  # a single chunk: its output is the last one
                        stream.last_output = out
                    else:
                        await stream.fanout.output(out)
        finally:
            self._take_usage(stream)

    @staticmethod
    def _take_usage(stream: Stream) -> None:
        """Move what the handler counted (``ctx.add_usage``) into the request's usage."""
        if stream.ctx.usage:
            add_usage(stream.usage, stream.ctx.usage)
            stream.ctx.usage = {}

    async def _drive_generator(self, stream: Stream, gen: Any) -> None:
        """Forward each yield; time the handler's own work, not the sends."""
        try:
            while True:
                started = time.perf_counter()
                try:
                    out = await gen.__anext__()
                except StopAsyncIteration:
                    return
                finally:
                    stream.compute += time.perf_counter() - started
                if out is not None:
                    await stream.fanout.output(out)
        finally:
            await gen.aclose()

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
        _release_inputs(stream.refs, stream.ctx)
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
        while len(self._finished) > _FINISHED_MEMORY:
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

    # ------------------------------------------------------------------ shutdown

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


def _cancel_soon(task: asyncio.Task) -> None:
    """Cancel ``task`` once it has taken its first step: a Task cancelled before it ever
    ran never enters its body, so no ``finally`` of it would fail, close and release the
    request (all its chunks may come in one read, before the Task that takes them ran)."""
    asyncio.get_running_loop().call_soon(task.cancel)


def _pool_refs(call: Call) -> list[Any]:
    """The call's tensor refs that hold a pool block (every kind but an inline Frame)."""
    if not call.tensors:
        return []
    return [ref for ref in call.tensors.values() if not isinstance(ref, Frame)]


def _release_inputs(refs: list[Any], ctx: Context) -> None:
    """Give back what a finished request held: its inputs' pool blocks, its leases."""
    if refs:
        release_tensors(refs)
    if ctx.held:
        for lease in ctx.held:
            lease.release()
        ctx.held = []
