"""Requests in flight on a worker killed with -9 fail at once, as unavailable."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq

import omniflow
from omniflow.control.routing import FULL_CREDIT
from omniflow.messages import MAX_ADDRESS_BYTES, MAX_CALLER_ID_BYTES, MAX_ID_BYTES, Call, Fail
from omniflow.runtime.holding import HoldingFile, read_held, read_holding
from omniflow.runtime.request_check import InvalidRequest
from omniflow.transport.codec import decode, encode
from omniflow.transport.endpoint import Inbox, Outbox
from tests.helpers import echo_config


def test_requests_on_a_killed_worker_fail_at_once(run_root):
    # No heartbeat before the kill publishes what the replica holds: only the holding
    # file says which requests it took.
    cfg = echo_config(
        name="deadinflight",
        reverse={"options": {"delay_ms": 30_000}},
        runtime={"heartbeat_s": 30.0, "ttl_s": 60.0, "restart_backoff_s": 0.1},
    )

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            calls = [asyncio.create_task(rt.call({"text": f"w{i}"}, timeout=40)) for i in range(4)]
            victim = next(r for r in rt.supervisor.replicas if r.role == "reverse")
            path = Path(rt.run_dir) / "reverse-0.holding"
            until = time.monotonic() + 10
            while len(read_holding(path, victim.proc.pid)) < 4:  # all four are in reverse
                assert time.monotonic() < until, read_holding(path, victim.proc.pid)
                await asyncio.sleep(0.05)
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            ends = await asyncio.gather(*calls, return_exceptions=True)
            return ends, time.monotonic() - killed

    ends, waited = asyncio.run(main())
    assert all(isinstance(e, omniflow.RequestFailed) for e in ends), ends
    assert {(e.code, e.role) for e in ends} == {("unavailable", "reverse")}
    assert waited < 5.0  # not the 40 s deadline


def test_holding_file_names_what_is_held(tmp_path):
    """Every request held is in the file with its token, however many: the file grows
    (a death notice without the token is dropped by the client)."""
    path = tmp_path / "r-0.holding"
    held = HoldingFile(path, slots=2)
    slots = [held.add(f"r{i}", f"ipc:///tmp/x/client-{i}.sock", bytes([i]) * 16) for i in range(5)]
    assert -1 not in slots and held.slots == 8  # grew twice
    longest = "é" * (MAX_ID_BYTES // 2)  # a Call's longest id and address fit a slot
    big = held.add(longest, "tcp://" + "h" * (MAX_ADDRESS_BYTES - 6), b"t" * 16)
    assert big >= 0
    requests, tokens = read_held(path, os.getpid())
    assert len(requests) == 6 and tokens[longest] == b"t" * 16
    assert tokens["r3"] == bytes([3]) * 16
    for slot in slots:
        held.remove(slot)
    assert read_holding(path, os.getpid()) == [(longest, "tcp://" + "h" * (MAX_ADDRESS_BYTES - 6))]
    assert read_holding(path, os.getpid() + 1) == []  # another incarnation's file
    held.remove(big)
    assert read_holding(path, os.getpid()) == []
    held.close()
    assert not path.exists()


def test_names_past_their_bound_are_refused_by_name(run_root):
    """A Call whose request id or reply address would not fit the holding file is refused
    by the actor, naming the field; the caller's API refuses a long id before sending."""
    cfg = echo_config(name="longids")

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            with pytest.raises(InvalidRequest, match="request_id: 300 bytes"):
                await rt.call({"text": "x"}, request_id="i" * 300)
            ctx = zmq.Context()
            fails: list[Fail] = []
            replies = Inbox(
                ctx, f"ipc://{rt.run_dir}/replies.sock", lambda i, p: fails.append(decode(p[0]))
            )
            replies.start()
            outbox = Outbox(ctx)
            victim = next(r for r in rt.supervisor.replicas if r.role == "reverse")
            call = Call("i" * (MAX_ID_BYTES + 1), "reverse", replies.endpoint, data={"text": "x"})
            call.token, call.credit = b"d" * 16, FULL_CREDIT
            await outbox.send(victim.endpoint, [encode(call)])
            until = time.monotonic() + 10
            while not fails:
                assert time.monotonic() < until
                await asyncio.sleep(0.02)
            answer = await rt.call({"text": "ok"}, request_id="i" * MAX_CALLER_ID_BYTES)
            replies.close()
            outbox.close()
            ctx.term()
            return fails, answer

    fails, answer = asyncio.run(main())
    assert isinstance(fails[0], Fail) and fails[0].code == "bad_request"
    assert f"Call.request_id is {MAX_ID_BYTES + 1} bytes" in fails[0].message
    assert answer  # the actor kept serving, and an id at the bound goes through


def test_each_request_on_a_killed_worker_gets_one_fail(run_root):
    """Both the holding file and a heartbeat name what the replica held: the supervisor
    fails each request once, not once per list."""
    cfg = echo_config(
        name="onefail",
        reverse={"options": {"delay_ms": 30_000}},
        runtime={"heartbeat_s": 0.1, "ttl_s": 5.0, "restart_backoff_s": 0.1},
    )
    ids = [f"held-{i}" for i in range(3)]

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            ctx = zmq.Context()
            fails: Counter[str] = Counter()
            tokens: set[bytes] = set()

            def on_reply(identity, parts):
                msg = decode(parts[0])
                if isinstance(msg, Fail):
                    fails[msg.request_id] += 1
                    tokens.add(msg.token)

            replies = Inbox(ctx, f"ipc://{rt.run_dir}/replies.sock", on_reply)
            replies.start()
            outbox = Outbox(ctx)
            victim = next(r for r in rt.supervisor.replicas if r.role == "reverse")
            pid = victim.proc.pid
            for rid in ids:  # straight to reverse, its replies to this test's socket
                call = Call(rid, "reverse", replies.endpoint, data={"text": rid}, token=b"d" * 16)
                call.credit, call.deadline = FULL_CREDIT, time.time() + 60
                await outbox.send(victim.endpoint, [encode(call)])
            path = Path(rt.run_dir) / "reverse-0.holding"
            until = time.monotonic() + 20
            while True:  # the file and a heartbeat both name all three
                record = rt.client.view.find("reverse/0")
                beat = {rid for rid, _ in record.holding} if record else set()
                filed = {rid for rid, _ in read_holding(path, pid)}
                if beat >= set(ids) and filed >= set(ids):
                    break
                assert time.monotonic() < until, (beat, filed)
                await asyncio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            while victim.state != "ready" or victim.proc.pid == pid:  # both lists were read
                assert time.monotonic() < until + 20, victim.state
                await asyncio.sleep(0.05)
            while set(fails) < set(ids):
                assert time.monotonic() < until + 30, fails
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # a second Fail would have been sent before the restart
            replies.close()
            outbox.close()
            ctx.term()
            return fails, tokens

    fails, tokens = asyncio.run(main())
    assert fails == Counter({rid: 1 for rid in ids})
    assert tokens == {b"d" * 16}  # the holding file's token: a client would drop it otherwise
