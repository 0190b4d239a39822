"""The embedded registry: served by the supervisor over ZeroMQ, for one machine.

The server keeps keys in memory. A key put with a TTL lives on the lease of the
connection that put it (its ROUTER identity); ``keepalive`` refreshes every key
of that connection, and a connection that stops refreshing (its process died)
loses its keys when the TTL runs out, which watchers see as ``delete``.

A keepalive for a lease the server no longer holds (the owner was stopped past
its TTL, or the server was: a SIGSTOP, a VM pause, a stalled event loop) answers
``LEASE_EXPIRED``, and the client puts every key it held back at once.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from omniflow.control.discovery.base import Items, RegistryError, WatchEvent
from omniflow.messages import (
    RegBarrier,
    RegDelete,
    RegEvent,
    RegistryMessage,
    RegistryRequest,
    RegKeepalive,
    RegList,
    RegPut,
    RegReply,
    RegWatch,
)
from omniflow.transport.codec import MAX_HEADER_BYTES, BadMessage, decode, decoder_for, encode
from omniflow.transport.endpoint import Inbox, fd_of, stop_reading

_request_decoder = decoder_for(RegistryRequest)
_reply_decoder = decoder_for(RegistryMessage)
LEASE_EXPIRED = "lease expired"


class EmbeddedRegistryServer:
    def __init__(self, address: str, ctx: zmq.Context | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._address = address
        self._inbox: Inbox | None = None
        self._values: dict[str, bytes] = {}
        self._owner: dict[str, bytes] = {}  # key -> identity whose lease holds it
        self._ttl: dict[bytes, float] = {}
        self._expires: dict[bytes, float] = {}
        self._watches: dict[tuple[bytes, int], str] = {}
        self._barriers: dict[str, set[str]] = {}
        self._barrier_waiters: dict[str, list[tuple[bytes, int]]] = {}
        self._reaper: asyncio.Task | None = None

    @property
    def address(self) -> str:
        assert self._inbox is not None
        return self._inbox.endpoint

    async def start(self) -> None:
        # Registry messages are one header each: a larger frame is refused unread.
        self._inbox = Inbox(
            self._ctx, self._address, self._on_message, mandatory=True, max_message=MAX_HEADER_BYTES
        )
        self._inbox.start()
        self._reaper = asyncio.create_task(self._reap_expired(), name="registry-reaper")

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
        if self._inbox is not None:
            self._inbox.close()

    def _on_message(self, identity: bytes, parts: list[Any]) -> None:
        try:
            req = decode(parts[0], _request_decoder)
        except BadMessage:
            return  # not a registry client; nothing to answer
        if isinstance(req, RegPut):
            self._put(identity, req)
        elif isinstance(req, RegKeepalive):
            if identity in self._ttl:
                self._refresh(identity)
                self._reply(identity, RegReply(req.rid))
            else:  # reaped (or never granted): say so, the client puts its keys back
                self._reply(identity, RegReply(req.rid, ok=False, error=LEASE_EXPIRED))
        elif isinstance(req, RegDelete):
            self._delete(req.key)
            self._reply(identity, RegReply(req.rid))
        elif isinstance(req, RegList):
            items = [(k, v) for k, v in sorted(self._values.items()) if k.startswith(req.prefix)]
            self._reply(identity, RegReply(req.rid, items=items))
        elif isinstance(req, RegWatch):
            self._watches[(identity, req.rid)] = req.prefix
            self._reply(identity, RegReply(req.rid))
        elif isinstance(req, RegBarrier):
            self._arrive(identity, req)

    def _reply(self, identity: bytes, msg: Any) -> bool:
        assert self._inbox is not None
        return self._inbox.reply(identity, [encode(msg)])

    def _put(self, identity: bytes, req: RegPut) -> None:
        self._values[req.key] = req.value
        if req.ttl > 0:
            self._owner[req.key] = identity
            self._ttl[identity] = req.ttl
            self._refresh(identity)
        else:
            self._owner.pop(req.key, None)
        self._reply(identity, RegReply(req.rid))
        self._notify("put", req.key, req.value)

    def _refresh(self, identity: bytes) -> None:
        ttl = self._ttl.get(identity)
        if ttl is not None:
            self._expires[identity] = asyncio.get_running_loop().time() + ttl

    def _delete(self, key: str) -> None:
        if self._values.pop(key, None) is not None:
            self._owner.pop(key, None)
            self._notify("delete", key, b"")

    def _notify(self, kind: str, key: str, value: bytes) -> None:
        for (identity, rid), prefix in list(self._watches.items()):
            if key.startswith(prefix):
                if not self._reply(identity, RegEvent(rid, kind, key, value)):
                    del self._watches[(identity, rid)]  # the watcher is gone

    def _arrive(self, identity: bytes, req: RegBarrier) -> None:
        members = self._barriers.setdefault(req.name, set())
        members.add(req.member)
        waiters = self._barrier_waiters.setdefault(req.name, [])
        waiters.append((identity, req.rid))
        if len(members) >= req.n:
            for who, rid in waiters:
                self._reply(who, RegReply(rid))
            waiters.clear()

    async def _reap_expired(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            for identity, expiry in list(self._expires.items()):
                if expiry <= now:
                    self._expire(identity)
            nearest = min(self._expires.values(), default=now + 1.0)
            await asyncio.sleep(max(0.01, min(1.0, nearest - now)))

    def _expire(self, identity: bytes) -> None:
        self._expires.pop(identity, None)
        self._ttl.pop(identity, None)
        for key in [k for k, who in self._owner.items() if who == identity]:
            self._delete(key)


class EmbeddedRegistry:
    """A client of ``EmbeddedRegistryServer``; implements the ``Registry`` protocol."""

    def __init__(self, address: str, ctx: zmq.Context | None = None, timeout: float = 5.0) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._address = address
        self._open()
        self._timeout = timeout
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._watch_queues: dict[int, asyncio.Queue] = {}
        self._watch_prefixes: dict[int, str] = {}  # what to watch again on a new socket
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._leased: dict[str, tuple[bytes, float]] = {}  # key -> (value, ttl), to re-put

    def _open(self) -> None:
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A reply or event is one header: a peer at this address that sends a larger frame
        # is disconnected before it is buffered. ZeroMQ never reconnects a connection it
        # dropped so (a protocol error), so the monitor tells, and a call that then times
        # out opens a new socket (``_reopen``).
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._down = False
        self._sock.connect(self._address)

    def _dropped(self) -> bool:
        """Whether the connection is down and was not made again since."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            self._down = event == zmq.EVENT_DISCONNECTED
        return self._down

    def _reopen(self) -> None:
        """A new socket in place of one whose connection ZeroMQ gave up on: its watches are
        sent again (the lease is the keepalive's: it answers expired, and the keys go back)."""
        stop_reading(self._loop, self._sock)
        self._close_socket()
        self._open()
        if self._loop is not None:
            self._loop.add_reader(fd_of(self._sock), self._drain)
        for rid, prefix in self._watch_prefixes.items():
            self._sock.send(encode(RegWatch(rid, prefix)), zmq.NOBLOCK)

    def _close_socket(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)

    def _ensure_reader(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(fd_of(self._sock), self._drain)

    def _drain(self) -> None:
        while not self._closed:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 1:
                continue  # a registry message is one frame: not the registry's
            try:
                msg = decode(parts[0], _reply_decoder)
            except BadMessage:
                continue
            if isinstance(msg, RegEvent):
                queue = self._watch_queues.get(msg.rid)
                if queue is not None:
                    queue.put_nowait(WatchEvent(msg.kind, msg.key, msg.value))
                continue
            fut = self._pending.pop(msg.rid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def _call(self, make: Any, timeout: float | None = None) -> RegReply:
        if self._closed:
            raise RegistryError("registry client is closed")
        self._ensure_reader()
        assert self._loop is not None
        rid = next(self._rids)
        fut = self._loop.create_future()
        self._pending[rid] = fut
        self._sock.send(encode(make(rid)))
        self._drain()  # the send may have consumed the FD's edge
        try:
            reply = await asyncio.wait_for(fut, self._timeout if timeout is None else timeout)
        except TimeoutError:
            if self._dropped():  # and ZeroMQ will not connect it again by itself
                self._reopen()
            raise RegistryError("the embedded registry did not answer in time") from None
        finally:
            self._pending.pop(rid, None)
        if not reply.ok:
            raise RegistryError(reply.error)
        return reply

    async def put(self, key: str, value: bytes, ttl: float = 0.0) -> None:
        await self._call(lambda rid: RegPut(rid, key, value, ttl))
        if ttl > 0:
            self._leased[key] = (value, ttl)
        else:
            self._leased.pop(key, None)

    async def keepalive(self) -> None:
        try:
            await self._call(lambda rid: RegKeepalive(rid, []))
        except RegistryError as e:
            if str(e) != LEASE_EXPIRED:
                raise
            # The server reaped this lease (one side was stopped past the TTL):
            # put every key back now, whatever changed or did not.
            for key, (value, ttl) in list(self._leased.items()):
                await self._call(lambda rid, k=key, v=value, t=ttl: RegPut(rid, k, v, t))

    async def delete(self, key: str) -> None:
        self._leased.pop(key, None)
        await self._call(lambda rid: RegDelete(rid, key))

    async def list(self, prefix: str) -> list[tuple[str, bytes]]:
        reply = await self._call(lambda rid: RegList(rid, prefix))
        return [(k, bytes(v)) for k, v in reply.items]

    async def list_watch(self, prefix: str) -> tuple[Items, _Watch]:
        # The watch is registered before the list is sent (one socket, in order).
        events = self.watch(prefix)
        try:
            return await self.list(prefix), events
        except BaseException:
            await events.aclose()
            raise

    def watch(self, prefix: str) -> _Watch:
        # Registered now (the send is synchronous), not at the first __anext__:
        # anything this client does after watch() returns is seen.
        self._ensure_reader()
        rid = next(self._rids)
        queue: asyncio.Queue = asyncio.Queue()
        self._watch_queues[rid] = queue  # before the send: no event can slip by
        self._watch_prefixes[rid] = prefix
        self._sock.send(encode(RegWatch(rid, prefix)))
        self._drain()
        return _Watch(self, rid, queue)

    async def barrier(self, name: str, n: int, member: str, timeout: float) -> None:
        try:
            await self._call(lambda rid: RegBarrier(rid, name, n, member), timeout=timeout)
        except RegistryError:
            raise RegistryError(
                f"barrier {name!r}: fewer than {n} members arrived within {timeout:g}s"
            ) from None

    async def close(self) -> None:
        if self._closed:
            return
        for key in list(self._leased):  # release the lease now, not at expiry
            try:
                await self.delete(key)
            except RegistryError:
                break
        self._closed = True
        stop_reading(self._loop, self._sock)
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._close_socket()


class _Watch:
    """Cancel-safe: cancelling one ``__anext__`` leaves the watch running."""

    def __init__(self, client: EmbeddedRegistry, rid: int, queue: asyncio.Queue) -> None:
        self._client, self._rid, self._queue = client, rid, queue

    def __aiter__(self) -> _Watch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._rid not in self._client._watch_queues:
            raise StopAsyncIteration
        return await self._queue.get()

    async def aclose(self) -> None:
        self._client._watch_queues.pop(self._rid, None)
        self._client._watch_prefixes.pop(self._rid, None)
