"""Runtime embedded in a plain asyncio program: no signal handlers, no loop policy change."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import omniflow
from omniflow.memory import pid_alive
from tests.conftest import leftover_sockets
from tests.helpers import echo_config, expected_echo


def test_runtime_in_a_plain_asyncio_program(run_root):
    sigint_before = signal.getsignal(signal.SIGINT)
    sigterm_before = signal.getsignal(signal.SIGTERM)
    policy_before = asyncio.get_event_loop_policy()
    seen: dict = {}

    async def host_program():
        loop = asyncio.get_running_loop()
        seen["loop_type"] = type(loop)
        seen["sigint_host"] = signal.getsignal(signal.SIGINT)  # asyncio.run's own handler
        async with omniflow.Runtime(echo_config(name="emb")) as rt:
            seen["pids"] = [r.proc.pid for r in rt.supervisor.replicas]
            chunks = []
            async for event in rt.stream({"text": "embedded in asyncio"}):
                if isinstance(event, omniflow.Output):
                    chunks.append(event.data["text"])
                else:
                    seen["result"] = event
            seen["chunks"] = chunks
            # Concurrent requests from the host program's own tasks.
            results = await asyncio.gather(*(rt.call({"text": f"r{i}"}) for i in range(20)))
            seen["concurrent"] = [outs[0].data["text"] for outs, _ in results]
            # The host's own handlers are untouched while the runtime runs.
            seen["sigint_during"] = signal.getsignal(signal.SIGINT)
        seen["loop_after"] = asyncio.get_running_loop() is loop

    asyncio.run(host_program())
    assert seen["loop_type"].__module__.startswith("asyncio")
    assert seen["chunks"] == expected_echo("embedded in asyncio")
    assert isinstance(seen["result"], omniflow.Result)
    assert seen["concurrent"] == [f"r{i}".upper()[::-1] for i in range(20)]
    assert seen["sigint_during"] is seen["sigint_host"]
    assert signal.getsignal(signal.SIGINT) is sigint_before
    assert signal.getsignal(signal.SIGTERM) is sigterm_before
    assert asyncio.get_event_loop_policy() is policy_before
    assert not [p for p in seen["pids"] if pid_alive(p)]
    assert leftover_sockets(run_root) == []


def test_setup_failure_is_reported_with_the_role(run_root):
    cfg = echo_config(name="bad", upper={"actor": "tests.graph_roles:FailsSetup"})

    async def main():
        try:
            async with omniflow.Runtime(cfg):
                pass
        except Exception as e:
            return e

    err = asyncio.run(main())
    assert isinstance(err, omniflow.runtime.supervisor.StartError)
    assert "upper/0" in str(err) and "no weights here" in str(err)
    assert leftover_sockets(run_root) == []


def test_two_deployments_of_one_name_in_different_run_dirs_keep_apart(run_root):
    """Same config name, two run dirs: each has its own pool; one stopping leaves the other."""

    async def host_program():
        first = omniflow.Runtime(echo_config(name="twin"), run_dir=run_root / "a")
        second = omniflow.Runtime(echo_config(name="twin"), run_dir=run_root / "b")
        async with first:
            async with second:
                assert first.supervisor.pool_name != second.supervisor.pool_name
                outs, _ = await second.call({"text": "second"}, timeout=20)
                assert outs[0].data["text"] == "".join(expected_echo("second"))
            # The second is gone, pool and all; the first still serves, its pool intact.
            assert (Path("/dev/shm") / first.supervisor.pool_name).exists()
            assert not (Path("/dev/shm") / second.supervisor.pool_name).exists()
            outs, _ = await first.call({"text": "first"}, timeout=20)
            assert outs[0].data["text"] == "".join(expected_echo("first"))

    asyncio.run(host_program())
