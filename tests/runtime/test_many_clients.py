"""Short-lived clients: an actor's sockets stay bounded however many came and went."""

from __future__ import annotations

import asyncio
import os

import omniflow
from omniflow.runtime.client import Client
from omniflow.transport.endpoint import MAX_PEERS
from tests.helpers import echo_config, expected_echo


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_connect_call_close_cycles_leave_no_sockets_behind(run_root):
    cfg = echo_config(name="clients")

    async def cycles(rt: omniflow.Runtime, n: int) -> None:
        for i in range(n):
            client = Client(cfg, rt.supervisor.registry_address, rt.run_dir)
            await client.start()
            try:
                outs, _ = await client.call({"text": f"c{i}"})
                assert outs[0].data["text"] == expected_echo(f"c{i}")[0]
            finally:
                await client.close()

    async def main() -> tuple[int, int]:
        async with omniflow.Runtime(cfg) as rt:
            reverse = next(r.proc.pid for r in rt.supervisor.replicas if r.role == "reverse")
            await cycles(rt, MAX_PEERS + 50)  # past the bound: its sockets are recycled now
            settled = _fds(reverse)
            await cycles(rt, 2 * MAX_PEERS)
            return settled, _fds(reverse)

    settled, after = asyncio.run(main())
    # Without a bound every client left the replica one more socket (and FD).
    assert after - settled < 16, (settled, after)
