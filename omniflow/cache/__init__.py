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
    "Mapping": "omniflow.cache.mappings",
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
    "SharedWeights": "omniflow.cache.weights",
    "SsdBlock": "omniflow.cache.ssd",
    "SsdCorruption": "omniflow.cache.errors",
    "SsdError": "omniflow.cache.errors",
    "SsdStore": "omniflow.cache.ssd",
    "StaleLease": "omniflow.cache.errors",
    "TieredCache": "omniflow.cache.tiers",
    "format_size": "omniflow.cache.config",
    "mapping_at": "omniflow.cache.mappings",
    "mapping_of": "omniflow.cache.mappings",
    "parse_size": "omniflow.cache.config",
    "pid_alive": "omniflow.cache.liveness",
    "share_checkpoint": "omniflow.cache.weights",
    "unlink_pool": "omniflow.cache.segment",
}

__all__ = [
    "CacheConfig",
    "ExtraKeys",
    "InvalidHandle",
    "Lease",
    "Mapping",
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
    "SharedWeights",
    "SsdBlock",
    "SsdCorruption",
    "SsdError",
    "SsdStore",
    "StaleLease",
    "TieredCache",
    "format_size",
    "mapping_at",
    "mapping_of",
    "parse_size",
    "pid_alive",
    "share_checkpoint",
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
    from omniflow.cache.mappings import Mapping, mapping_at, mapping_of
    from omniflow.cache.pages import ExtraKeys, OutOfPages, PageUsage, PrefixMatch
    from omniflow.cache.pool import Lease, PagePool, PoolStats, PoolTensor, Reclaimed
    from omniflow.cache.prefix import RadixNode, RadixPrefixCache, Residency
    from omniflow.cache.segment import unlink_pool
    from omniflow.cache.ssd import SsdBlock, SsdStore
    from omniflow.cache.tiers import TieredCache
    from omniflow.cache.weights import SharedWeights, share_checkpoint

__getattr__ = exports(__name__, _WHERE)
