"""What the host keeps per request in flight, and how a started coroutine becomes a Task.

``Stream`` is a request's state at one actor; ``Slots`` bounds how many run the
handler at once. ``ActorHost`` starts handlers inside the socket reader; a handler
that suspends there is handed to a Task from where it stands (``carry_on``,
``resume``), so nothing of it runs twice and a cancel still reaches it.
"""

from __future__ import annotations

import asyncio
import time
import types
from collections import deque
from typing import Any

from omniflow.control.routing import Fanout
from omniflow.messages import Call, Timing
from omniflow.runtime.actor import Context


class Stream:
    """A request in flight at this actor."""

    __slots__ = (
        "call",
        "queue",
        "task",
        "fanout",
        "credit",
        "ctx",
        "compute",
        "timings",
        "usage",
        "last_output",
        "arrived",
        "refs",
        "expired",
        "finishing",
        "overflowed",
        "handled",
        "span",
        "started",
    )

    def __init__(self, call: Call, fanout: Fanout, ctx: Context) -> None:
        self.call = call
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.fanout = fanout
        self.ctx = ctx
        self.credit = 0
        self.compute = 0.0
        self.timings: list[Timing] = []
        self.usage: dict[str, int] = {}
        self.last_output: Any = None
        self.arrived = time.time()
        self.refs: list[Any] = []  # pool handles of its inputs, released when it ends
        self.expired = False  # cancelled by the deadline sweep
        self.finishing = False
        self.overflowed = False  # cancelled: more chunks waited than the bound
        self.handled = False  # a chunk reached the handler (else: discard its input)
        self.span: Any = None  # a traced request's span here (runtime/tracing.py)
        self.started = 0.0  # time.time() it got a handler slot


class Slots:
    """How many requests may run the handler at once; a Future only when none is free.

    asyncio.Semaphore costs two coroutines and a scan of its waiters per request even
    uncontended; this is an integer on the fast path.
    """

    __slots__ = ("free", "_waiters")

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiters: deque[asyncio.Future] = deque()

    def take(self) -> bool:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Wait for a slot, in arrival order; ``release`` hands it over directly."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot as the cancel came in: pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


@types.coroutine
def carry_on(coro: Any, suspended: Any) -> Any:
    """Go on with ``coro`` from where ``coro.send`` left it: waiting on ``suspended``."""
    while True:
        try:
            arg = yield suspended
            step = coro.send
        except BaseException as e:  # a cancel (or any throw) goes on to the coroutine
            step, arg = coro.throw, e
        try:
            suspended = step(arg)
        except StopIteration as stop:
            return stop.value


@types.coroutine
def resume(coro: Any, suspended: Any) -> Any:
    """Continue ``coro`` inside a Task from where ``coro.send`` left it: at ``suspended``.

    ``_start`` primes this generator, so a cancel that comes before the Task's first
    step is thrown in at the priming ``yield`` and reaches ``coro`` too.
    """
    try:
        yield  # primed
    except BaseException as e:  # cancelled before the Task ever ran
        try:
            suspended = coro.throw(e)
        except StopIteration as stop:
            return stop.value
    return (yield from carry_on(coro, suspended))
