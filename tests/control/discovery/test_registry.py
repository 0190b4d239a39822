"""The Registry protocol suite, run against every backend (``embedded``, ``etcd``)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from omniflow.control.discovery.base import RegistryError, WatchEvent

REPO_ROOT = Path(__file__).resolve().parents[3]
LEASE_HOLDER = Path(__file__).with_name("_lease_holder.py")
EVENT_TIMEOUT = 5.0


def fresh_prefix() -> str:
    return f"/omniflow/test-{uuid.uuid4().hex[:12]}/"


async def next_events(events: AsyncIterator[WatchEvent], count: int) -> list[WatchEvent]:
    async def take() -> list[WatchEvent]:
        return [await anext(events) for _ in range(count)]

    return await asyncio.wait_for(take(), EVENT_TIMEOUT)


def test_put_list_delete(registry):
    async def body(backend):
        writer, reader = await backend.client(), await backend.client()
        prefix = fresh_prefix()
        await writer.put(prefix + "b", b"2")
        await writer.put(prefix + "a", b"1")
        await writer.put(prefix.rstrip("/") + "-outside", b"x")
        assert await reader.list(prefix) == [(prefix + "a", b"1"), (prefix + "b", b"2")]

        await writer.put(prefix + "a", b"1bis")
        await writer.delete(prefix + "b")
        await writer.delete(prefix + "never-put")  # deleting a missing key is not an error
        assert await reader.list(prefix) == [(prefix + "a", b"1bis")]
        assert await reader.list(fresh_prefix()) == []

    registry.run(body)


def test_watch_sees_put_and_delete_from_now_on(registry):
    async def body(backend):
        watcher, writer = await backend.client(), await backend.client()
        prefix = fresh_prefix()
        await writer.put(prefix + "before", b"old")
        await watcher.list(prefix)
        events = watcher.watch(prefix)  # changes after this call are delivered
        # A round trip on the watcher's own connection: a backend that sends its
        # watch request inside watch() has it registered once this returns.
        assert await watcher.list(prefix) == [(prefix + "before", b"old")]
        await writer.put(prefix + "k", b"v")
        await writer.put(fresh_prefix() + "elsewhere", b"ignored")
        await writer.delete(prefix + "k")
        await watcher.put(prefix + "own", b"mine")
        try:
            got = await next_events(events, 3)
        finally:
            await events.aclose()
        assert [(e.kind, e.key, e.value) for e in got] == [
            ("put", prefix + "k", b"v"),
            ("delete", prefix + "k", b""),
            ("put", prefix + "own", b"mine"),
        ]

    registry.run(body)


def test_a_cancelled_wait_for_the_next_event_keeps_the_watch(registry):
    async def body(backend):
        watcher, writer = await backend.client(), await backend.client()
        prefix = fresh_prefix()
        events = watcher.watch(prefix)
        await watcher.list(prefix)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(events), 0.2)  # cancels one __anext__, not the watch
        await writer.put(prefix + "k", b"v")
        (event,) = await next_events(events, 1)
        assert (event.kind, event.key, event.value) == ("put", prefix + "k", b"v")
        await events.aclose()

    registry.run(body)


def test_ttl_key_vanishes_after_owner_is_killed(registry):
    ttl = 2.0

    async def body(backend):
        observer = await backend.client()
        key = fresh_prefix() + "worker"
        holder = await asyncio.create_subprocess_exec(
            sys.executable, str(LEASE_HOLDER), backend.child_factory, backend.address, key,
            str(ttl),
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )  # fmt: skip
        try:
            line = await asyncio.wait_for(holder.stdout.readline(), 30)
            assert line == b"ready\n", f"lease holder failed to start: {line!r}"
            assert await observer.list(key) == [(key, b"alive")]
            events = observer.watch(key)
            # While its owner refreshes the lease, the key outlives its ttl.
            await asyncio.sleep(ttl * 1.5)
            assert await observer.list(key) == [(key, b"alive")]

            killed_at = time.monotonic()
            os.kill(holder.pid, signal.SIGKILL)
            await holder.wait()
            (event,) = await next_events(events, 1)
            waited = time.monotonic() - killed_at
            assert (event.kind, event.key) == ("delete", key)
            assert await observer.list(key) == []
            # Gone within the ttl (plus the server's expiry tick), not at some later sweep.
            assert waited <= ttl + 1.5, f"key outlived its dead owner by {waited:.1f}s"
            await events.aclose()
        finally:
            if holder.returncode is None:
                holder.kill()
                await holder.wait()

    registry.run(body)


def test_barrier_releases_exactly_when_the_nth_member_arrives(registry):
    async def body(backend):
        members = [await backend.client() for _ in range(3)]
        name = f"weights-loaded-{uuid.uuid4().hex[:8]}"
        early = [
            asyncio.create_task(members[i].barrier(name, 3, f"m{i}", timeout=20)) for i in range(2)
        ]
        # Two of three arrived: nobody may pass.
        done, _ = await asyncio.wait(early, timeout=1.0)
        assert not done, "barrier released before the 3rd member arrived"

        arrived_at = time.monotonic()
        await members[2].barrier(name, 3, "m2", timeout=20)
        await asyncio.wait_for(asyncio.gather(*early), 5)
        assert time.monotonic() - arrived_at < 5

    registry.run(body)


def test_barrier_times_out_cleanly_and_counts_distinct_members(registry):
    async def body(backend):
        first, second = await backend.client(), await backend.client()
        name = f"kv-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        # The same member twice is one arrival: a barrier of 2 must not release.
        results = await asyncio.gather(
            first.barrier(name, 2, "same", timeout=0.5),
            second.barrier(name, 2, "same", timeout=0.5),
            return_exceptions=True,
        )
        elapsed = time.monotonic() - started
        for result in results:
            assert isinstance(result, RegistryError), result
            assert name in str(result)
        assert 0.5 <= elapsed < 10.0  # waited its timeout, then gave up

        # The clients stay usable after a timeout.
        other = f"kv-{uuid.uuid4().hex[:8]}"
        await asyncio.wait_for(
            asyncio.gather(
                first.barrier(other, 2, "a", timeout=10), second.barrier(other, 2, "b", timeout=10)
            ),
            10,
        )

    registry.run(body)


def test_close_releases_the_lease_at_once(registry):
    async def body(backend):
        owner, reader = await backend.client(), await backend.client()
        prefix = fresh_prefix()
        await owner.put(prefix + "leased", b"1", ttl=30)
        await owner.put(prefix + "durable", b"2")
        assert [k for k, _ in await reader.list(prefix)] == [prefix + "durable", prefix + "leased"]

        await owner.close()
        # Not at the end of the 30 s ttl: now.
        assert await reader.list(prefix) == [(prefix + "durable", b"2")]
        await owner.close()  # idempotent

    registry.run(body)
