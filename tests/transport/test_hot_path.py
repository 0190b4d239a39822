"""The host's synchronous start: a Task only for a handler that suspends."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from omniflow.control.balance import make_policy
from omniflow.control.graph import Graph
from omniflow.control.routing import Router
from omniflow.messages import ActorRecord, Call, Cancel, Done, Fail, Frame
from omniflow.runtime.actor import Actor, Context, Request
from omniflow.runtime.host import ActorHost
from omniflow.transport.codec import decode, encode
from tests.helpers import run_in_loop

TOKEN = b"t" * 16  # the request token every Call carries (replies and cancels show it)


class _View:
    def replicas(self, role: str) -> list:
        onward = ("next", "other")
        return [ActorRecord(role, 0, 1, f"ipc://{role}", "host")] if role in onward else []

    def find(self, actor_id: str) -> None:
        return None


class _Outbox:
    """Records what was sent, and to where; ``full`` makes every try_send refuse."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.to: list[str] = []
        self.full = False

    def try_send(self, address: str, parts: list[Any]) -> bool:
        if self.full:
            return False
        self.sent.append(decode(parts[0]))
        self.to.append(address)
        return True

    async def send(self, address: str, parts: list[Any], timeout: float | None = None) -> None:
        await asyncio.sleep(0.01)  # the peer's queue drains
        self.full = False
        self.try_send(address, parts)

    def post(self, address: str, parts: list[Any]) -> None:
        self.try_send(address, parts)


class _Role(Actor):
    eager = True

    async def handle(self, request: Request, ctx: Context) -> Any:
        wait = request.data.get("wait")
        if wait == "sleep":
            await asyncio.sleep(0.01)
        elif wait == "forever":
            await asyncio.Event().wait()
        if request.data.get("fail"):
            raise RuntimeError("asked to")
        return {"text": request.data.get("text", "") + "!"}


class _TimedRole(Actor):
    """Not eager: its handler runs in a Task from the start, so asyncio.timeout works."""

    async def handle(self, request: Request, ctx: Context) -> Any:
        async with asyncio.timeout(5):
            return {"task": asyncio.current_task() is not None}


def _host(
    actor: Actor | None = None, onward: bool = False, fan: bool = False
) -> tuple[ActorHost, _Outbox]:
    """A host for ``role``; with ``onward``, its outputs go on to a role ``next``, and
    with ``fan`` to a role ``other`` as well."""
    graph = Graph()
    graph.edge("input", "role")
    roles = {"role"}
    for dst, wanted in (("next", onward or fan), ("other", fan)):
        if wanted:
            graph.edge("role", dst)
            roles.add(dst)
    outbox = _Outbox()
    policies = {r: make_policy("round_robin") for r in roles}
    router = Router(graph.compile(roles), _View(), outbox, policies)
    actor = actor or _Role("role", 0)
    return ActorHost(actor, router, max_concurrency=1), outbox  # type: ignore[arg-type]


def _call(rid: str, **data: Any) -> list[Any]:
    call = Call(
        rid, "role", "ipc://client", data=data, credit=5, deadline=time.time() + 30, token=TOKEN
    )
    return [encode(call)]


@run_in_loop
async def test_a_handler_that_never_suspends_answers_from_the_reader() -> None:
    host, outbox = _host()
    host.on_message(b"id", _call("a", text="hi"))
    (done,) = outbox.sent  # sent before the loop ran anything: no Task
    assert isinstance(done, Done) and done.data == {"text": "hi!"} and done.credit == 5
    assert host.inflight == 0


@run_in_loop
async def test_a_suspending_handler_continues_in_a_task() -> None:
    host, outbox = _host()
    host.on_message(b"id", _call("b", text="x", wait="sleep"))
    assert not outbox.sent and host.inflight == 1
    await asyncio.wait_for(host._idle.wait(), 5)
    (done,) = outbox.sent
    assert isinstance(done, Done) and done.data == {"text": "x!"}


@run_in_loop
async def test_a_failure_after_suspending_is_one_fail() -> None:
    host, outbox = _host()
    host.on_message(b"id", _call("c", wait="sleep", fail=True))
    await asyncio.wait_for(host._idle.wait(), 5)
    (fail,) = outbox.sent
    assert isinstance(fail, Fail) and fail.code == "error" and "asked to" in fail.message


