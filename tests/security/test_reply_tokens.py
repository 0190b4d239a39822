"""Replies and cancels count only from the peers a request went to (issue #40 item 3).

The client draws a random token for each request and sends it in the Call; every hop
carries it on. A Done, Emit or Fail sent to the client's reply socket, and a Cancel sent
to an actor, must show it: one without it, or with another, is dropped (a warning per
window, not per message) and never answers, ends or cancels the request.

Before the fix a forged Done with the right request id replaced the answer, and a forged
Cancel left the request hanging without a Fail until its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path

import pytest
import zmq

import omniflow
from omniflow.control.routing import FULL_CREDIT
from omniflow.messages import Cancel, Done, Emit, Fail
from omniflow.runtime.config import parse
from omniflow.runtime.holding import read_holding
from omniflow.transport.codec import encode

ECHO = "omniflow.roles.echo"
DELAY_MS = 2500  # the request sits at `tail` this long: the forgeries land meanwhile
FORGERIES = 50


def chain_config():
    """head (upper-cases) -> tail (reverses, slowly): a hop the token must survive."""
    return parse(
        {
            "name": f"tok{os.getpid() % 10000}",
            "roles": {
                "head": {"actor": f"{ECHO}:Upper"},
                "tail": {"actor": f"{ECHO}:Reverse", "options": {"delay_ms": DELAY_MS}},
            },
            "graph": {"edges": [{"from": "input", "to": "head"}, {"from": "head", "to": "tail"}]},
            "runtime": {"heartbeat_s": 0.5, "ttl_s": 10.0, "max_migrations": 0},
        },
        "<test>",
    )


async def _at_tail(rt, rid: str) -> None:
    """Wait until ``rid`` is at the tail's replica (named in its holding file)."""
    tail = next(r for r in rt.supervisor.replicas if r.role == "tail")
    path = Path(rt.run_dir) / "tail-0.holding"
    until = time.monotonic() + 20
    while not any(held == rid for held, _ in read_holding(path, tail.proc.pid)):
        assert time.monotonic() < until, f"{rid} never reached tail"
        await asyncio.sleep(0.02)


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _forged_replies(rid: str, forge: str) -> list[bytes]:
    """What a peer that never saw the Call sends the client: each reply kind, for ``rid``,
    with no token ("none") or a token of its own ("wrong")."""
    extra = {} if forge == "none" else {"token": secrets.token_bytes(16)}
    injected = {"text": "INJECTED", "replica": 0}
    return [
        encode(Emit(rid, "tail", 0, injected, **extra)),
        encode(Done(rid, "tail", FULL_CREDIT, seq=0, data=injected, **extra)),
        encode(Fail("error", "INJECTED failure", "tail", rid, **extra)),
    ]


FORGES = ("none", "wrong")


async def _victims_at_tail(rt, prefix: str) -> tuple[asyncio.Task, dict[str, asyncio.Task]]:
    """An honest call (its answer is what the victims must get), and a victim call per
    kind of forgery, ``{prefix}-{forge}``, each waited for until it is at tail."""
    honest = asyncio.create_task(rt.call({"text": "a hop"}, timeout=30))
    calls = {
        forge: asyncio.create_task(
            rt.call({"text": "a hop"}, request_id=f"{prefix}-{forge}", timeout=30)
        )
        for forge in FORGES
    }
    for forge in FORGES:
        await _at_tail(rt, f"{prefix}-{forge}")
    return honest, calls


def test_a_forged_reply_never_replaces_the_answer(run_root, caplog):
    caplog.set_level(logging.WARNING, logger="omniflow.runtime.client")

    async def main():
        async with omniflow.Runtime(chain_config()) as rt:
            honest, calls = await _victims_at_tail(rt, "victim")
            ctx = zmq.Context()
            sock = _dealer(ctx, rt.client.inbox.endpoint)  # straight to the reply socket
            try:
                for _ in range(FORGERIES // 3 + 1):
                    for forge in FORGES:
                        for msg in _forged_replies(f"victim-{forge}", forge):
                            sock.send(msg)
                (expected,), _ = await asyncio.wait_for(honest, 30)  # the honest answer
                ends = {forge: await asyncio.wait_for(call, 30) for forge, call in calls.items()}
            finally:
                sock.close(0)
                ctx.term()
            for forge, (outputs, result) in ends.items():
                assert [o.data for o in outputs] == [expected.data], forge
                assert outputs[0].data["text"] != "INJECTED"
                assert result.request_id == f"victim-{forge}"
                assert result.latency_ms >= DELAY_MS * 0.9

    asyncio.run(main())
    dropped = [r for r in caplog.records if "not a reply with its token" in r.getMessage()]
    assert 1 <= len(dropped) <= 2, [r.getMessage() for r in dropped]  # rate-limited


def test_a_forged_cancel_leaves_the_request_running(run_root):
    async def main():
        async with omniflow.Runtime(chain_config()) as rt:
            started = time.monotonic()
            honest, calls = await _victims_at_tail(rt, "cancelled")
            tail = next(r for r in rt.supervisor.replicas if r.role == "tail")
            head = next(r for r in rt.supervisor.replicas if r.role == "head")
            ctx = zmq.Context()
            socks = [_dealer(ctx, tail.endpoint), _dealer(ctx, head.endpoint)]
            try:
                for sock in socks:  # where it is, and the hop it came through
                    for _ in range(FORGERIES):
                        sock.send(encode(Cancel("cancelled-none")))
                        sock.send(encode(Cancel("cancelled-wrong", token=secrets.token_bytes(16))))
                (expected,), _ = await asyncio.wait_for(honest, 30)
                ends = {forge: await asyncio.wait_for(call, 30) for forge, call in calls.items()}
            finally:
                for sock in socks:
                    sock.close(0)
                ctx.term()
            for forge, (outputs, _) in ends.items():
                assert [o.data for o in outputs] == [expected.data], forge
            assert time.monotonic() - started < 20  # answered, not left to their deadline
            log = (Path(rt.run_dir) / "logs" / "tail-0.log").read_text(errors="replace")
            lines = [x for x in log.splitlines() if "dropped a Cancel of cancelled-" in x]
            assert 1 <= len(lines) <= 2, lines  # 200 forgeries, rate-limited

    asyncio.run(main())


def test_the_clients_own_cancel_still_stops_the_request(run_root):
    """The token the request's Cancel carries is the one its hops brought to `tail`: a
    stream left early cancels it there (the handler's slot frees at once)."""

    async def main():
        async with omniflow.Runtime(chain_config()) as rt:
            rid = "left-early"
            stream = rt.stream({"text": "a hop"}, request_id=rid, timeout=30)
            first = asyncio.ensure_future(stream.__anext__())
            await _at_tail(rt, rid)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            await stream.aclose()  # the client sends its Cancel, with the token
            tail = next(r for r in rt.supervisor.replicas if r.role == "tail")
            path = Path(rt.run_dir) / "tail-0.holding"
            until = time.monotonic() + DELAY_MS / 1e3 * 0.8
            while any(held == rid for held, _ in read_holding(path, tail.proc.pid)):
                assert time.monotonic() < until, "the Cancel did not stop it at tail"
                await asyncio.sleep(0.02)

    asyncio.run(main())
