"""A worker's control link hears and sends again after ZeroMQ drops it for an oversized
frame (issue #40: ZeroMQ never connects again after such a protocol error)."""

from __future__ import annotations

import asyncio
import time

import zmq

from omniflow.messages import Shutdown
from omniflow.runtime.control_link import ControlLink
from omniflow.transport.codec import MAX_HEADER_BYTES, encode


def test_the_link_comes_back_after_an_oversized_frame(tmp_path):
    address = f"ipc://{tmp_path}/control.sock"

    async def main():
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(address)
        heard: list[bytes] = []
        link = ControlLink(ctx, address, heard.append)
        link.start()

        async def receive() -> list[bytes]:
            until = time.monotonic() + 5
            while not router.poll(0):
                assert time.monotonic() < until, "the supervisor's end heard nothing"
                await asyncio.sleep(0.01)
            return router.recv_multipart()

        link.send(b"hello")
        identity, frame = await receive()
        assert frame == b"hello"
        router.send_multipart([identity, b"x" * (MAX_HEADER_BYTES + 1)])  # dropped for it
        until = time.monotonic() + 5
        while not link.reopened:
            assert time.monotonic() < until, "the drop went unnoticed"
            await asyncio.sleep(0.01)
        link.send(b"ready")  # the Ready that ends a start: not lost
        identity, frame = await receive()
        assert frame == b"ready"
        router.send_multipart([identity, encode(Shutdown("down"))])  # and it hears again
        while not heard:
            assert time.monotonic() < until, "the new link is deaf"
            await asyncio.sleep(0.01)
        link.close(0)
        router.close(0)
        ctx.term()
        return heard

    heard = asyncio.run(main())
    assert heard == [encode(Shutdown("down"))]  # the oversized frame never reached it
