"""A role learns which replica its output goes to before sending it (a KV lease names it)."""

from __future__ import annotations

import asyncio

import omniflow
from omniflow.runtime.config import parse


def test_peer_pid_is_the_replica_that_gets_the_output(run_root):
    cfg = parse(
        {
            "name": "peerpid",
            "roles": {
                "first": {"actor": "tests.graph_roles:AsksPeer", "options": {"to": "second"}},
                "second": {"actor": "tests.graph_roles:SaysPid", "replicas": 3},
            },
            "graph": {
                "edges": [{"from": "input", "to": "first"}, {"from": "first", "to": "second"}]
            },
        }
    )

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            pids = {r.proc.pid for r in rt.supervisor.replicas if r.role == "second"}
            outs = [await rt.call({"x": i}) for i in range(6)]
            return pids, [out[0][-1].data for out in outs]

    pids, answers = asyncio.run(main())
    assert all(a["peer_pid"] == a["pid"] for a in answers), answers
    assert {a["pid"] for a in answers} <= pids
