"""A flood of short-lived clients at an actor whose loop is busy: what waits unread is
bounded by ``runtime.inbox_hwm`` per sender (the senders' sends block instead), so the
actor's memory stays bounded, and it serves again once its loop is free."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import zmq

import omniflow
from omniflow.control.routing import FULL_CREDIT
from omniflow.messages import Call
from omniflow.runtime.config import parse
from omniflow.runtime.holding import read_holding
from omniflow.transport.codec import encode

HWM = 16
CLIENTS = 40
PER_CLIENT = 400
PAYLOAD = 16 << 10


def stall_config():
    return parse(
        {
            "name": "flood",
            "roles": {"stall": {"actor": "tests.runtime.stall_role:Stall", "max_queue": 64}},
            "graph": {"edges": [{"from": "input", "to": "stall"}]},
            "runtime": {"heartbeat_s": 0.5, "ttl_s": 10.0, "inbox_hwm": HWM},
        },
        "<test>",
    )


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def flood(endpoint: str, reply_to: str) -> list[int]:
    """Each client connects, sends until its send would block (or PER_CLIENT went), and
    leaves; how many each got out."""
    ctx = zmq.Context()
    sent = []
    text = "x" * PAYLOAD
    for client in range(CLIENTS):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 8)
        sock.connect(endpoint)
        n = 0
        while n < PER_CLIENT:
            call = Call(f"f{client}-{n}", "stall", reply_to, data={"text": text}, token=b"f" * 16)
            call.credit = FULL_CREDIT
            try:
                sock.send(encode(call), zmq.NOBLOCK)
            except zmq.Again:  # the actor takes no more from this sender: wait a little
                if not sock.poll(20, zmq.POLLOUT):
                    break
                continue
            n += 1
        sent.append(n)
        sock.close()
    ctx.term()
    return sent


def test_a_flood_of_clients_leaves_a_busy_actor_bounded_and_serving(run_root):
    async def main():
        async with omniflow.Runtime(stall_config()) as rt:
            replica = rt.supervisor.replicas[0]
            pid = replica.proc.pid
            release = Path(rt.run_dir) / "release"
            ctx = zmq.Context()
            replies = ctx.socket(zmq.ROUTER)  # the flood's replies land here, unread
            replies.setsockopt(zmq.LINGER, 0)
            replies.bind(f"ipc://{rt.run_dir}/flood-replies.sock")
            reply_to = replies.getsockopt_string(zmq.LAST_ENDPOINT)
            await rt.call({"text": "warm"}, timeout=30)
            before = rss_bytes(pid)
            stalled = asyncio.create_task(
                rt.call({"text": "stall"}, params={"until": str(release)}, timeout=120)
            )
            path = Path(rt.run_dir) / "stall-0.holding"
            until = time.monotonic() + 30
            while not read_holding(path, pid):  # its loop is blocked from here on
                assert time.monotonic() < until
                await asyncio.sleep(0.05)
            sent = await asyncio.to_thread(flood, replica.endpoint, reply_to)
            during = rss_bytes(pid)
            release.touch()
            outs, _ = await stalled
            while True:  # the backlog it read may still fill its queue for a moment
                try:
                    served, _ = await rt.call({"text": "after"}, timeout=60)
                    break
                except omniflow.RequestFailed as e:
                    assert e.code == "overloaded" and time.monotonic() < until + 60, e
            replies.close()
            ctx.term()
            return sent, during - before, outs, served

    sent, growth, outs, served = asyncio.run(main())
    flooded = sum(sent) * PAYLOAD
    assert all(n < PER_CLIENT for n in sent), sent  # every sender was held back
    assert growth < CLIENTS * PER_CLIENT * PAYLOAD // 4, (growth, flooded)
    assert outs[0].data["text"] == "stall" and served[0].data["text"] == "after"
