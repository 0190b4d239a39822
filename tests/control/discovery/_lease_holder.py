"""A registry client in its own process, for the kill -9 test.

argv: <client factory expression> <address> <key> <ttl>. Puts ``key`` with
``ttl``, prints "ready", then keeps the lease alive until it is killed.
"""

from __future__ import annotations

import asyncio
import sys

import uvloop


async def main(factory: str, address: str, key: str, ttl: float) -> None:
    registry = eval(factory, {"address": address})  # the test's own source, not input
    await registry.put(key, b"alive", ttl=ttl)
    print("ready", flush=True)
    while True:
        await asyncio.sleep(ttl / 3)
        await registry.keepalive()


if __name__ == "__main__":
    factory, address, key, ttl = sys.argv[1:5]
    uvloop.run(main(factory, address, key, float(ttl)))
