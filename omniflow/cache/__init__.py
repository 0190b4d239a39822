"""Memory and what lives in it: the host page pool, its leases, the SSD tier below it, and
the radix prefix cache that indexes paged KV.

``omniflow.cache.cuda_ipc`` (device-side pool, CUDA IPC handles) is imported on its own:
it pulls in cupy when installed.
"""

from omniflow.cache.config import CacheConfig, format_size, parse_size
from omniflow.cache.errors import (
    InvalidHandle,
    PoolError,
    PoolExhausted,
    SsdCorruption,
    SsdError,
    StaleLease,
)
from omniflow.cache.pages import ExtraKeys, OutOfPages, PageUsage, PrefixMatch
from omniflow.cache.pool import Lease, PagePool, PoolStats, PoolTensor, Reclaimed, unlink_pool
from omniflow.cache.prefix import RadixNode, RadixPrefixCache, Residency
from omniflow.cache.ssd import SsdBlock, SsdStore
from omniflow.cache.tiers import TieredCache

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
    "unlink_pool",
]
