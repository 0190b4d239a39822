"""A view started with a fresh client misses no put made while it lists and watches.

etcd: the watch used to start "from now", registered after the list could answer, so a
put between the two was lost (roles ready but missing from /health for good, issue #40
item 6). Now the watch starts at the listing's revision + 1.
"""

from __future__ import annotations

import asyncio
import time

from omniflow.control.discovery import actor_key, encode_record
from omniflow.control.discovery.view import RegistryView
from omniflow.messages import ActorRecord


async def _keep_putting(writer, deployment: str, stop: asyncio.Event) -> int:
    n = 0
    while not stop.is_set():
        record = ActorRecord("r", n, 1, f"ipc://r-{n}", "host")
        await writer.put(actor_key(deployment, "r", n), encode_record(record))
        n += 1
    return n


def test_puts_while_a_view_starts_are_all_seen(registry):
    async def body(backend) -> None:
        writer = await backend.client()
        for i in range(12):
            deployment = f"vstart{i}-{time.time_ns()}"
            stop = asyncio.Event()
            putting = asyncio.create_task(_keep_putting(writer, deployment, stop))
            await asyncio.sleep(0.005 * (i % 4))
            view = RegistryView(await backend.client(), deployment)
            await view.start()
            await asyncio.sleep(0.05)
            stop.set()
            n = await putting
            until = time.monotonic() + 3
            while len(view.replicas("r")) < n:
                assert time.monotonic() < until, (
                    f"round {i}: {n - len(view.replicas('r'))} of {n} puts were lost"
                )
                await asyncio.sleep(0.01)
            await view.close()

    registry.run(body)
