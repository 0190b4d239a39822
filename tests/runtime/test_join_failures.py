"""A branch that fails frees what the other branches left waiting at the join."""

from __future__ import annotations

import asyncio
import time

import pytest

import omniflow
from omniflow.memory import PagePool
from omniflow.runtime.config import parse

R = "tests.graph_roles"


def test_a_failed_branch_frees_the_parts_waiting_at_the_join(run_root):
    # make -> bad (fails at once: no text) and make -> joiner directly; the two meet at
    # joiner, where make's part waits with its tensor in the pool.
    cfg = parse(
        {
            "name": "joinfail",
            "roles": {
                "make": {"actor": f"{R}:MakeTensor"},
                "bad": {"actor": "omniflow.roles.echo:Reverse"},
                "joiner": {"actor": f"{R}:Joiner"},
            },
            "graph": {
                "edges": [
                    {"from": "input", "to": "make"},
                    {"from": "make", "to": "bad"},
                    {"from": "make", "to": "joiner"},
                    {"from": "bad", "to": "joiner"},
                ]
            },
            "cache": {"host_pool": "64MiB", "page_size": "64KiB"},
        },
        "<test>",
    )

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            pool = PagePool.attach(rt.supervisor.pool_name)
            try:
                with pytest.raises(omniflow.RequestFailed) as failed:
                    await rt.call({"n": 1 << 18, "in_pool": True}, timeout=60)
                assert failed.value.role == "bad" and failed.value.code == "bad_request"
                until = time.monotonic() + 5
                while pool.stats().used_pages and time.monotonic() < until:
                    await asyncio.sleep(0.05)
                return pool.stats().used_pages
            finally:
                pool.close()

    assert asyncio.run(main()) == 0  # make's part no longer waits out a 60 s deadline
