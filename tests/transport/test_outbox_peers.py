"""An Outbox keeps a bounded number of peer sockets, whatever the number of peers."""

from __future__ import annotations

import asyncio
import os
import tempfile

import zmq

from omniflow.transport.endpoint import Inbox, Outbox
from tests.helpers import run_in_loop


@run_in_loop
async def test_outbox_closes_least_recently_used_peers():
    ctx = zmq.Context()
    folder = tempfile.mkdtemp(prefix="of-ob-", dir="/tmp")
    got: dict[int, list[bytes]] = {}
    inboxes = []
    for i in range(10):
        inbox = Inbox(ctx, f"ipc://{folder}/{i}.sock", lambda _, p, i=i: got[i].append(p[0]))
        got[i] = []
        inbox.start()
        inboxes.append(inbox)
    outbox = Outbox(ctx, send_timeout=5.0, max_peers=4)
    try:
        for round_ in range(2):  # the second round reopens every peer the first evicted
            for i, inbox in enumerate(inboxes):
                await outbox.send(inbox.endpoint, [b"%d-%d" % (round_, i)])
                await outbox.send(inboxes[0].endpoint, [b"keep"])  # the hot peer stays
                assert outbox.peers <= 4
        loop = asyncio.get_running_loop()
        until = loop.time() + 5
        while sum(map(len, got.values())) < 40 and loop.time() < until:
            await asyncio.sleep(0.01)
        for i in range(1, 10):
            assert got[i] == [b"0-%d" % i, b"1-%d" % i]
        assert got[0].count(b"keep") == 20
    finally:
        outbox.close()
        for inbox in inboxes:
            inbox.close()
        ctx.term()
        os.rmdir(folder)
