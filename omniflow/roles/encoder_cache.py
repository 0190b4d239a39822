"""Encoder outputs by content hash: a repeated image or clip skips its encoder.

In a worker (the deployment's page pool attached) each cached tensor is a block of the
pool held by a ``TieredCache``: when the pool passes its high watermark and ``[cache]
ssd_dir`` is set, least recently used entries spill to the SSD tier and come back on a
hit. A hit hands the block itself downstream, never a copy: ``get`` takes one ref per
tensor for the request (released by ``ctx.hold`` when the request ends here), the
transport shares the block with the receiver under the receiver's own ref (released
when the receiver's request ends), and the cache's ref keeps the entry valid for as
long as the cache holds it. A miss copies the encoder's output into the pool once, the
copy the transport would otherwise make, and sends that block the same way.

Without a pool (a role built directly, as unit tests do) it is an in-process LRU of
tensors. Either way it is bounded by entries and by tensor bytes, and best effort: a
pool or SSD tier that cannot take an entry leaves it uncached, never fails the request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from omniflow.memory import (
    CacheConfig,
    PagePool,
    PoolError,
    SsdError,
    SsdShare,
    SsdStore,
    TieredCache,
)
from omniflow.roles.base import ModelActor
from omniflow.roles.ssd_sharers import deployment_ssd_sharers
from omniflow.runtime.actor import Context

log = logging.getLogger(__name__)


class _Entry:
    __slots__ = ("data", "tensors", "nbytes")

    def __init__(self, data: dict[str, Any], tensors: dict[str, Any], nbytes: int) -> None:
        self.data = data  # plain fields (grid, hash, seconds)
        self.tensors = tensors  # name -> tensor (in-process) or name -> None (in the pool)
        self.nbytes = nbytes


class EncoderOutputCache:
    """Bounded LRU of encoder outputs by content hash, in the page pool when there is one."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        pool: PagePool | None = None,
        config: CacheConfig | None = None,
        name: str = "encoder",
        ssd_sharers: int = 1,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.tiers: TieredCache | None = None
        self._ssd: SsdStore | None = None
        if pool is not None and max_entries > 0:
            config = config or CacheConfig()
            share = SsdShare(config.ssd_capacity_bytes, name, ssd_sharers)
            self._ssd = _ssd_tier(pool, config, share, max_entries, max_bytes)
            self.tiers = TieredCache(pool, self._ssd, config.high_watermark, config.low_watermark)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    async def get(self, key: str, ctx: Context) -> dict[str, Any] | None:
        """The output cached under ``key`` (tensors held for ``ctx``'s request), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        if self.tiers is None:
            self.hits += 1
            return {**entry.data, **entry.tensors}
        tensors: dict[str, torch.Tensor] = {}
        for name in entry.tensors:
            try:
                held = await self.tiers.aacquire((key, name))
            except (PoolError, SsdError) as e:  # a corrupt SSD page or a full pool: recompute
                log.warning("encoder cache: dropping %s: %s", key, e)
                held = None
            if held is None:
                self.discard(key)
                self.misses += 1
                return None
            ctx.hold(held.lease)
            tensors[name] = held.tensor
        self.hits += 1
        return {**entry.data, **tensors}

    async def put(self, key: str, output: dict[str, Any], ctx: Context) -> dict[str, Any]:
        """Cache ``output`` under ``key``; returns what to send (pool tensors held for ``ctx``)."""
        tensors = {k: v for k, v in output.items() if torch.is_tensor(v)}
        data = {k: v for k, v in output.items() if not torch.is_tensor(v)}
        size = sum(self._footprint(t) for t in tensors.values())
        if self.max_entries <= 0 or size > self.max_bytes or key in self._entries:
            return output
        if self.tiers is None:
            self._add(key, _Entry(data, tensors, size))
            return dict(output)
        pooled: dict[str, torch.Tensor] = {}
        try:
            for name, tensor in tensors.items():
                await self.tiers.aput((key, name), tensor.detach().cpu().contiguous())
                held = await self.tiers.aacquire((key, name))
                assert held is not None  # just put, and only this loop discards
                ctx.hold(held.lease)
                pooled[name] = held.tensor
        except (PoolError, SsdError, MemoryError) as e:
            log.info("encoder cache: %s not cached: %s", key, e)
            for name in tensors:
                self.tiers.discard((key, name))
            return output  # the leases already held for ctx are released with the request
        self._add(key, _Entry(data, dict.fromkeys(tensors), size))
        self._yield_to_pressure()
        return {**data, **pooled}

    def discard(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.nbytes -= entry.nbytes
        if self.tiers is not None:
            for name in entry.tensors:
                self.tiers.discard((key, name))

    def where(self, key: str) -> str | None:
        """``"process"``, ``"host"`` (the pool), ``"ssd"``, or None if not cached."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self.tiers is None:
            return "process"
        places = {self.tiers.where((key, name)) for name in entry.tensors}
        return "ssd" if "ssd" in places else "host"

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
        }

    def close(self) -> None:
        """Release every block the cache holds (and remove its SSD files)."""
        while self._entries:
            self.discard(next(iter(self._entries)))
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        if self._ssd is not None:
            self._ssd.close()  # removes its files
            self._ssd = None

    def _footprint(self, tensor: torch.Tensor) -> int:
        """Bytes ``tensor`` takes in the cache: whole pages in the pool."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.tiers is None:
            return nbytes
        page = self.tiers.pool.page_size
        return max(1, (nbytes + page - 1) // page) * page

    def _yield_to_pressure(self) -> None:
        """With no SSD tier to spill to, give pool pages back when the pool runs full.

        The pool is shared by every role's messages: a cache must not starve them.
        Entries go LRU-first until usage is under the low watermark (the newest stays).
        """
        tiers = self.tiers
        if tiers is None or tiers.ssd is not None:
            return
        if tiers.pool.stats().usage <= tiers.high:
            return
        while len(self._entries) > 1 and tiers.pool.stats().usage > tiers.low:
            self.discard(next(iter(self._entries)))

    def _add(self, key: str, entry: _Entry) -> None:
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self.discard(next(iter(self._entries)))


def role_cache(actor: Any) -> EncoderOutputCache:
    """An encoder role's cache from its options (``cache_entries``, ``cache_mb``), in the
    page pool the worker gave it (``ModelActor.use_pool``) when there is one; its SSD tier
    is its fair part of the host's cache.ssd_capacity (memory/ssd_share.py)."""
    opts = actor.options
    return EncoderOutputCache(
        opts.cache_entries,
        opts.cache_mb << 20,
        actor.pool,
        actor.cache_config,
        name=f"encoder-{actor.role}-{actor.replica}",
        ssd_sharers=deployment_ssd_sharers(),
    )


def _ssd_tier(
    pool: PagePool, config: CacheConfig, share: SsdShare, max_entries: int, max_bytes: int
) -> SsdStore | None:
    if not config.ssd_dir:
        return None
    page = pool.page_size
    # Slots for everything the cache may hold, never more than this process's share of the
    # per-host capacity (memory/ssd_share.py).
    want = ((max_bytes + page - 1) // page + 2 * max_entries) * page
    ssd = share.preallocate(config.ssd_dir, want, page)
    if ssd is None:
        log.warning(
            "%s: no SSD tier: cache.ssd_capacity (%d bytes in %s, shared by %d processes "
            "on this host) has less than a page left for it",
            share.name,
            share.capacity,
            config.ssd_dir,
            share.sharers,
        )
    return ssd


class CachingEncoder(ModelActor):
    """Base of the encoder roles: an ``EncoderOutputCache`` in ``self.cache`` (made in their
    setup) and a count of inputs actually encoded, both published in the registry record."""

    encoded = 0
    cache: EncoderOutputCache

    def meta(self) -> dict[str, Any]:
        return {"encoded": self.encoded, "encoder_cache": self.cache.stats()}

    async def close(self) -> None:
        await super().close()
        if hasattr(self, "cache"):
            self.cache.close()
