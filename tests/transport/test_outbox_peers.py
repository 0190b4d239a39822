"""An Outbox keeps a bounded number of peer sockets, whatever the number of peers."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import pytest
import zmq

from omniflow.transport.endpoint import Inbox, Outbox, PeerUnavailable
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


@run_in_loop
async def test_a_peer_that_timed_out_fails_later_sends_at_once_until_it_is_back():
    ctx = zmq.Context()
    folder = tempfile.mkdtemp(prefix="of-ob-", dir="/tmp")
    address = f"ipc://{folder}/gone.sock"
    outbox = Outbox(ctx, send_timeout=0.3)
    got: list[bytes] = []
    inbox = None
    try:
        with pytest.raises(PeerUnavailable):
            await outbox.send(address, [b"first"])  # waits out the 0.3 s
        # The next one fails without waiting at all: a client that left with many replies
        # due costs one timeout, not one per reply.
        pending = outbox.send(address, [b"second"])
        with pytest.raises(PeerUnavailable):
            pending.send(None)
        inbox = Inbox(ctx, address, lambda _, parts: got.append(parts[0]))
        inbox.start()
        loop = asyncio.get_running_loop()
        until = loop.time() + 5
        while not got:  # back: once the window passed, a send waits for the connection
            assert loop.time() < until
            try:
                await outbox.send(address, [b"back"])
            except PeerUnavailable:
                await asyncio.sleep(0.05)
                continue
            while not got and loop.time() < until:
                await asyncio.sleep(0.01)
        assert got == [b"back"]
    finally:
        outbox.close()
        if inbox is not None:
            inbox.close()
        ctx.term()
        shutil.rmtree(folder, ignore_errors=True)


@run_in_loop
async def test_a_post_waiting_on_a_socket_closed_under_it_ends_quietly():
    """A post still waiting for its peer when its socket closes (``forget``, or the
    outbox's close as a client exits) ends as best effort, with no task exception left
    unretrieved (``omniflow send`` printed one after an ``unavailable``)."""
    import gc

    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    ctx = zmq.Context()
    folder = tempfile.mkdtemp(prefix="of-ob-", dir="/tmp")
    try:
        for close in ("forget", "close"):
            outbox = Outbox(ctx, send_timeout=5.0)
            address = f"ipc://{folder}/nobody-{close}.sock"  # no peer: the post waits
            outbox.post(address, [b"cancel"])
            await asyncio.sleep(0.12)  # into its wait, past a re-check or two
            if close == "forget":
                outbox.forget(address)
            else:
                outbox.close()
            await asyncio.sleep(0.12)
            outbox.close()
        gc.collect()  # an unretrieved task exception is reported when its task goes
        await asyncio.sleep(0)
    finally:
        ctx.term()
        shutil.rmtree(folder, ignore_errors=True)
    assert errors == []
