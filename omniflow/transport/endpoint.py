"""ZeroMQ sockets on the asyncio loop, without zmq.asyncio's per-call futures.

``Inbox`` binds one ROUTER and hands every complete message to a callback from
the loop's reader on the socket's FD. ``Outbox`` keeps one DEALER per peer
address and sends without blocking; only a full queue (or a peer that is not
connected) makes a send wait, on the DEALER's FD, with a timeout.

ZeroMQ's FD is edge-triggered: a reader callback must drain until EAGAIN, and
any send or recv on a socket can consume the edge, so every wait re-checks
``EVENTS`` before sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from omniflow.transport.security import (
    HANDSHAKE_FAILED,
    Gatekeeper,
    Keys,
    Refusals,
    check_private,
    describe_failure,
    secure_client,
    secure_server,
)
from omniflow.transport.throttle import Throttled

log = logging.getLogger(__name__)

# Plain ints: pyzmq's enum members cost an object construction per use, per message.
_EVENTS, _RCVMORE = int(zmq.EVENTS), int(zmq.RCVMORE)
_POLLIN, _POLLOUT, _NOBLOCK = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)

# pyzmq's Python-level Socket.send wrapper (copy thresholds, str checks) costs more
# than the send itself for a small header; the Cython method takes the same arguments.
_raw_send = zmq.backend.Socket.send

# DEALERs an Outbox keeps (one per peer: next-hop replicas and clients); the least
# recently used is closed past this, so short-lived clients cannot exhaust an actor's FDs.
MAX_PEERS = 128
_EVICT_LINGER_MS = 1000
_DRAIN_BATCH = 256  # messages per reader callback before yielding to other callbacks
# Messages an Inbox queues per connected peer while its loop does not read (RCVHWM). Past
# it ZeroMQ stops reading that peer's connection: the sender's own queue fills, then its
# sends block (an Outbox send fails with PeerUnavailable after its timeout).
INBOX_HWM = 1000
_ZERO_COPY_MIN = 64 * 1024  # below this, copying a frame is cheaper than tracking it
# The largest frame an Inbox reads (ZeroMQ's MAXMSGSIZE, per frame): a peer that announces
# a larger one is disconnected before a byte of it is buffered. Same-host tensors past
# cache.frame_threshold go by pool handle; this bounds tcp frames and the header
# (codec.MAX_HEADER_BYTES). ``runtime.max_message_size`` sets it per deployment.
MAX_MESSAGE_BYTES = 1 << 30


class PeerUnavailable(ConnectionError):
    """A peer did not accept a message within the send timeout."""


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def private_dir(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> None:
    """Make ``path`` (and missing parents) a directory only this user can enter: 0700,
    owned by us. ipc:// sockets live there, so another local user cannot even connect;
    a directory someone else made for us (in a shared /tmp) is refused, not reused, and
    so is every folder from ``root`` (default: ``path``) down that is not ours or that
    others may write (``UntrustedPath``, naming it)."""
    path = Path(path)
    top = Path(root) if root is not None else path
    chain = [path, *path.parents]
    below = reversed(chain[: chain.index(top) + 1]) if top in chain else [path]
    os.makedirs(top.parent, exist_ok=True)
    for folder in below:  # what we create here is 0700 whatever the umask
        try:
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)
        except FileExistsError:
            pass
    check_private(path, top if top in chain else path)
    if os.stat(path).st_mode & 0o777 != 0o700:
        os.chmod(path, 0o700)


class Inbox:
    """A bound ROUTER; ``on_message(identity, parts)`` gets ``[header, *frames]``.

    ``endpoint`` is what peers dial: the bound address, or on tcp:// ``advertise`` (the
    address other hosts reach) with the bound port.

    The header is ``bytes``; later frames are ``zmq.Frame``s viewing ZeroMQ's own
    buffers (no copy). At most ``hwm`` messages wait per peer: a flood cannot grow this
    process past that while its loop is busy; the senders wait instead. A frame larger
    than ``max_message`` bytes disconnects its sender before it is read into memory.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        on_message: Callable[[bytes, list[Any]], None],
        mandatory: bool = False,
        keys: Keys | None = None,
        hwm: int = INBOX_HWM,
        advertise: str = "",
        max_message: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        self._ctx = ctx
        self._on_message = on_message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._path: str | None = None
        self._monitor: zmq.Socket | None = None
        self._curve = False
        self._failures = Throttled(log, "dropped a message that its handler could not take: %s")
        self._draining = False  # inside _drain: it looks at EVENTS again after each message
        self._drain_due = False  # a _drain is scheduled already
        try:  # a refused bind (address in use) leaves nothing open behind it
            # CURVE on tcp:// when the deployment has keys; ipc:// stays in the 0700 run dir.
            if keys is not None and endpoint.startswith("tcp://"):
                secure_server(self._sock, keys)
                self._curve = True  # from here close() releases the gatekeeper
                # Keyless peers never reach the ZAP handler: the monitor sees them fail.
                self._monitor = self._sock.get_monitor_socket(HANDSHAKE_FAILED)
                self._refusals = Refusals()
            if mandatory:  # replies to a vanished peer raise instead of vanishing silently
                self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, hwm)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_message)
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            path = ipc_path(endpoint)
            if path and os.path.exists(path):
                os.unlink(path)  # a stale file from a killed process of the same name
            self._sock.bind(endpoint)
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if advertise and self.endpoint.startswith("tcp://"):
                # Bound on a wildcard (or behind NAT): peers dial the address they can reach.
                self.endpoint = f"tcp://{advertise}:{self.endpoint.rpartition(':')[2]}"
            self._path = ipc_path(self.endpoint)
            if self._path:
                os.chmod(self._path, 0o600)
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd_of(self._sock), self._drain)
        self._schedule_drain()  # messages that arrived before the reader
        if self._monitor is not None:
            self._loop.add_reader(fd_of(self._monitor), self._drain_monitor)
            self._loop.call_soon(self._drain_monitor)

    def _drain_monitor(self) -> None:
        monitor = self._monitor
        while not self._closed and monitor is not None and int(monitor.get(_EVENTS)) & _POLLIN:
            event = recv_monitor_message(monitor, _NOBLOCK)
            self._refusals.note(describe_failure(dict(event)))

    def _drain(self) -> None:
        self._drain_due = False
        self._draining = True
        try:
            more = self._drain_batch()
        finally:
            self._draining = False
        if more:  # more may be queued and the edge is consumed: come back after others ran
            self._schedule_drain()

    def _drain_batch(self) -> bool:
        sock = self._sock
        get, recv, on_message = sock.get, sock.recv, self._on_message
        for _ in range(_DRAIN_BATCH):
            # Checking EVENTS is far cheaper than letting recv raise EAGAIN.
            if self._closed or not get(_EVENTS) & _POLLIN:
                return False
            identity = recv(_NOBLOCK)
            parts: list[Any] = [recv(_NOBLOCK)]
            while get(_RCVMORE):
                parts.append(recv(_NOBLOCK, copy=False))  # tensor bytes: no copy
            try:
                on_message(identity, parts)
            except Exception as e:  # one bad message must not stop the drain (the edge is gone)
                self._failures.note(f"{type(e).__name__}: {e}", exc_info=True)
        return True

    def _schedule_drain(self) -> None:
        if not self._drain_due and not self._closed and self._loop is not None:
            self._drain_due = True
            self._loop.call_soon(self._drain)

    def reply(self, identity: bytes, parts: list[Any], copy: bool = True) -> bool:
        """Send back to the DEALER that sent ``identity``; False if it is gone or full.
        copy=False: large frames go without a copy (pyzmq keeps each buffer alive until sent)."""
        try:
            self._sock.send_multipart([identity, *parts], _NOBLOCK, copy=copy)
            return True
        except zmq.ZMQError:  # EAGAIN (full) or EHOSTUNREACH (gone, with mandatory)
            return False
        finally:
            # A send outside _drain (a timer's, another task's) may take the FD's one
            # readable edge: a message already queued would then wait for the next edge,
            # which may never come (the registry after a SIGCONT: every lease reaped at
            # once, each delete a watch event sent from the reaper, workers' keepalives
            # queued behind them, unanswered for good).
            if not self._draining:
                self._schedule_drain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            stop_reading(self._loop, self._monitor)
            self._sock.disable_monitor()
            self._monitor.close(0)
        stop_reading(self._loop, self._sock)
        self._sock.close(0)
        if self._curve:
            Gatekeeper.release(self._ctx)
        if self._path and os.path.exists(self._path):
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass


