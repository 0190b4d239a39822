"""Pool refs come back when their message cannot be used: a retry after a dead replica gives
back what it exported to that replica; a client gives back what a late answer brings."""

from __future__ import annotations

import asyncio
import os
import signal

import omniflow
from omniflow.memory import PagePool
from omniflow.runtime.config import parse
from tests.transport.test_dataplane_e2e import expected_sum

R = "tests.graph_roles"


def test_retry_elsewhere_releases_the_refs_exported_to_the_dead_replica(run_root):
    cfg = parse(
        {
            "name": "retryrefs",
            "roles": {
                "make": {"actor": f"{R}:MakeTensor"},
                "check": {
                    "actor": f"{R}:CheckTensor",
                    "replicas": 2,
                    "idempotent": True,
                    "policy": "round_robin",
                },
            },
            "graph": {"edges": [{"from": "input", "to": "make"}, {"from": "make", "to": "check"}]},
            "cache": {"host_pool": "64MiB", "page_size": "64KiB"},
            "runtime": {"send_timeout_s": 0.3, "restart_backoff_s": 60.0, "ttl_s": 30.0},
        },
        "<test>",
    )

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            sup = rt.supervisor
            sup.forget_dead = False  # producers keep routing to it, as while its lease runs
            victim = next(r for r in sup.replicas if r.role == "check" and r.index == 1)
            os.kill(victim.proc.pid, signal.SIGKILL)
            await victim.exited
            sums = []
            for seed in range(4):  # round robin: half go to the dead replica first
                outs, _ = await rt.call({"n": 1 << 18, "seed": seed}, timeout=20)
                sums.append(outs[0].data["sum"])
            pool = PagePool.attach(sup.pool_name)
            try:
                # A replica releases its input after its Done has left: give the last
                # release a moment. A leaked block (held for the dead pid) never returns.
                for _ in range(100):
                    if pool.stats().used_pages == 0:
                        break
                    await asyncio.sleep(0.05)
                return sums, pool.stats().used_pages
            finally:
                pool.close()

    sums, used = asyncio.run(main())
    assert sums == [expected_sum(1 << 18, seed) for seed in range(4)]
    assert used == 0  # every block came back: none is held for the dead pid


def test_a_late_answer_gives_its_pool_blocks_back(run_root):
    """The caller left the stream after its first chunk; the role, deaf meanwhile, sent four
    more chunks with pool blocks, which reach the client after the request ended there:
    their blocks go back at once, not when the client's process ends."""
    cfg = parse(
        {
            "name": "lateanswer",
            "roles": {"burst": {"actor": f"{R}:BurstTensors"}},
            "graph": {"edges": [{"from": "input", "to": "burst"}]},
            "cache": {"host_pool": "16MiB", "page_size": "64KiB"},
        },
        "<test>",
    )

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            pool = PagePool.attach(rt.supervisor.pool_name)
            try:
                async for out in rt.stream({"block_s": 0.5, "n": 4}, timeout=30):
                    first = out.data["i"]
                    break  # the client ends the request and sends its Cancel
                del out  # a kept output keeps its block (a view of the pool)
                await asyncio.sleep(0.7)  # the four came, late, at ~0.5 s
                for _ in range(100):
                    if pool.stats().used_pages == 0:
                        break
                    await asyncio.sleep(0.05)
                used = pool.stats().used_pages
                outs, _ = await rt.call({"block_s": 0, "n": 1}, timeout=10)  # it still serves
                return first, used, [o.data["i"] for o in outs]
            finally:
                pool.close()

    first, used, served = asyncio.run(main())
    assert first == 0
    assert used == 0
    assert served == [0, 1]
