"""A request routed to a role its process's registry view has no ready replica of yet waits,
once, for the view to catch up (right after a start, one actor's view may lag the
client's), and fails as unavailable only when none turns up in time. Real registries
(embedded and etcd), a real RegistryView; the outbox records what would be sent."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omniflow.control import routing
from omniflow.control.balance import make_policy
from omniflow.control.discovery.base import actor_key, encode_record
from omniflow.control.discovery.view import RegistryView
from omniflow.control.graph import Graph
from omniflow.control.routing import Fanout, RouteError, Router
from omniflow.messages import ActorRecord, Call
from omniflow.transport.codec import decode


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def try_send(self, address: str, parts: list[Any]) -> bool:
        self.sent.append((address, decode(parts[0])))
        return True

    async def send(self, address: str, parts: list[Any], timeout: float | None = None) -> None:
        self.try_send(address, parts)


def _fanout(view: RegistryView, outbox: _Outbox) -> Fanout:
    graph = Graph()
    graph.edge("input", "fast")
    graph.edge("fast", "slow")
    roles = {"fast", "slow"}
    policies = {role: make_policy("round_robin") for role in roles}
    router = Router(graph.compile(roles), view, outbox, policies)  # type: ignore[arg-type]
    call = Call("r1", "fast", "ipc://client", credit=7, deadline=time.time() + 30)
    return Fanout(router, "fast", call)


@contextlib.asynccontextmanager
async def _view(backend, deployment: str) -> AsyncIterator[tuple[Any, RegistryView]]:
    """A registry client and a started view of ``deployment`` over it."""
    client = await backend.client()
    view = RegistryView(client, deployment)
    await view.start()
    try:
        yield client, view
    finally:
        await view.close()


def test_a_route_waits_for_the_view_to_see_a_ready_replica(registry):
    async def body(backend) -> None:
        async with _view(backend, "grace") as (client, view):
            outbox = _Outbox()
            rest = _fanout(view, outbox).finish_now(7, [], {}, {"text": "x"})
            assert rest is not None and not outbox.sent  # no replica of slow yet: it waits
            waiting = asyncio.ensure_future(rest)
            await asyncio.sleep(0.2)
            assert not waiting.done()
            record = ActorRecord("slow", 0, 1, "ipc://slow-0", "host")
            await client.put(actor_key("grace", "slow", 0), encode_record(record))
            await asyncio.wait_for(waiting, 10)
            ((address, call),) = outbox.sent
            assert address == "ipc://slow-0" and isinstance(call, Call)
            assert call.role == "slow" and call.data == {"text": "x"} and call.credit == 7

    registry.run(body)


def test_a_route_fails_as_unavailable_when_no_replica_turns_up(registry, monkeypatch):
    monkeypatch.setattr(routing, "NO_REPLICA_GRACE_S", 0.3)

    async def body(backend) -> None:
        async with _view(backend, "grace-none") as (_, view):
            outbox = _Outbox()
            fanout = _fanout(view, outbox)
            rest = fanout.finish_now(7, [], {}, {"text": "x"})
            assert rest is not None
            started = time.monotonic()
            with pytest.raises(RouteError, match="no live replica of role 'slow'"):
                await rest
            assert 0.25 < time.monotonic() - started < 5 and not outbox.sent
            # waited once: a second route in the same request fails at once
            with pytest.raises(RouteError, match="no live replica"):
                await fanout.output({"text": "y"})

    registry.run(body)
