"""Tensors between actor processes through the deployment's page pool, and cleanup."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import torch

import omniflow
from omniflow.memory import PagePool
from omniflow.runtime.config import parse

R = "tests.graph_roles"


def config(name="pool"):
    return parse(
        {
            "name": name,
            "roles": {"make": {"actor": f"{R}:MakeTensor"}, "check": {"actor": f"{R}:CheckTensor"}},
            "graph": {"edges": [{"from": "input", "to": "make"}, {"from": "make", "to": "check"}]},
            "cache": {"host_pool": "64MiB", "page_size": "64KiB"},
        }
    )


def expected_sum(n, seed):
    return float(torch.rand(n, generator=torch.Generator().manual_seed(seed)).double().sum())


def segment(name):
    return Path("/dev/shm") / name


def test_large_tensors_move_by_handle_and_blocks_come_back(run_root):
    async def main():
        async with omniflow.Runtime(config()) as rt:
            pool_name = rt.supervisor.pool_name
            assert segment(pool_name).exists()
            results = []
            for in_pool in (False, True):
                for seed in range(3):
                    outs, _ = await rt.call({"n": 1 << 18, "seed": seed, "in_pool": in_pool})
                    results.append((seed, outs[0].data))
            small, _ = await rt.call({"n": 16, "seed": 9})
            # every handle was released: only the pool's bookkeeping remains
            pool = PagePool.attach(pool_name)
            try:
                used = pool.stats().used_pages
            finally:
                pool.close()
            return pool_name, results, small[0].data, used

    pool_name, results, small, used = asyncio.run(main())
    for seed, data in results:
        assert data["in_pool"] is True  # 1 MiB went through the pool, not a frame
        assert data["sum"] == expected_sum(1 << 18, seed)
    assert small["in_pool"] is False and small["sum"] == expected_sum(16, 9)  # frame
    assert used == 0
    assert not segment(pool_name).exists()


def test_kill_9_of_a_worker_then_down_leaves_nothing_in_dev_shm(run_root):
    async def main():
        async with omniflow.Runtime(config("pool9")) as rt:
            await rt.call({"n": 1 << 18, "in_pool": True})
            victim = next(r for r in rt.supervisor.replicas if r.role == "check")
            os.kill(victim.proc.pid, signal.SIGKILL)
            old_pid = victim.proc.pid
            deadline = time.monotonic() + 30
            while victim.state != "ready" or victim.proc.pid == old_pid:
                assert time.monotonic() < deadline, (victim.state, victim.proc.pid)
                await asyncio.sleep(0.1)
            await rt.client.view.wait_for("check", 5)
            outs, _ = await rt.call({"n": 1 << 18, "seed": 5, "in_pool": True}, timeout=20)
            return rt.supervisor.pool_name, outs[0].data

    pool_name, data = asyncio.run(main())
    assert data["sum"] == expected_sum(1 << 18, 5)
    assert not segment(pool_name).exists()
    assert not [p for p in Path("/dev/shm").iterdir() if "pool9" in p.name]
