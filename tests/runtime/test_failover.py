"""Dead replicas: routing leaves them within the TTL (etcd), and idempotent stages retry elsewhere."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import omniflow
from tests.helpers import echo_config, expected_echo


def _reverse_pids(rt):
    return {r.replica: r.pid for r in rt.client.view.replicas("reverse")}


@pytest.mark.etcd
def test_etcd_killed_worker_leaves_routing_within_its_ttl(run_root, etcd_url):
    cfg = echo_config(
        name="etcdkill",
        reverse={"replicas": 2},
        runtime={"ttl_s": 2.0, "heartbeat_s": 0.5, "restart_backoff_s": 30.0},
    )
    cfg.registry = etcd_url

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            assert len(rt.client.view.replicas("reverse")) == 2
            victim = _reverse_pids(rt)[1]
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            while victim in _reverse_pids(rt).values():
                assert time.monotonic() - killed < cfg.runtime.ttl_s + 2.0, "still routed to"
                await asyncio.sleep(0.05)
            gone_after = time.monotonic() - killed
            # upper's own view drops it on the same etcd event, but its process may take it
            # later on a loaded machine (reverse is not idempotent: no retry elsewhere)
            await asyncio.sleep(1.0)
            # With the replica gone (its restart is 30 s away), every request goes to the other.
            outs = [await rt.call({"text": f"w{i}"}) for i in range(6)]
            return gone_after, [o[0][0].data for o in outs]

    gone_after, outputs = asyncio.run(main())
    assert gone_after <= 4.0
    assert {o["replica"] for o in outputs} == {0}
    assert [o["text"] for o in outputs] == [f"w{i}".upper()[::-1] for i in range(6)]


@pytest.mark.parametrize("idempotent", [True, False])
def test_send_to_a_dead_replica(run_root, idempotent):
    """The producer's view still lists a replica that just died: idempotent stages retry."""
    cfg = echo_config(
        name=f"dead{int(idempotent)}",
        reverse={"replicas": 2, "idempotent": idempotent, "policy": "round_robin"},
        runtime={
            "ttl_s": 30.0,
            "heartbeat_s": 0.5,
            "send_timeout_s": 0.3,
            "restart_backoff_s": 30.0,
        },
    )

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            sup = rt.supervisor
            # Keep the dead replica's record (as while a lease runs out on another host).
            sup.forget_dead = False
            victim = next(r for r in sup.replicas if r.role == "reverse" and r.index == 1)
            os.kill(victim.proc.pid, signal.SIGKILL)
            await asyncio.sleep(0.3)
            results = []
            for i in range(4):  # round robin: half of these are sent to the dead replica first
                try:
                    outs, _ = await rt.call({"text": f"x{i}"}, timeout=10)
                    results.append(outs[0].data["text"])
                except omniflow.RequestFailed as e:
                    results.append(e)
            return results

    results = asyncio.run(main())
    if idempotent:
        assert results == [t for i in range(4) for t in expected_echo(f"x{i}")]
    else:
        failures = [r for r in results if isinstance(r, omniflow.RequestFailed)]
        assert failures and all(f.code == "unavailable" for f in failures)
        assert all("reverse/1" in str(f) for f in failures)


def test_requests_in_flight_on_a_killed_replica_fail_at_once(run_root):
    cfg = echo_config(
        name="inflight",
        reverse={"replicas": 2, "policy": "round_robin", "options": {"delay_ms": 3000}},
        runtime={"heartbeat_s": 0.1, "restart_backoff_s": 0.2},
    )

    async def main():
        async with omniflow.Runtime(cfg) as rt:
            slow = [asyncio.create_task(rt.call({"text": f"s{i}"}, timeout=60)) for i in range(4)]
            await asyncio.sleep(1.0)  # all four sit in reverse; a heartbeat published them
            victim = next(r for r in rt.supervisor.replicas if r.role == "reverse" and r.index == 1)
            os.kill(victim.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            failed_at = []
            for task in asyncio.as_completed(slow):
                try:
                    await task
                except omniflow.RequestFailed:
                    failed_at.append(time.monotonic() - killed)
            return [t.exception() or t.result() for t in slow], failed_at

    results, failed_at = asyncio.run(main())
    failed = [r for r in results if isinstance(r, omniflow.RequestFailed)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert len(failed) == 2 and len(served) == 2  # round robin put two on each replica
    assert all(f.code == "unavailable" and f.role == "reverse" for f in failed)
    assert all("reverse/1 died" in str(f) for f in failed)
    assert max(failed_at) < 1.5  # at once, not at the 60 s deadline
