"""etcd-only behaviour: url parsing, errors, lease replacement, watch robustness."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import aetcd
import pytest

from omniflow.control.discovery.base import RegistryError
from omniflow.control.discovery.etcd import EtcdRegistry

pytestmark = pytest.mark.etcd


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fresh_prefix() -> str:
    return f"/omniflow/etcd-{uuid.uuid4().hex[:12]}/"


def test_from_url_parses_host_and_port_and_rejects_other_schemes():
    assert EtcdRegistry.from_url("etcd://10.0.0.7:12379").url == "etcd://10.0.0.7:12379"
    assert EtcdRegistry.from_url("etcd://localhost").url == "etcd://localhost:2379"
    with pytest.raises(ValueError, match="http://x:1"):
        EtcdRegistry.from_url("http://x:1")


def test_unreachable_server_is_a_registry_error_naming_the_url():
    async def body():
        registry = EtcdRegistry.from_url(f"etcd://127.0.0.1:{unused_port()}", timeout=2)
        started = time.monotonic()
        with pytest.raises(RegistryError, match="127.0.0.1"):
            await registry.connect()
        assert time.monotonic() - started < 5
        await registry.close()

    asyncio.run(body())


def test_list_then_watch_misses_nothing_even_before_iteration_starts(etcd_server):
    # Plain asyncio here; the shared suite runs on uvloop.
    async def body():
        watcher = EtcdRegistry.from_url(etcd_server.url)
        writer = EtcdRegistry.from_url(etcd_server.url)
        prefix = fresh_prefix()
        assert await watcher.list(prefix) == []
        await writer.put(prefix + "early", b"1")  # after the list, before watch() is iterated
        events = watcher.watch(prefix)
        first = await asyncio.wait_for(anext(events), 5)
        assert (first.kind, first.key) == ("put", prefix + "early")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(events), 0.2)
        await writer.put(prefix + "late", b"2")
        second = await asyncio.wait_for(anext(events), 5)
        assert (second.kind, second.key) == ("put", prefix + "late")

        await watcher.close()  # ends every open watch
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(events), 5)
        await writer.close()

    asyncio.run(body())


def test_an_expired_lease_is_replaced_and_its_keys_put_back(etcd_server):
    async def body():
        owner = EtcdRegistry.from_url(etcd_server.url)
        prefix = fresh_prefix()
        await owner.put(prefix + "worker", b"record", ttl=5)
        # Simulate a stall longer than the ttl: the server drops the lease.
        host, port = etcd_server.url.removeprefix("etcd://").split(":")
        async with aetcd.Client(host=host, port=int(port)) as admin:
            await admin.revoke_lease(owner._lease.id)
        assert await owner.list(prefix) == []
        await owner.keepalive()
        assert await owner.list(prefix) == [(prefix + "worker", b"record")]
        await owner.close()

    asyncio.run(body())


def test_a_put_on_a_lost_lease_puts_every_key_back_on_a_new_one(etcd_server):
    # A worker whose record changed re-puts it at each heartbeat: after an outage that
    # cost its lease, that put must register it again, not fail at every beat.
    async def body():
        owner = EtcdRegistry.from_url(etcd_server.url)
        prefix = fresh_prefix()
        await owner.put(prefix + "a", b"1", ttl=5)
        await owner.put(prefix + "b", b"2", ttl=5)
        lost = owner._lease.id
        host, port = etcd_server.url.removeprefix("etcd://").split(":")
        async with aetcd.Client(host=host, port=int(port)) as admin:
            await admin.revoke_lease(lost)
        assert await owner.list(prefix) == []
        await owner.put(prefix + "b", b"3", ttl=5)
        assert owner._lease.id != lost
        assert await owner.list(prefix) == [(prefix + "a", b"1"), (prefix + "b", b"3")]
        await owner.close()

    asyncio.run(body())


def test_a_different_ttl_moves_leased_keys_to_one_new_lease(etcd_server):
    async def body():
        owner = EtcdRegistry.from_url(etcd_server.url)
        reader = EtcdRegistry.from_url(etcd_server.url)
        prefix = fresh_prefix()
        await owner.put(prefix + "a", b"1", ttl=30)
        first_lease = owner._lease.id
        await owner.put(prefix + "b", b"2", ttl=3)
        assert owner._lease.id != first_lease
        assert [k for k, _ in await reader.list(prefix)] == [prefix + "a", prefix + "b"]
        await owner.close()
        assert await reader.list(prefix) == []
        await reader.close()

    asyncio.run(body())
