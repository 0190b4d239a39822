"""The embedded registry's client bounds what it reads (issue #40 item 8): a fake registry
peer that answers with a frame past ``MAX_HEADER_BYTES`` is disconnected before the frame
is buffered (the client's peak memory does not move), and the client serves on once the
socket reconnects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import zmq

from omniflow.messages import RegList, RegReply
from omniflow.transport.codec import MAX_HEADER_BYTES, decode, encode

BIG = MAX_HEADER_BYTES * 4  # 256 MiB: far past any noise in the client's peak RSS

# The client, in a process of its own: its peak RSS is its own.
CLIENT = """
import asyncio, json, sys
from omniflow.control.discovery.base import RegistryError
from omniflow.control.discovery.embedded import EmbeddedRegistry

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

async def main():
    client = EmbeddedRegistry(sys.argv[1], timeout=3.0)
    before = hwm()
    try:
        await client.list("bounds/")
        first = "answered"
    except RegistryError as e:
        first = str(e)
    second = [[key, value.decode()] for key, value in await client.list("bounds/")]
    print(json.dumps({"first": first, "second": second, "growth": hwm() - before}))
    await client.close()

asyncio.run(main())
"""


def test_an_oversized_registry_reply_is_refused_and_the_client_serves_on():
    with tempfile.TemporaryDirectory(prefix="ofr-", dir="/tmp") as tmp:
        ctx = zmq.Context()
        fake = ctx.socket(zmq.ROUTER)  # stands where the supervisor's registry would
        fake.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{tmp}/registry.sock"
        fake.bind(address)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
        child = subprocess.Popen(
            [sys.executable, "-c", CLIENT, address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert fake.poll(60_000), "the client never asked"
            identity, header = fake.recv_multipart()
            first = decode(header)
            assert isinstance(first, RegList)
            fake.send_multipart([identity, b"\x00" * BIG])  # one frame, 256 MiB
            assert fake.poll(30_000), "the client did not ask again after its timeout"
            identity, header = fake.recv_multipart()  # a new connection: it reconnected
            second = decode(header)
            fake.send_multipart(
                [identity, encode(RegReply(second.rid, items=[("bounds/a", b"v")]))]
            )
            out, err = child.communicate(timeout=60)
        finally:
            child.kill()
            fake.close(0)
            ctx.term()
    assert child.returncode == 0, err
    got = json.loads(out.splitlines()[-1])
    assert "did not answer in time" in got["first"]
    assert got["second"] == [["bounds/a", "v"]], got
    assert got["growth"] < MAX_HEADER_BYTES, f"peak RSS grew {got['growth'] >> 20} MiB"
