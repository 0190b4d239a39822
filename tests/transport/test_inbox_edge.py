"""ZeroMQ's FD is edge-triggered: a send on the Inbox's socket outside its drain can take
the edge that says a message arrived. The message must still be read (the registry after
a SIGCONT answered no keepalive for good before this: its reaper's watch events took it).
"""

from __future__ import annotations

import asyncio
import time

import zmq

from omniflow.transport.endpoint import Inbox


def test_a_message_queued_behind_a_send_from_outside_the_drain_is_still_read(tmp_path) -> None:
    ctx = zmq.Context()
    got: list[bytes] = []

    async def main() -> None:
        inbox = Inbox(ctx, f"ipc://{tmp_path}/in.sock", lambda who, parts: got.append(parts[0]))
        inbox.start()
        watcher, late = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (watcher, late):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(inbox.endpoint)
        try:
            watcher.send(b"hello")
            while got != [b"hello"]:
                await asyncio.sleep(0.01)
            identity = b""

            def remember(who: bytes, parts: list) -> None:
                nonlocal identity
                identity = who
                got.append(parts[0])

            inbox._on_message = remember
            watcher.send(b"again")
            while not identity:
                await asyncio.sleep(0.01)

            def stalled_then_send() -> None:
                # The loop is busy (or stopped) while a message comes in; then, before the
                # reader can run, a send from outside the drain takes the FD's edge.
                late.send(b"keepalive")
                time.sleep(0.3)
                inbox.reply(identity, [b"event"])

            asyncio.get_running_loop().call_soon(stalled_then_send)
            deadline = time.monotonic() + 3.0
            while b"keepalive" not in got:
                assert time.monotonic() < deadline, f"the queued message was never read: {got}"
                await asyncio.sleep(0.01)
            assert watcher.poll(1000) and watcher.recv() == b"event"
        finally:
            watcher.close(0)
            late.close(0)
            inbox.close()

    try:
        asyncio.run(main())
    finally:
        ctx.destroy(0)
