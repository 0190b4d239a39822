"""A worker's control link hears and sends again after ZeroMQ drops it for an oversized
frame (issue #40: ZeroMQ never connects again after such a protocol error), and loses
nothing in the instant of the drop."""

from __future__ import annotations

import asyncio
import time

import zmq

from omniflow.messages import Shutdown
from omniflow.runtime.control_link import ControlLink
from omniflow.transport.codec import MAX_HEADER_BYTES, encode

OVERSIZED = b"x" * (MAX_HEADER_BYTES + 1)


def _link(tmp_path) -> tuple[zmq.Context, zmq.Socket, ControlLink, list[bytes]]:
    """The supervisor's ROUTER and a started worker link to it (in a running loop)."""
    address = f"ipc://{tmp_path}/control.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    heard: list[bytes] = []
    link = ControlLink(ctx, address, heard.append)
    link.start()
    return ctx, router, link, heard


async def _receive(router: zmq.Socket) -> list[bytes]:
    until = time.monotonic() + 5
    while not router.poll(0):
        assert time.monotonic() < until, "the supervisor's end heard nothing"
        await asyncio.sleep(0.01)
    return router.recv_multipart()


def _close(ctx: zmq.Context, router: zmq.Socket, link: ControlLink) -> None:
    link.close(0)
    router.close(0)
    ctx.term()


def test_the_link_comes_back_after_an_oversized_frame(tmp_path):
    async def main():
        ctx, router, link, heard = _link(tmp_path)
        link.send(b"hello")
        identity, frame = await _receive(router)
        assert frame == b"hello"
        router.send_multipart([identity, OVERSIZED])  # dropped for it
        until = time.monotonic() + 5
        while not link.reopened:
            assert time.monotonic() < until, "the drop went unnoticed"
            await asyncio.sleep(0.01)
        link.send(b"ready")  # the Ready that ends a start: not lost
        identity, frame = await _receive(router)
        if frame == b"hello":  # the latest frame before the drop, sent again
            identity, frame = await _receive(router)
        assert frame == b"ready"
        router.send_multipart([identity, encode(Shutdown("down"))])  # and it hears again
        while not heard:
            assert time.monotonic() < until, "the new link is deaf"
            await asyncio.sleep(0.01)
        _close(ctx, router, link)
        return heard

    heard = asyncio.run(main())
    assert heard == [encode(Shutdown("down"))]  # the oversized frame never reached it


def test_nothing_is_lost_in_the_instant_of_a_drop(tmp_path):
    """A frame the supervisor sent just before the oversized one is still heard, and the
    latest frame the worker sent goes again on the new socket without a new send (it may
    have gone into the old one after the peer dropped it)."""

    async def main():
        ctx, router, link, heard = _link(tmp_path)
        link.send(b"ready")
        identity, frame = await _receive(router)
        assert frame == b"ready"
        shutdown = encode(Shutdown("down"))
        router.send_multipart([identity, shutdown])
        router.send_multipart([identity, OVERSIZED])
        time.sleep(0.2)  # both arrive and the link drops before the loop looks at it
        _, again = await _receive(router)  # the worker sends nothing more itself
        assert again == b"ready" and link.reopened == 1
        _close(ctx, router, link)
        return heard, shutdown

    heard, shutdown = asyncio.run(main())
    assert heard == [shutdown]  # read from the old socket before it closed


def test_a_send_that_finds_the_drop_first_reads_the_old_socket_before_closing_it(tmp_path):
    """The drop found by a send (before the loop's readers ran): the frame the supervisor
    sent before the oversized one is read from the old socket, not closed with it."""

    async def main():
        ctx, router, link, heard = _link(tmp_path)
        link.send(b"hello")
        identity, _ = await _receive(router)
        shutdown = encode(Shutdown("down"))
        router.send_multipart([identity, shutdown])
        router.send_multipart([identity, OVERSIZED])
        time.sleep(0.2)  # no loop turn: the readers have not run
        link.send(b"ready")  # its monitor check finds the drop and opens a new socket
        assert link.reopened == 1 and heard == [shutdown]
        got = [(await _receive(router))[1]]
        if got == [b"hello"]:  # the latest frame before the drop, sent again first
            got.append((await _receive(router))[1])
        assert got[-1] == b"ready"
        _close(ctx, router, link)

    asyncio.run(main())
