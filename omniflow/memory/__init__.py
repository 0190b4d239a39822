"""Host memory: the shared page pool, its segments and leases, the SSD tier below it, keyed
blocks tiered between them, shared weights, pinned registration and CUDA IPC. The paged KV
allocator that lives in this memory is omniflow.kv.

``omniflow.memory.cuda_ipc`` (device-side pool, CUDA IPC handles) is imported on its own:
it pulls in cupy when installed. The names below import their module on first use, so
that reading a config (``CacheConfig``) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omniflow.lazy import exports

_WHERE = {
    "CacheConfig": "omniflow.memory.config",
    "InvalidHandle": "omniflow.memory.errors",
    "Lease": "omniflow.memory.pool",
    "Mapping": "omniflow.memory.mappings",
    "PagePool": "omniflow.memory.pool",
    "PoolError": "omniflow.memory.errors",
    "PoolExhausted": "omniflow.memory.errors",
    "PoolStats": "omniflow.memory.pool",
    "PoolTensor": "omniflow.memory.pool",
    "Reclaimed": "omniflow.memory.pool",
    "SharedWeights": "omniflow.memory.weights",
    "SsdBlock": "omniflow.memory.ssd",
    "SsdCorruption": "omniflow.memory.errors",
    "SsdError": "omniflow.memory.errors",
    "SsdShare": "omniflow.memory.ssd_share",
    "SsdStore": "omniflow.memory.ssd",
    "StaleLease": "omniflow.memory.errors",
    "TieredCache": "omniflow.memory.tiers",
    "host_share": "omniflow.memory.ssd_share",
    "format_size": "omniflow.memory.config",
    "mapping_at": "omniflow.memory.mappings",
    "mapping_of": "omniflow.memory.mappings",
    "parse_size": "omniflow.memory.config",
    "pid_alive": "omniflow.memory.liveness",
    "share_checkpoint": "omniflow.memory.weights",
    "unlink_pool": "omniflow.memory.segment",
}

__all__ = [
    "CacheConfig",
    "InvalidHandle",
    "Lease",
    "Mapping",
    "PagePool",
    "PoolError",
    "PoolExhausted",
    "PoolStats",
    "PoolTensor",
    "Reclaimed",
    "SharedWeights",
    "SsdBlock",
    "SsdCorruption",
    "SsdError",
    "SsdShare",
    "SsdStore",
    "StaleLease",
    "TieredCache",
    "format_size",
    "host_share",
    "mapping_at",
    "mapping_of",
    "parse_size",
    "pid_alive",
    "share_checkpoint",
    "unlink_pool",
]

if TYPE_CHECKING:
    from omniflow.memory.config import CacheConfig, format_size, parse_size
    from omniflow.memory.errors import (
        InvalidHandle,
        PoolError,
        PoolExhausted,
        SsdCorruption,
        SsdError,
        StaleLease,
    )
    from omniflow.memory.liveness import pid_alive
    from omniflow.memory.mappings import Mapping, mapping_at, mapping_of
    from omniflow.memory.pool import Lease, PagePool, PoolStats, PoolTensor, Reclaimed
    from omniflow.memory.segment import unlink_pool
    from omniflow.memory.ssd import SsdBlock, SsdStore
    from omniflow.memory.ssd_share import SsdShare, host_share
    from omniflow.memory.tiers import TieredCache
    from omniflow.memory.weights import SharedWeights, share_checkpoint

__getattr__ = exports(__name__, _WHERE)
