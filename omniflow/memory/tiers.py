"""Keyed blocks in the host pool, demoted LRU-first to the SSD tier and promoted on access.

A ``TieredCache`` holds one ref on the pool block of each host-resident entry. When the
pool's usage (all processes together) passes ``high_watermark``, least recently used
entries are spilled to the SSD tier and their pages released, until usage is back under
``low_watermark`` or nothing else can move. An entry whose block someone else also holds
(a reader was handed it, or a caller ``acquire``d it) is in use and never demoted.
``acquire`` promotes an SSD-resident entry back into the pool, checking every page's
checksum on the way. The ``a*`` methods run the same work on a worker thread, so the
event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from omniflow.memory.config import CacheConfig
from omniflow.memory.errors import PoolExhausted
from omniflow.memory.pool import Lease, PagePool, PoolTensor
from omniflow.memory.ssd import SsdBlock, SsdStore


class _Entry:
    __slots__ = ("dtype", "shape", "nbytes", "lease", "ssd")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, lease: Lease):
        self.dtype, self.shape, self.nbytes = dtype, shape, nbytes
        self.lease: Lease | None = lease
        self.ssd: SsdBlock | None = None


class TieredCache:
    def __init__(
        self,
        pool: PagePool,
        ssd: SsdStore | None = None,
        high_watermark: float = 0.90,
        low_watermark: float = 0.75,
    ) -> None:
        if not 0.0 < low_watermark < high_watermark <= 1.0:
            raise ValueError(
                f"low_watermark/high_watermark: need 0 < low < high <= 1, got "
                f"low={low_watermark} high={high_watermark}"
            )
        self.pool, self.ssd = pool, ssd
        self.high, self.low = high_watermark, low_watermark
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # oldest first
        self._lock = threading.RLock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="omniflow-tiers")
        self._owns_ssd = False

    @classmethod
    def from_config(cls, pool: PagePool, config: CacheConfig, name: str) -> TieredCache:
        """A cache over ``pool`` with the SSD tier ``config`` asks for (files ``name``.*)."""
        ssd = None
        if config.ssd_dir:
            ssd = SsdStore(config.ssd_dir, config.ssd_capacity_bytes, pool.page_size, name=name)
        cache = cls(pool, ssd, config.high_watermark, config.low_watermark)
        cache._owns_ssd = True
        return cache

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def where(self, key: Hashable) -> str | None:
        """``"host"``, ``"ssd"``, or None if absent."""
        e = self._entries.get(key)
        return None if e is None else ("host" if e.lease is not None else "ssd")

    def put(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` under ``key``: a copy in the pool, or a ref if it is already there."""
        with self._lock:
            self.discard(key)
            ref = self.pool.try_share(tensor, os.getpid())
            if ref is not None:
                lease = Lease(self.pool, ref.lease, ref.offset, ref.nbytes, os.getpid())
            else:
                pt = self._make_room(lambda: self.pool.copy_in(tensor))
                lease = pt.lease
            nbytes = tensor.numel() * tensor.element_size()
            self._entries[key] = _Entry(tensor.dtype, tuple(tensor.shape), nbytes, lease)
            self.maybe_demote()

    def acquire(self, key: Hashable) -> PoolTensor | None:
        """The entry as a pool tensor with a ref for the caller (``lease.release()`` it).

        Promotes it from the SSD tier first when needed; ``SsdCorruption`` if a page
        read back does not match its checksum. None if the key is absent.
        """
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            self._entries.move_to_end(key)
            held = e.lease if e.lease is not None else self._promote(e)
            self.pool.retain(held.id)
            lease = Lease(self.pool, held.id, held.offset, e.nbytes, os.getpid())
            return PoolTensor(self.pool.tensor(lease, e.dtype, e.shape), lease)

    def discard(self, key: Hashable) -> None:
        with self._lock:
            e = self._entries.pop(key, None)
            if e is not None:
                self._drop(e)

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                self._drop(self._entries.popitem()[1])

    def close(self) -> None:
        """Drop every entry; closes (and removes) the SSD store if ``from_config`` made it."""
        self.clear()
        self._worker.shutdown(wait=True)
        if self._owns_ssd and self.ssd is not None:
            self.ssd.close()

    # ------------------------------------------------------------ tiers

    def maybe_demote(self) -> int:
        """Demote when the pool is above the high watermark; returns bytes spilled."""
        if self.ssd is None or self.pool.stats().usage <= self.high:
            return 0
        return self.demote(self.low)

    def demote(self, target_usage: float) -> int:
        """Spill LRU entries nobody else holds until pool usage <= ``target_usage``."""
        moved = 0
        with self._lock:
            while self.pool.stats().usage > target_usage:
                spilled = self._demote_one()
                if not spilled:
                    break
                moved += spilled
        return moved

    def _demote_one(self) -> int:
        """Spill the least recently used entry that only this cache holds; its bytes, or 0."""
        if self.ssd is None:
            return 0
        for e in self._entries.values():
            if e.lease is None or self.pool.refs(e.lease.id) != 1:
                continue  # on SSD already, or in use by a reader
            e.ssd = self.ssd.spill(self.pool.block_bytes(e.lease.id)[: e.nbytes])
            e.lease.release()
            e.lease = None
            return max(e.nbytes, 1)
        return 0

    def _promote(self, e: _Entry) -> Lease:
        assert e.ssd is not None and self.ssd is not None  # only SSD-resident entries come here
        lease: Lease = self._make_room(lambda: self.pool.alloc(e.nbytes))
        try:
            self.ssd.restore(e.ssd, self.pool.block_bytes(lease.id)[: e.nbytes])
        except BaseException:
            lease.release()
            raise
        self.ssd.free(e.ssd)
        e.ssd, e.lease = None, lease
        return lease

    def _make_room(self, allocate: Any) -> Any:
        while True:
            try:
                return allocate()
            except PoolExhausted:
                if not self._demote_one():
                    raise

    def _drop(self, e: _Entry) -> None:
        if e.lease is not None:
            e.lease.release()
        if e.ssd is not None and self.ssd is not None:
            self.ssd.free(e.ssd)

    # ------------------------------------------------------------ async

    async def aput(self, key: Hashable, tensor: torch.Tensor) -> None:
        await asyncio.get_running_loop().run_in_executor(self._worker, self.put, key, tensor)

    async def aacquire(self, key: Hashable) -> PoolTensor | None:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self.acquire, key)
