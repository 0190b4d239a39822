"""Requests still unread in a killed replica's socket queue (no death notice names them:
the replica never read them) move on to another replica instead of waiting out their
deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import omniflow
from omniflow.runtime.config import parse
from omniflow.runtime.holding import read_holding


def stall_config(name: str):
    return parse(
        {
            "name": name,
            "roles": {
                "stall": {
                    "actor": "tests.runtime.stall_role:Stall",
                    "replicas": 2,
                    "idempotent": True,
                    "policy": "round_robin",
                },
            },
            "graph": {"edges": [{"from": "input", "to": "stall"}]},
            "runtime": {"heartbeat_s": 30.0, "ttl_s": 60.0, "restart_backoff_s": 0.1},
        },
        "<test>",
    )


def test_requests_unread_by_a_killed_replica_move_on(run_root):
    async def main():
        async with omniflow.Runtime(stall_config("unread")) as rt:
            blocker = asyncio.create_task(
                rt.call({"text": "first"}, params={"block_ms": 3000}, timeout=20)
            )
            until = time.monotonic() + 10
            victim = None
            while victim is None:  # the replica that read it, its loop now blocked
                assert time.monotonic() < until
                await asyncio.sleep(0.05)
                for r in rt.supervisor.replicas:
                    path = Path(rt.run_dir) / f"stall-{r.index}.holding"
                    if read_holding(path, r.proc.pid):
                        victim = r
            # Round robin: two of these go to the blocked replica and stay unread there.
            later = [
                asyncio.create_task(rt.call({"text": f"later{i}"}, timeout=20)) for i in range(4)
            ]
            await asyncio.sleep(0.5)
            held = read_holding(Path(rt.run_dir) / f"stall-{victim.index}.holding", victim.proc.pid)
            killed = time.monotonic()
            os.kill(victim.proc.pid, signal.SIGKILL)
            ends = await asyncio.gather(blocker, *later, return_exceptions=True)
            return ends, held, time.monotonic() - killed

    ends, held, waited = asyncio.run(main())
    assert len(held) == 1, held  # only the first was read: the others sat in the queue
    assert all(isinstance(e, tuple) for e in ends), ends  # every request ended well
    texts = [outs[0].data["text"] for outs, _ in ends]
    assert texts == ["first"] + [f"later{i}" for i in range(4)]
    moved = [result.migrations for _, result in ends]
    assert moved[0] == 1  # the one it held: by the death notice
    assert sum(moved[1:]) == 2  # the two it never read: once it left the view
    assert waited < 15.0  # not the 20 s deadline
