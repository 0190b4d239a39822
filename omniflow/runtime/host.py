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
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from omniflow.control.graph import INPUT
from omniflow.control.routing import Fanout, RouteError
from omniflow.messages import (
    MAX_ADDRESS_BYTES,
    MAX_ID_BYTES,
    TOKEN_BYTES,
    Call,
    Cancel,
    Code,
    DataMessage,
    Fail,
    add_usage,
)
from omniflow.runtime.actor import BadRequest, Context, Request
from omniflow.runtime.host_state import (
    FINISHED_MEMORY,
    HostState,
    cancel_soon,
    pool_refs,
    release_inputs,
)
from omniflow.runtime.inflight import Stream, carry_on, resume
from omniflow.runtime.tracing import Span
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

log = logging.getLogger(__name__)
_decoder = decoder_for(DataMessage)


class ActorHost(HostState):
    """Intake (ordering, joins, refusals) and running a request under the limits."""

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
            if (too_long := _too_long(msg)) is not None:
                self.bad_messages += 1
                return self._reject(msg, Code.BAD_REQUEST, f"{self.role}: {too_long}")
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
                cancel_soon(stream.task)  # fails it as overloaded (_failed)
            return
        stream.queue.put_nowait((call, parts))

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
                while len(self._refused_joins) > FINISHED_MEMORY:
                    self._refused_joins.popitem(last=False)
                return self._reject(call, Code.OVERLOADED, f"{self.role} queue is full")
            self._hold(call)
        ready = self._joins.add(call, parts)
        if ready is not None:
            self._on_call(*ready)
            self._unhold(call.request_id)  # the merged call holds it now, if it was taken
        elif call.deadline:  # parts wait at most until the request's deadline
            self._watch_deadlines()

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
        if span is not None and self.tracer.records:
            self.tracer.end(span, time.time(), {"omniflow.compute_ms": compute * 1e3})
        release_inputs(pool_refs(call), ctx)
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
            stream.refs += pool_refs(call)
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
                if not is_marker or self.actor.handles_stream_end:
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

    async def _handle_chunk(self, stream: Stream, call: Call, parts: list[Any]) -> None:
        self._account(stream, call)
        stream.handled = True
        try:
            tensors = materialize_tensors(call.tensors, parts) if call.tensors else {}
        except Exception:  # a refused ref: none of the call's refs counts as opened
            release_tensors(call.tensors.values(), opened=False)
            raise
        stream.refs += pool_refs(call)  # opened: released when the request ends
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


def _too_long(call: Call) -> str | None:
    """Which of a Call's names is past its bound (each must fit a holding-file slot)."""
    for field, value, limit in (
        ("request_id", call.request_id, MAX_ID_BYTES),
        ("reply_to", call.reply_to, MAX_ADDRESS_BYTES),
    ):
        if len(value) > limit // 4 and len(value.encode()) > limit:
            return f"Call.{field} is {len(value.encode())} bytes, more than {limit}"
    return None
