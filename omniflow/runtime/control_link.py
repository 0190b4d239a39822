"""A worker's line to its supervisor: Hello, Ready and SetupFailed go up it, and a
Shutdown may come down.

Frames from the supervisor's end are bounded (``MAXMSGSIZE``: its messages are headers),
so a peer at that address cannot make the worker buffer a large one. But ZeroMQ drops
a connection that sends a larger frame and, that being a protocol error, never connects
it again: the socket would stay deaf, and its next send (the Ready that ends the start)
would go into a pipe nobody reads. So a monitor watches the link, and a drop opens a new
socket at once (a send looks at the monitor first too).

A drop can land between frames: one from the supervisor already read into the old socket,
or a send the worker made on it after the peer had dropped it but before the monitor said
so. So the old socket is drained before it closes, and the last frame sent goes again on
the new one (the worker's messages are states, Hello, Ready or SetupFailed: the
supervisor takes a repeat of the latest as a no-op).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from omniflow.transport.codec import MAX_HEADER_BYTES
from omniflow.transport.endpoint import fd_of, stop_reading

log = logging.getLogger("omniflow.runtime.worker")


class ControlLink:
    """A DEALER to the supervisor's control ROUTER that comes back after a drop.

    ``on_message`` gets each frame that arrives (once ``start`` has added the readers).
    """

    def __init__(self, ctx: zmq.Context, address: str, on_message: Callable[[bytes], None]) -> None:
        self._ctx = ctx
        self._address = address
        self._on_message = on_message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.reopened = 0  # new sockets made after a drop
        self._last: bytes | None = None  # the latest frame sent: sent again after a drop
        self._open()

    def _open(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)  # the supervisor's are headers
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self._address)
        self._sock = sock
        if self._loop is not None:
            self._add_readers()

    def _add_readers(self) -> None:
        assert self._loop is not None
        self._loop.add_reader(fd_of(self._sock), self._drain)
        self._loop.add_reader(fd_of(self._monitor), self._on_event)
        self._loop.call_soon(self._drain)  # what came before the readers (edge-triggered)
        self._loop.call_soon(self._on_event)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._add_readers()

    def send(self, frame: bytes) -> None:
        """Send one header; a link that dropped is made again first (a send on the old
        socket would succeed and go nowhere)."""
        if self._closed:
            return
        self._on_event()
        self._last = frame
        self._sock.send(frame)

    def _drain(self) -> None:
        while not self._closed:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing more (zmq.Again), or the socket closed
                return
            self._on_message(frame)

    def _on_event(self) -> None:
        dropped = False
        while not self._closed and self._monitor.poll(0):
            dropped |= recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED
        if dropped:
            self._reopen()

    def _reopen(self) -> None:
        log.warning("the control link to the supervisor dropped; connecting again")
        self.reopened += 1
        self._drain()  # what the old socket had read before the drop
        self._close_socket(0)
        self._open()
        if self._last is not None and not self._closed:
            self._sock.send(self._last)

    def _close_socket(self, linger: int | None) -> None:
        stop_reading(self._loop, self._sock)
        stop_reading(self._loop, self._monitor)
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(linger)

    def close(self, linger: int | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_socket(linger)
