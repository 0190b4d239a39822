"""etcd stopped under traffic and started again: the deployment keeps serving on what it
last knew, and its replicas are registered (and seen) again once etcd is back."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import omniflow
from tests.etcd_server import EtcdServer, etcd_binary
from tests.helpers import echo_config, expected_echo

pytestmark = pytest.mark.etcd


@pytest.fixture
def etcd(tmp_path):
    """An etcd of this test's own: the test stops and restarts it."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd server binary not found")
    server = EtcdServer(binary, tmp_path)
    server.start()
    yield server
    server.stop()


async def calls(rt, tag: str, n: int) -> list:
    """``n`` requests one after another; each ends as its text or its failure."""
    ends = []
    for i in range(n):
        try:
            outs, _ = await rt.call({"text": f"{tag}{i}"}, timeout=10)
            ends.append(outs[0].data["text"])
        except omniflow.RequestFailed as e:
            ends.append(e)
    return ends


async def wait_until(check, timeout: float, what: str) -> None:
    until = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < until, f"not within {timeout:g}s: {what}"
        await asyncio.sleep(0.1)


def test_a_deployment_outlives_an_etcd_outage_and_registers_again(run_root, etcd):
    cfg = echo_config(
        name="etcdout",
        reverse={"replicas": 2},
        runtime={"heartbeat_s": 0.2, "ttl_s": 2.0, "restart_backoff_s": 0.2},
    )
    cfg.registry = etcd.url

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            before = await calls(rt, "a", 4)
            etcd.stop()
            await asyncio.sleep(3.0)  # past the TTL: nothing may be dropped for silence
            during = await calls(rt, "b", 4)
            etcd.start()
            # A replica that dies now restarts and registers anew; every view sees it.
            victim = next(r for r in rt.supervisor.replicas if r.role == "reverse")
            old_pid = victim.proc.pid
            os.kill(old_pid, signal.SIGKILL)

            def replaced() -> bool:
                pids = {r.pid for r in rt.client.view.replicas("reverse")}
                return old_pid not in pids and len(pids) == 2

            await wait_until(replaced, 30.0, "the restarted replica in the client's view")
            after = await calls(rt, "c", 6)  # round robin: both replicas, the new one too
            served = {r.replica: r.pid for r in rt.client.view.replicas("reverse")}
            return before, during, after, served, victim.proc.pid

    before, during, after, served, new_pid = asyncio.run(main())
    assert before == [expected_echo(f"a{i}")[0] for i in range(4)]
    assert during == [expected_echo(f"b{i}")[0] for i in range(4)]  # served on the last view
    assert after == [expected_echo(f"c{i}")[0] for i in range(6)]
    assert new_pid in served.values()
