"""The small result types every paged-KV allocator shares (engine and cache alike).

They live in the cache layer so omniflow.memory can implement the engine's PageAllocator
protocol without importing omniflow.engine (a higher layer); the engine re-exports them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

# One optional key per token, mixed into the prefix key: the content hash of the image or
# audio span the position belongs to, so equal placeholder ids of different media never match.
ExtraKeys = Sequence[Hashable | None]


class PrefixMatch(NamedTuple):
    page_ids: list[int]  # acquired (ref-counted) pages holding the matched prefix, in order
    num_tokens: int  # tokens covered: len(page_ids) * page_size
    # Radix nodes that continue the prefix in a lower tier (host pool, SSD), locked for the
    # caller to promote into device pages or give back; empty without KV tiers.
    lower: Sequence[Any] = ()


class PageUsage(NamedTuple):
    total_pages: int
    free_pages: int  # allocatable now, counting cached pages nobody references
    cached_pages: int  # pages reachable through the prefix index


class OutOfPages(RuntimeError):
    pass
