"""The lower tiers of paged KV: device pages copied out to the host page pool, then to SSD.

The radix tree (prefix.py) decides what moves and when: leaf-first LRU, device → host →
SSD → dropped. ``KVTiers`` only stores and copies: one host-pool block per KV page (a
``Lease`` on the deployment's pool, or on a private pool for an engine on its own), one SSD
block per page below that, and the copy back into device pages when a lower-tier hit is
promoted. ``promote`` is the only method meant for a worker thread: it touches nothing but
the handles it is given (which the tree keeps locked) and device pages nobody else holds.

``DevicePages`` is what the engine's KV tensor offers: read whole pages out, write them
back. A page's content is all layers' keys and values for its tokens.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import torch

from omniflow.memory.errors import PoolExhausted
from omniflow.memory.lease import Lease
from omniflow.memory.pool import PagePool
from omniflow.memory.ssd import SsdBlock, SsdStore
from omniflow.memory.ssd_share import SsdShare

HOST, SSD = "host", "ssd"


class DevicePages(Protocol):
    page_shape: tuple[int, ...]  # one page's K and V, all layers
    dtype: torch.dtype

    def read_pages(self, page_ids: Sequence[int]) -> torch.Tensor:
        """A new tensor [len(page_ids), *page_shape] holding those pages."""
        ...

    def write_pages(self, page_ids: Sequence[int], data: torch.Tensor) -> None:
        """Store data [len(page_ids), *page_shape] into those pages."""
        ...


class Promotion(NamedTuple):
    """Lower-tier pages on their way back into device pages (one entry per page)."""

    sources: list[tuple[str, Any]]  # (HOST, Lease) or (SSD, SsdBlock), in prefix order
    device_pages: list[int]


class KVTiers:
    def __init__(
        self,
        device: DevicePages,
        pool: PagePool,
        host_pages: int,
        ssd: SsdStore | None = None,
        *,
        owns_pool: bool = False,
    ) -> None:
        if host_pages < 1:
            raise ValueError(f"host_pages: need >= 1 page in the host tier, got {host_pages}")
        self.device = device
        self.pool = pool
        self.ssd = ssd
        self.host_capacity = host_pages
        self.host_used = 0
        self.page_nbytes = _page_nbytes(device)
        if self.page_nbytes > pool.page_size:
            raise ValueError(
                f"a KV page ({self.page_nbytes} bytes) is larger than pool {pool.name!r}'s "
                f"pages ({pool.page_size}); lower the engine's page_size or raise [cache] page_size"
            )
        self.counts = {"demoted": 0, "spilled": 0, "promoted": 0, "dropped": 0}
        self._owns_pool = owns_pool
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="omniflow-kv-promote")

    @classmethod
    def create(
        cls,
        device: DevicePages,
        host_bytes: int,
        ssd_dir: str | None = None,
        ssd_bytes: int = 0,
        pool: PagePool | None = None,
        ssd_share: SsdShare | None = None,
    ) -> KVTiers:
        """Tiers of ``host_bytes`` in ``pool`` (one pool page per KV page) and ``ssd_bytes``
        in ``ssd_dir``. Without a pool, one of this process's own is made, its name unlinked
        at once: nothing to clean up if the process dies. With ``ssd_share`` the SSD tier is
        at most this process's share of the host's cache.ssd_capacity (memory/ssd_share.py),
        and none where that is spent (``ssd`` None)."""
        name = f"omniflow-kv-{os.getpid()}-{next(_ids)}"
        owns_pool = pool is None
        page_nbytes = _page_nbytes(device)
        # One pool page per KV page: a private pool is sized in whole KV pages.
        host_pages = max(1, host_bytes // (page_nbytes if pool is None else pool.page_size))
        if pool is None:
            block = max(4096, 1 << (page_nbytes - 1).bit_length())
            pool = PagePool.create(name, host_pages * block, block, populate=False, pin=False)
            pool.unlink()
        ssd = None
        if ssd_dir and ssd_bytes > 0:
            want = max(1, ssd_bytes // pool.page_size) * pool.page_size
            if ssd_share is not None:
                ssd = ssd_share.preallocate(ssd_dir, want, pool.page_size, sync=False)
            else:
                ssd = SsdStore(ssd_dir, want, pool.page_size, name=name, sync=False)
        return cls(device, pool, host_pages, ssd, owns_pool=owns_pool)

    # ------------------------------------------------------------ capacity

    @property
    def host_free(self) -> int:
        return self.host_capacity - self.host_used

    @property
    def ssd_free(self) -> int:
        return 0 if self.ssd is None else self.ssd.free_slots

    # ------------------------------------------------------------ moves (engine thread)

    def to_host(self, device_pages: Sequence[int]) -> list[Lease] | None:
        """Copy device pages into new host blocks; None (nothing taken) if they do not fit."""
        if len(device_pages) > self.host_free:
            return None
        leases: list[Lease] = []
        try:
            for _ in device_pages:
                leases.append(self.pool.alloc(self.page_nbytes))
        except PoolExhausted:  # the pool is shared: other roles may hold the rest
            for lease in leases:
                lease.release()
            return None
        data = self.device.read_pages(device_pages)
        for lease, page in zip(leases, data, strict=True):
            self._host_view(lease).copy_(page)
        self.host_used += len(leases)
        self.counts["demoted"] += len(leases)
        return leases

    def to_ssd(self, leases: Sequence[Lease]) -> list[SsdBlock] | None:
        """Spill host blocks to SSD and release them; None (nothing moved) if SSD is full."""
        if self.ssd is None or len(leases) > self.ssd.free_slots:
            return None
        blocks = [self.ssd.spill(self._host_view(lease)) for lease in leases]
        self._free(HOST, leases)
        self.counts["spilled"] += len(blocks)
        return blocks

    def drop(self, tier: str, handles: Sequence[Any]) -> None:
        """Let go of pages for good (evicted past the last tier, or superseded)."""
        self._free(tier, handles)
        self.counts["dropped"] += len(handles)

    def _free(self, tier: str, handles: Sequence[Any]) -> None:
        for handle in handles:
            if tier == HOST:
                handle.release()
                self.host_used -= 1
            else:
                assert self.ssd is not None
                self.ssd.free(handle)

    # ------------------------------------------------------------ promotion

    def promote(self, job: Promotion) -> Future[None]:
        """Copy ``job``'s lower-tier pages into its device pages on the worker thread.

        The sources stay where they are until the tree finishes the job (``finish``). The
        host views are made here, so the worker runs a few large copies and needs the GIL
        only briefly: a busy engine thread would otherwise hand it over every switch
        interval, once per small step.
        """
        host = {
            row: self._host_view(h) for row, (tier, h) in enumerate(job.sources) if tier == HOST
        }
        return self._worker.submit(self._copy_up, job, host)

    def _copy_up(self, job: Promotion, host: dict[int, torch.Tensor]) -> None:
        if len(host) == len(job.sources):
            data = torch.stack([host[row] for row in range(len(job.sources))])
        else:
            data = torch.empty((len(job.sources), *self.device.page_shape), dtype=self.device.dtype)
            for row, (tier, handle) in enumerate(job.sources):
                if tier == HOST:
                    data[row].copy_(host[row])
                else:
                    assert self.ssd is not None
                    self.ssd.restore(handle, data[row])
        self.device.write_pages(job.device_pages, data)

    def finish(self, job: Promotion) -> None:
        """After a promotion's copy: free its lower-tier sources."""
        for tier, handle in job.sources:
            self._free(tier, [handle])
        self.counts["promoted"] += len(job.sources)

    # ------------------------------------------------------------ helpers

    def _host_view(self, lease: Lease) -> torch.Tensor:
        return self.pool.tensor(lease, self.device.dtype, self.device.page_shape)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        if self.ssd is not None:
            self.ssd.close()
        if self._owns_pool:
            self.pool.close()


def _page_nbytes(device: DevicePages) -> int:
    return int(torch.Size(device.page_shape).numel()) * device.dtype.itemsize


_ids = itertools.count()
