"""The etcd v3 registry backend (``registry = "etcd://host:port"``).

Built on ``aetcd`` (asyncio-native gRPC; runs under uvloop). Every key put
with a ttl lives on this client's single lease; ``keepalive()`` refreshes it,
and a client whose process dies loses its keys when etcd expires the lease.
etcd lease TTLs are whole seconds and the server may raise a small TTL to its
minimum (about 2 s for a default 3.4 server).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions

from omniflow.control.discovery.base import Items, RegistryError, WatchEvent

BARRIER_PREFIX = "/omniflow/barriers/"
DEFAULT_PORT = 2379
# The lease a barrier creates when the client holds none yet (a worker may
# reach its barrier before it registers anything).
BARRIER_LEASE_TTL = 10.0

_EVENT_KINDS = {"PUT": "put", "DELETE": "delete"}


class EtcdRegistry:
    """A ``Registry`` on an etcd v3 server."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, timeout: float = 5.0):
        self.url = f"etcd://{host}:{port}"
        self._client = aetcd.Client(host=host, port=port, timeout=timeout)
        # A bound on each operation of ours, on top of aetcd's per-RPC timeout: a gRPC
        # call that never completes (seen under load) becomes a RegistryError, not a hang.
        self._op_timeout = 2 * timeout + 1.0
        self._lease: aetcd.Lease | None = None
        self._lease_ttl = 0.0  # the ttl asked for; etcd may grant more
        self._lease_lock = asyncio.Lock()
        self._leased: dict[str, bytes] = {}  # keys on the lease, re-put when it is replaced
        # Highest store revision this client has seen: a watch starts after it,
        # so ``list()`` then ``watch()`` misses no event in between.
        self._revision = 0
        self._watches: set[EtcdWatch] = set()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, timeout: float = 5.0) -> EtcdRegistry:
        parts = urlsplit(url)
        if parts.scheme != "etcd" or not parts.hostname:
            raise ValueError(f"registry url {url!r}: expected etcd://host:port")
        return cls(parts.hostname, parts.port or DEFAULT_PORT, timeout)

    async def connect(self) -> None:
        """Check the server answers (optional: every operation connects on first use)."""
        await self.list("/omniflow/.connect/")

    # ------------------------------------------------------------ key/value

    async def put(self, key: str, value: bytes, ttl: float = 0.0) -> None:
        async with self._errors(f"put {key!r}"):
            if ttl <= 0:
                self._leased.pop(key, None)
                reply = await self._client.put(key.encode(), value)
            else:
                lease = await self._lease_for(ttl)
                self._leased[key] = value
                try:
                    reply = await self._client.put(key.encode(), value, lease=lease)
                except aetcd.exceptions.ClientError as error:
                    if "lease not found" not in str(error):
                        raise
                    # The server lost the lease (it expired through an outage, or its
                    # data is new): every key on it is gone. A new lease takes them all
                    # back, this one included; without it the put fails for good.
                    await self._lease_lost(lease)
                    return
            self._saw(reply.header.revision)

    async def claim(self, key: str, value: bytes, ttl: float) -> bytes:
        """Put ``value`` at ``key`` on this client's lease unless the key exists (one
        transaction); the value there afterwards: ``value`` when this client took it.

        A key that already holds ``value`` (put by an earlier incarnation of this owner,
        whose lease has yet to expire) moves onto this client's lease: it stays taken."""
        async with self._errors(f"claim {key!r}"):
            lease = await self._lease_for(ttl)
            tx, raw = self._client.transactions, key.encode()
            took, replies = await self._client.transaction(
                compare=[tx.version(raw) == 0],
                success=[tx.put(raw, value, lease=lease)],
                failure=[tx.get(raw)],
            )
            if took:
                self._leased[key] = value
                return value
            found = replies[0] if replies else []
            held = found[0][0] if found else b""
        if held == value:
            await self.put(key, value, ttl)
        return held

    async def delete(self, key: str) -> None:
        self._leased.pop(key, None)
        async with self._errors(f"delete {key!r}"):
            reply = await self._client.delete(key.encode())
            if reply is not None:
                self._saw(reply.header.revision)

    async def list(self, prefix: str) -> list[tuple[str, bytes]]:
        async with self._errors(f"list {prefix!r}"):
            reply = await self._client.get_prefix(prefix.encode(), sort_order="ascend")
            self._saw(reply.header.revision)
            return [(kv.key.decode(), kv.value) for kv in reply]

    async def list_watch(self, prefix: str) -> tuple[Items, EtcdWatch]:
        """The listing, and a watch from the listing's revision + 1: a put between the
        two is seen (a watch "from now" registers later than the list answers)."""
        async with self._errors(f"list {prefix!r}"):
            reply = await self._client.get_prefix(prefix.encode(), sort_order="ascend")
            self._saw(reply.header.revision)
        items = [(kv.key.decode(), kv.value) for kv in reply]
        watch = EtcdWatch(self, prefix, reply.header.revision + 1)
        self._watches.add(watch)
        return items, watch

    def watch(self, prefix: str) -> EtcdWatch:
        # The start revision is taken now, not when iteration begins: events
        # after anything this client has already seen are delivered.
        watch = EtcdWatch(self, prefix, self._revision + 1 if self._revision else None)
        self._watches.add(watch)
        return watch

    # ------------------------------------------------------------ lease

    async def keepalive(self) -> None:
        async with self._lease_lock:
            if self._lease is None:
                return
            async with self._errors("keepalive"):
                reply = await self._lease.refresh()
                if reply is None or reply.TTL <= 0:
                    # The lease expired (a long stall, a partition): etcd
                    # already deleted our keys, so put them back on a new one.
                    await self._replace_lease(self._lease_ttl)

    async def _lease_lost(self, lease: aetcd.Lease) -> None:
        async with self._lease_lock:
            if self._lease is lease:  # not replaced meanwhile by another put or keepalive
                await self._replace_lease(self._lease_ttl)

    async def _lease_for(self, ttl: float) -> aetcd.Lease:
        async with self._lease_lock:
            if self._lease is None or ttl != self._lease_ttl:
                return await self._replace_lease(ttl)
            return self._lease

    async def _replace_lease(self, ttl: float) -> aetcd.Lease:
        """Grant a lease of ``ttl``, move every leased key onto it, revoke the old one."""
        old = self._lease
        lease = self._lease = await self._client.lease(max(1, math.ceil(ttl)))
        self._lease_ttl = ttl
        for key, value in list(self._leased.items()):
            reply = await self._client.put(key.encode(), value, lease=lease)
            self._saw(reply.header.revision)
        if old is not None:
            with contextlib.suppress(aetcd.exceptions.ClientError):
                await old.revoke()
        return lease

    # ------------------------------------------------------------ barrier

    async def barrier(self, name: str, n: int, member: str, timeout: float) -> None:
        """Each member puts ``/omniflow/barriers/<name>/<member>`` on its lease and
        waits until ``n`` distinct member keys exist.

        Member keys stay until the lease ends (close or death), so a barrier name
        is single-use: put a generation in the name to reuse it.
        """
        prefix = f"{BARRIER_PREFIX}{name}/"
        key = prefix + member
        arrived: set[str] = set()
        # The owner may be blocked here before it ever calls keepalive().
        refresher = asyncio.create_task(self._refresh_while_waiting())
        try:
            await asyncio.wait_for(self._arrive(prefix, key, n, arrived), timeout)
        except TimeoutError:
            with contextlib.suppress(RegistryError):
                await self.delete(key)
            raise RegistryError(
                f"barrier {name!r} timed out after {timeout}s: "
                f"{len(arrived)} of {n} members arrived ({sorted(arrived)})"
            ) from None
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher

    async def _arrive(self, prefix: str, key: str, n: int, arrived: set[str]) -> None:
        if self._lease is None:
            await self.put(key, b"", ttl=BARRIER_LEASE_TTL)
        else:
            await self.put(key, b"", ttl=self._lease_ttl)
        async with self._errors(f"barrier {prefix!r}"):
            listing = await self._client.get_prefix(prefix.encode())
        arrived.update(kv.key.decode() for kv in listing)
        if len(arrived) >= n:
            return
        # Watching from the listing's revision + 1 sees every arrival after it.
        events = EtcdWatch(self, prefix, listing.header.revision + 1)
        try:
            async for event in events:
                if event.kind == "put":
                    arrived.add(event.key)
                else:
                    arrived.discard(event.key)
                if len(arrived) >= n:
                    return
        finally:
            await events.aclose()
        raise RegistryError(f"barrier {prefix!r}: watch ended before {n} members arrived")

    async def _refresh_while_waiting(self) -> None:
        while True:
            await asyncio.sleep(max(self._lease_ttl, 1.0) / 3)
            with contextlib.suppress(RegistryError):
                await self.keepalive()

    # ------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Revoke the lease (its keys vanish now, not at expiry) and close the channel."""
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            await watch.aclose()
        async with self._lease_lock:
            if self._lease is not None:
                with contextlib.suppress(aetcd.exceptions.ClientError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._lease.revoke(), 5.0)
                self._lease = None
        self._leased.clear()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._client.close(), self._op_timeout)

    # ------------------------------------------------------------ helpers

    def _saw(self, revision: int) -> None:
        if revision > self._revision:
            self._revision = revision

    @contextlib.asynccontextmanager
    async def _errors(self, what: str, bounded: bool = True) -> AsyncIterator[None]:
        """aetcd's errors as RegistryError; a ``bounded`` operation that takes longer than
        ``_op_timeout`` is one too."""
        if self._closed:
            raise RegistryError(f"{self.url}: {what}: the registry client is closed")
        try:
            async with asyncio.timeout(self._op_timeout if bounded else None):
                yield
        except aetcd.exceptions.ClientError as error:
            raise RegistryError(f"{self.url}: {what} failed: {error!r}") from error
        except TimeoutError:
            raise RegistryError(
                f"{self.url}: {what}: no answer within {self._op_timeout:.0f}s"
            ) from None


