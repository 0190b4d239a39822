"""Memory and what lives in it: the host page pool, its leases, the SSD tier below it, and
the radix prefix cache that indexes paged KV.

``omniflow.cache.cuda_ipc`` (device-side pool, CUDA IPC handles) is imported on its own:
it pulls in cupy when installed. The names below import their module on first use, so
that reading a config (``CacheConfig``) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniflow.lazy import exports

_WHERE = {
    "CacheConfig": "omniflow.cache.config",
    "ExtraKeys": "omniflow.cache.pages",
    "InvalidHandle": "omniflow.cache.errors",
    "Lease": "omniflow.cache.pool",
    "OutOfPages": "omniflow.cache.pages",
    "PagePool": "omniflow.cache.pool",
    "PageUsage": "omniflow.cache.pages",
    "PoolError": "omniflow.cache.errors",
    "PoolExhausted": "omniflow.cache.errors",
    "PoolStats": "omniflow.cache.pool",
    "PoolTensor": "omniflow.cache.pool",
    "PrefixMatch": "omniflow.cache.pages",
    "RadixNode": "omniflow.cache.prefix",
    "RadixPrefixCache": "omniflow.cache.prefix",
    "Reclaimed": "omniflow.cache.pool",
    "Residency": "omniflow.cache.prefix",
    "SsdBlock": "omniflow.cache.ssd",
    "SsdCorruption": "omniflow.cache.errors",
    "SsdError": "omniflow.cache.errors",
    "SsdStore": "omniflow.cache.ssd",
    "StaleLease": "omniflow.cache.errors",
    "TieredCache": "omniflow.cache.tiers",
    "format_size": "omniflow.cache.config",
    "parse_size": "omniflow.cache.config",
    "pid_alive": "omniflow.cache.liveness",
    "unlink_pool": "omniflow.cache.segment",
}

__all__ = [
    "CacheConfig",
    "ExtraKeys",
    "InvalidHandle",
    "Lease",
    "OutOfPages",
    "PagePool",
    "PageUsage",
    "PoolError",
    "PoolExhausted",
    "PoolStats",
    "PoolTensor",
    "PrefixMatch",
    "RadixNode",
    "RadixPrefixCache",
    "Reclaimed",
    "Residency",
    "SsdBlock",
    "SsdCorruption",
    "SsdError",
    "SsdStore",
    "StaleLease",
    "TieredCache",
    "format_size",
    "parse_size",
    "pid_alive",
    "unlink_pool",
]

if TYPE_CHECKING:
    from omniflow.cache.config import CacheConfig, format_size, parse_size
    from omniflow.cache.errors import (
        InvalidHandle,
        PoolError,
        PoolExhausted,
        SsdCorruption,
        SsdError,
        StaleLease,
    )
    from omniflow.cache.liveness import pid_alive
    from omniflow.cache.pages import ExtraKeys, OutOfPages, PageUsage, PrefixMatch
    from omniflow.cache.pool import Lease, PagePool, PoolStats, PoolTensor, Reclaimed
    from omniflow.cache.prefix import RadixNode, RadixPrefixCache, Residency
    from omniflow.cache.segment import unlink_pool
    from omniflow.cache.ssd import SsdBlock, SsdStore
    from omniflow.cache.tiers import TieredCache

__getattr__ = exports(__name__, _WHERE)
