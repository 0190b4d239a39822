"""Requests in flight on a worker killed with -9 fail at once, as unavailable."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import omniflow
from omniflow.runtime.holding import HoldingFile, read_holding
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
    path = tmp_path / "r-0.holding"
    held = HoldingFile(path, slots=2)
    a = held.add("a", "ipc:///tmp/x/client-1.sock")
    b = held.add("b", "tcp://10.0.0.1:5555")
    assert held.add("c", "ipc://full") == -1  # no slot left: the heartbeat covers it
    assert held.add("x" * 300, "ipc://y") == -1
    held.remove(a)
    assert read_holding(path, os.getpid()) == [("b", "tcp://10.0.0.1:5555")]
    assert read_holding(path, os.getpid() + 1) == []  # another incarnation's file
    held.remove(b)
    assert read_holding(path, os.getpid()) == []
    held.close()
    assert not path.exists()