class EtcdWatch:
    """Events under a prefix from ``start_revision`` on; ``aclose()`` ends it.

    A pump task owned by this iterator moves events into a queue, so a
    consumer may cancel ``__anext__`` (``wait_for(anext(w), t)``) without
    losing the watch, which cancelling an async generator would do.
    """

    def __init__(self, registry: EtcdRegistry, prefix: str, start_revision: int | None):
        self._registry = registry
        self._prefix = prefix
        self._queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue()
        self._pump = asyncio.get_running_loop().create_task(self._run(start_revision))
        self._finished = False

    def __aiter__(self) -> EtcdWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, WatchEvent):
            return item
        self._finished = True
        if item is None:
            raise StopAsyncIteration
        raise item

    async def aclose(self) -> None:
        self._finished = True
        self._registry._watches.discard(self)
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump

    async def _run(self, start_revision: int | None) -> None:
        registry, client, what = self._registry, self._registry._client, f"watch {self._prefix!r}"
        watch = None
        try:
            async with registry._errors(what, bounded=False):
                watch = await asyncio.wait_for(
                    client.watch_prefix(self._prefix.encode(), start_revision=start_revision),
                    registry._op_timeout,
                )
                async for event in watch:
                    kv = event.kv
                    registry._saw(kv.mod_revision)
                    self._queue.put_nowait(
                        WatchEvent(_EVENT_KINDS[event.kind], kv.key.decode(), kv.value)
                    )
            self._queue.put_nowait(None)  # the client closed
        except Exception as error:  # any failure must reach the consumer, not hang it
            self._queue.put_nowait(error)
        finally:
            if watch is not None and not registry._closed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(watch.cancel(), 2.0)