class Outbox:
    """One DEALER per peer address, created on first use; at most ``max_peers`` kept.

    Every client binds its own reply socket, so an actor meets a new peer per client:
    past ``max_peers`` the least recently used DEALER is closed (a later send to that
    peer opens a new one), which bounds an actor's sockets and FDs whatever the number
    of clients that came and went.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        send_timeout: float = 5.0,
        max_peers: int = MAX_PEERS,
        keys: Keys | None = None,
    ) -> None:
        self._ctx = ctx
        self._keys = keys  # CURVE client keys for tcp:// peers
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._sending: dict[str, int] = {}  # address -> sends waiting on its DEALER
        # Address -> loop time until which a send that cannot go at once fails at once:
        # one send there just waited out its timeout (a client that left, a dead peer).
        self._unreachable: OrderedDict[str, float] = OrderedDict()
        self._posts: set[asyncio.Task] = set()
        self.send_timeout = send_timeout
        self.max_peers = max_peers

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            self._evict(self.max_peers - 1)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            # Queue only to a connected peer: a send to a dead replica fails fast
            # instead of piling up behind a reconnect that never comes.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            if self._keys is not None and address.startswith("tcp://"):
                secure_client(sock, self._keys)
            sock.connect(address)
            self._socks[address] = sock
        return sock

    def _evict(self, keep: int) -> None:
        """Close least recently used DEALERs until at most ``keep`` are left (never one a
        send is waiting on)."""
        for address in list(self._socks):
            if len(self._socks) <= keep:
                return
            if address not in self._sending:
                # A linger lets what is already queued to a live peer still go out.
                self._socks.pop(address).close(_EVICT_LINGER_MS)

    @property
    def peers(self) -> int:
        return len(self._socks)

    def try_send(self, address: str, parts: list[Any]) -> bool:
        """Send now if the peer's queue takes it; False if it would block."""
        sock = self._socks.get(address)
        if sock is None:
            sock = self._socket(address)
        else:
            self._socks.move_to_end(address)
        try:
            if len(parts) == 1:  # the common case: a header alone
                _raw_send(sock, parts[0], _NOBLOCK)
                return True
            # copy=False: pyzmq holds a reference to each buffer object until libzmq
            # released the frame, so the tensor behind it stays alive meanwhile.
            copy = not any(_is_large(p) for p in parts[1:])
            sock.send_multipart(parts, _NOBLOCK, copy=copy)
            return True
        except zmq.Again:
            return False

    async def send(self, address: str, parts: list[Any], timeout: float | None = None) -> None:
        if self.try_send(address, parts):
            return
        loop = asyncio.get_running_loop()
        if self._unreachable.get(address, 0.0) > loop.time():
            raise PeerUnavailable(f"no connected peer at {address} (it timed out just now)")
        sock = self._socks[address]
        wait = self.send_timeout if timeout is None else timeout
        deadline = loop.time() + wait
        fd = fd_of(sock)
        self._sending[address] = self._sending.get(address, 0) + 1  # not evicted meanwhile
        try:
            while True:
                if sock.closed:  # closed meanwhile (the outbox, or forget): nowhere to go
                    raise PeerUnavailable(f"the socket to {address} was closed")
                if int(sock.get(_EVENTS)) & _POLLOUT and self.try_send(address, parts):
                    return
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self._mark_unreachable(address, loop.time(), wait)
                    raise PeerUnavailable(f"no connected peer took the message at {address}")
                if self._unreachable.get(address, 0.0) > loop.time():  # another send timed out
                    raise PeerUnavailable(f"no connected peer at {address} (it timed out just now)")
                ready = loop.create_future()
                loop.add_reader(fd, _set_ready, ready)
                # Re-check at least every 50 ms: the connection may complete without an FD
                # edge. A timer, not wait_for: Python 3.11's swallows a cancel that lands
                # as the wait ends, and the loop would go on with a closed socket.
                timer = loop.call_later(min(remaining, 0.05), _set_ready, ready)
                try:
                    await ready
                finally:
                    timer.cancel()
                    loop.remove_reader(fd)
        finally:
            left = self._sending.pop(address) - 1
            if left:
                self._sending[address] = left

    def _mark_unreachable(self, address: str, now: float, wait: float) -> None:
        """Later sends there that cannot go at once fail at once for ``wait`` seconds: a
        client that left with many requests in flight costs one timeout, not one per reply."""
        self._unreachable.pop(address, None)
        self._unreachable[address] = now + wait
        for old, until in list(self._unreachable.items()):  # oldest first
            if until > now and len(self._unreachable) <= self.max_peers:
                break
            del self._unreachable[old]

    def post(self, address: str, parts: list[Any]) -> None:
        """Send from synchronous code: now if possible, else from a task this outbox owns.

        A new DEALER takes nothing until its connection completes (IMMEDIATE), so a
        first message to a peer usually goes the slow way.
        """
        if self.try_send(address, parts):
            return
        task = asyncio.get_running_loop().create_task(self._post_later(address, parts))
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)

    async def _post_later(self, address: str, parts: list[Any]) -> None:
        try:
            await self.send(address, parts)
        except PeerUnavailable:
            pass  # best effort: the peer is gone (a client that left, a dead replica)

    def forget(self, address: str) -> None:
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close(0)

    def close(self, linger_ms: int = 0) -> None:
        """Close every DEALER; ``linger_ms`` lets what is queued to live peers still go."""
        for task in self._posts:
            task.cancel()
        for sock in self._socks.values():
            sock.close(linger_ms)
        self._socks.clear()


def fd_of(sock: zmq.Socket) -> int:
    """The socket's notification FD, for the loop's reader (edge-triggered)."""
    fd: Any = sock.getsockopt(zmq.FD)  # an int for FD (the stubs say int | bytes | str)
    return int(fd)


def stop_reading(loop: asyncio.AbstractEventLoop | None, sock: zmq.Socket) -> None:
    """Drop the loop's reader on ``sock`` (before the socket closes); a closed loop is fine."""
    if loop is None or loop.is_closed():
        return
    try:
        loop.remove_reader(fd_of(sock))
    except (ValueError, OSError, zmq.ZMQError):
        pass


def _set_ready(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _is_large(part: Any) -> bool:
    try:
        return len(part) >= _ZERO_COPY_MIN if isinstance(part, (bytes, memoryview)) else True
    except TypeError:
        return True