@run_in_loop
async def test_cancel_reaches_a_suspended_handler_and_frees_its_slot() -> None:
    host, outbox = _host()
    host.on_message(b"id", _call("d", wait="forever"))
    host.on_message(b"id", _call("e", text="next"))  # waits for the only slot
    assert host.inflight == 2 and not outbox.sent
    host.on_message(b"id", [encode(Cancel("d", token=TOKEN))])
    await asyncio.wait_for(host._idle.wait(), 5)
    assert [type(m) for m in outbox.sent] == [Done]
    assert outbox.sent[0].data == {"text": "next!"}


@run_in_loop
async def test_a_default_actor_starts_in_a_task() -> None:
    host, outbox = _host(_TimedRole("role", 0))
    host.on_message(b"id", _call("t"))
    assert not outbox.sent  # not answered from the reader
    await asyncio.wait_for(host._idle.wait(), 5)
    (done,) = outbox.sent
    assert isinstance(done, Done) and done.data == {"task": True}


@run_in_loop
async def test_a_failure_before_suspending_is_one_fail_and_frees_the_slot() -> None:
    host, outbox = _host()
    host.on_message(b"id", _call("f", fail=True))
    await asyncio.wait_for(host._idle.wait(), 5)
    host.on_message(b"id", _call("g", text="after"))  # the only slot is free again
    fail, done = outbox.sent
    assert isinstance(fail, Fail) and fail.code == "error" and fail.request_id == "f"
    assert isinstance(done, Done) and done.data == {"text": "after!"} and host.inflight == 0


@run_in_loop
async def test_a_bad_tensor_ref_is_one_bad_request_fail() -> None:
    host, outbox = _host()
    refs = {"x": Frame(3, "float32", (2,))}
    call = Call("r", "role", "ipc://client", tensors=refs, credit=5, token=TOKEN)
    host.on_message(b"id", [encode(call)])  # frame 3 of a one-frame message
    await asyncio.wait_for(host._idle.wait(), 5)
    host.on_message(b"id", _call("s", text="after"))  # and its slot was given back
    fail, done = outbox.sent
    assert isinstance(fail, Fail) and fail.code == "bad_request" and "frame 3" in fail.message
    assert isinstance(done, Done) and done.request_id == "s"


@run_in_loop
async def test_an_inline_hop_carries_credit_timings_and_takes_late_cancels() -> None:
    host, outbox = _host(onward=True)
    host.on_message(b"id", _call("h", text="on"))
    (call,) = outbox.sent  # the next hop's Call left from the reader
    assert isinstance(call, Call) and outbox.to == ["ipc://next"]
    assert call.role == "next" and call.data == {"text": "on!"} and call.last
    assert call.credit == 5 and call.hops == 1 and call.origin == "role"
    assert [t.role for t in call.timings] == ["role"] and host.inflight == 0
    host.on_message(
        b"id", [encode(Cancel("h", token=TOKEN))]
    )  # after it ended here: forwarded onward
    await asyncio.sleep(0)
    assert isinstance(outbox.sent[-1], Cancel) and outbox.to[-1] == "ipc://next"


@run_in_loop
async def test_a_full_peer_queue_moves_the_finish_into_a_task() -> None:
    for onward, expect in ((False, Done), (True, Call)):
        host, outbox = _host(onward=onward)
        outbox.full = True
        host.on_message(b"id", _call("q", text="wait"))
        assert not outbox.sent and host.inflight == 1  # held until the queue takes it
        await asyncio.wait_for(host._idle.wait(), 5)
        (msg,) = outbox.sent
        assert isinstance(msg, expect) and msg.data == {"text": "wait!"} and msg.credit == 5


@run_in_loop
async def test_a_fan_out_splits_credit_and_sends_in_order_even_when_a_queue_is_full() -> None:
    for full in (False, True):
        host, outbox = _host(fan=True)
        outbox.full = full
        host.on_message(b"id", _call("u", text="two"))
        assert (not outbox.sent) == full  # a full queue: the sends wait in a Task
        await asyncio.wait_for(host._idle.wait(), 5)
        first, second = outbox.sent
        assert outbox.to == ["ipc://next", "ipc://other"]
        assert first.role == "next" and second.role == "other"
        assert first.data == second.data == {"text": "two!"} and first.last and second.last
        assert (first.credit, second.credit) == (3, 2)  # 5 split, the extra on the first
        assert [t.role for t in first.timings] == ["role"] and second.timings == []
