"""How a deployment's replicas stop: in pipeline order, each role after all that feed it,
so a request in flight finishes through every role after it; what is late is killed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Collection

from omniflow.control.graph import INPUT, Plan
from omniflow.runtime.replica import Replica

log = logging.getLogger("omniflow.runtime.supervisor")


def stop_order(plan: Plan) -> list[set[str]]:
    """The roles in the order a drain stops them: by their longest distance from the
    input, so every role stops after all that feed it (loop edges aside: without them
    the graph has no cycle)."""
    depth: dict[str, int] = {}

    def of(role: str) -> int:
        if role not in depth:
            feeds = [e.src for e in plan.in_edges.get(role, []) if not e.max_iters]
            depth[role] = 1 + max((of(src) for src in feeds if src != INPUT), default=0)
        return depth[role]

    levels: dict[int, set[str]] = {}
    for role in plan.roles:
        levels.setdefault(of(role), set()).add(role)
    return [levels[d] for d in sorted(levels)]


def live(replicas: list[Replica], roles: Collection[str] | None = None) -> list[Replica]:
    """The replicas whose process runs (of ``roles``, where given)."""
    return [
        r
        for r in replicas
        if r.proc is not None and r.proc.poll() is None and (roles is None or r.role in roles)
    ]


def send_signal(replicas: list[Replica], sig: int) -> None:
    for r in replicas:
        assert r.proc is not None
        with contextlib.suppress(ProcessLookupError):
            r.proc.send_signal(sig)


async def stop_replicas(replicas: list[Replica], plan: Plan, budget: float) -> None:
    """Drain ``replicas`` level by level of ``stop_order`` within ``budget`` seconds; then
    SIGTERM what is left and, 2 s later, SIGKILL."""
    loop = asyncio.get_running_loop()
    until = loop.time() + budget
    # Workers refuse new requests but stay registered: later hops still find them.
    # Only to replicas past Hello: one still importing would die of SIGUSR1 (-10).
    send_signal([r for r in live(replicas) if r.state in ("setup", "ready")], signal.SIGUSR1)
    for roles in stop_order(plan):
        level = live(replicas, roles)
        send_signal(level, signal.SIGTERM)  # each drains what it holds, then exits
        exits = [r.exited for r in level if r.exited is not None]
        if exits and until > loop.time():
            await asyncio.wait(exits, timeout=until - loop.time())
    late = live(replicas)
    send_signal(late, signal.SIGTERM)
    late_exits = [r.exited for r in late if r.exited is not None]
    if late_exits:
        await asyncio.wait(late_exits, timeout=2.0)
    for r in live(replicas):
        log.warning("%s did not stop in time; killing it", r.actor_id)
        assert r.proc is not None
        with contextlib.suppress(ProcessLookupError):
            r.proc.kill()
    killed = [r.exited for r in replicas if r.exited is not None and not r.exited.done()]
    if killed:
        await asyncio.wait(killed, timeout=5.0)
