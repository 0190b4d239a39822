"""A join's waiting parts are bounded like its queue: a flood is refused at once."""

from __future__ import annotations

import asyncio
import time

import omniflow
from omniflow.runtime.config import parse

R = "tests.graph_roles"


def test_join_parts_past_the_queue_bound_are_refused_as_overloaded_at_once(run_root):
    # input -> joiner directly, and input -> slow -> joiner: the direct parts wait 4 s
    # at the join for their partners.
    cfg = parse(
        {
            "name": "joinflood",
            "roles": {
                "slow": {"actor": "omniflow.roles.echo:Reverse", "options": {"delay_ms": 4_000}},
                "joiner": {"actor": f"{R}:Joiner", "max_concurrency": 1, "max_queue": 2},
            },
            "graph": {
                "edges": [
                    {"from": "input", "to": "slow"},
                    {"from": "input", "to": "joiner"},
                    {"from": "slow", "to": "joiner"},
                ]
            },
        },
        "<test>",
    )

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            started = time.monotonic()

            async def one(i: int):
                try:
                    await rt.call({"text": f"r{i}"}, timeout=30)
                    return "ok", time.monotonic() - started
                except omniflow.RequestFailed as e:
                    return f"{e.role}:{e.code}", time.monotonic() - started

            return await asyncio.gather(*(one(i) for i in range(10)))

    ends = asyncio.run(main())
    assert sorted(code for code, _ in ends) == ["joiner:overloaded"] * 7 + ["ok"] * 3, ends
    # Refused as they came, not once their partners arrived 4 s later.
    assert all(took < 2.5 for code, took in ends if code != "ok"), ends
