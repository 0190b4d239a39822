"""A single-replica idempotent role killed mid-request: the request waits for the restarted
replica (within its deadline) and answers; the restart backoff resets after healthy uptime."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import omniflow
from tests.helpers import echo_config, expected_echo


def test_killed_single_idempotent_replica_still_answers(run_root):
    cfg = echo_config(
        name="rewait",
        upper={"idempotent": True, "options": {"delay_ms": 1000}},
        runtime={"heartbeat_s": 0.2, "ttl_s": 3.0, "restart_backoff_s": 0.1},
    )

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            answers = []
            for i in range(3):
                task = asyncio.create_task(rt.call({"text": f"a{i} b"}, timeout=60))
                await asyncio.sleep(0.4)  # it sits in upper's delay
                victim = next(r for r in rt.supervisor.replicas if r.role == "upper")
                os.kill(victim.proc.pid, signal.SIGKILL)
                outs, result = await task
                answers.append(([o.data["text"] for o in outs], result.migrations))
            return answers

    for i, (texts, migrations) in enumerate(asyncio.run(main())):
        assert texts == expected_echo(f"a{i} b") and migrations == 1


def test_restart_backoff_resets_after_healthy_uptime(run_root):
    cfg = echo_config(
        name="backoff",
        runtime={"restart_backoff_s": 0.5, "restart_backoff_max_s": 2.0, "heartbeat_s": 0.2},
    )

    async def down_time(rt, replica) -> float:
        old = replica.proc.pid
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        while replica.state != "ready" or replica.proc.pid == old:
            await asyncio.sleep(0.02)
        return time.monotonic() - killed

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            upper = next(r for r in rt.supervisor.replicas if r.role == "upper")
            quick = [await down_time(rt, upper) for _ in range(3)]  # 0.5, 1.0, 2.0 s waits
            await asyncio.sleep(2.5)  # healthy for longer than restart_backoff_max_s
            after_rest = await down_time(rt, upper)
            return quick, after_rest, upper.restarts

    quick, after_rest, restarts = asyncio.run(main())
    assert restarts == 4  # status still counts every restart
    # the first wait again, not the max (1.5 s apart: a slow start-up does not blur them)
    assert after_rest < quick[-1] - 0.8, (quick, after_rest)
